"""Security: loopback by default, no public bind without a key, the key on every route but /health (Bearer
or x-api-key), never logged; client-named models cannot leave the models root. Plus the serve/chat CLI."""

import json
import logging
import socket
import time

import anthropic
import httpx
import openai
import pytest
from helpers.server import MODEL_NAME, make_engine, model_folder, running_server
from rich.console import Console

from serving.__main__ import main, parser
from serving.api.cli import chat_loop
from serving.api.errors import APIError
from serving.api.security import check_bind, resolve_model_path
from serving.api.server import Server, create_app

KEY = "sk-test-0123456789abcdef"
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    folder = model_folder(root)
    (root / "link-out").symlink_to(tmp_path_factory.mktemp("elsewhere"))
    return root, folder


@pytest.fixture(scope="module")
def server(models):
    root, folder = models
    engine = make_engine(folder)
    with running_server(engine, api_key=KEY, model_path=folder, models_root=root) as (server, _):
        yield server


def test_serve_binds_loopback_by_default_and_refuses_public_without_a_key(capsys):
    assert parser().parse_args(["serve"]).host == "127.0.0.1"
    with pytest.raises(SystemExit, match="0.0.0.0.*--api-key"):
        main(["serve", "--host", "0.0.0.0", "--model", "no-such-model"])  # refused before loading anything
    check_bind("0.0.0.0", KEY)
    check_bind("127.0.0.1", None)
    with pytest.raises(ValueError, match="'::'"):
        check_bind("::", None)
    for blank in ("", " ", "\t\n"):  # a typo, not a secret: refused even on loopback
        with pytest.raises(ValueError, match="is blank"):
            check_bind("127.0.0.1", blank)
    with pytest.raises(SystemExit, match="is blank"):
        main(["serve", "--host", "0.0.0.0", "--api-key", " ", "--model", "no-such-model"])


def test_every_route_but_health_needs_the_key(server):
    url = server.url
    assert httpx.get(f"{url}/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401
        assert httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    unauthorized = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{url}/v1/chat/completions", json=body).json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=TIMEOUT_S).status_code == 200


def test_any_header_with_the_key_is_accepted_and_the_scheme_is_case_insensitive(server):
    def status(headers: dict[str, str]) -> int:
        return httpx.get(f"{server.url}/v1/models", headers=headers).status_code

    for scheme in ("Bearer", "bearer", "BEARER"):
        assert status({"Authorization": f"{scheme} {KEY}"}) == 200
        assert status({"Authorization": f"{scheme}  {KEY}"}) == 200
    # a stale Authorization a client library adds does not hide the right x-api-key, nor the other way round
    assert status({"Authorization": "Bearer sk-other", "x-api-key": KEY}) == 200
    assert status({"Authorization": f"Bearer {KEY}", "x-api-key": "wrong"}) == 200
    for wrong in ({"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"},
                  {"Authorization": "Bearer wrong", "x-api-key": "wrong"}, {"x-api-key": ""}):
        assert status(wrong) == 401, wrong


def test_a_body_that_stops_arriving_gets_a_408(models):
    _, folder = models
    with running_server(make_engine(folder), body_timeout_s=0.5) as (server, _):
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": ")  # and then nothing
            start, data = time.monotonic(), b""
            while b"\r\n\r\n" not in data or not data.endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 5
        assert json.loads(body)["error"]["type"] == "timeout_error"
        assert httpx.get(f"{server.url}/health").status_code == 200  # and the server goes on


def test_official_clients_with_the_key(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
    assert oai.chat.completions.create(model=MODEL_NAME, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}]).choices[0].message
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
    assert claude.messages.create(model=MODEL_NAME, max_tokens=2,
                                  messages=[{"role": "user", "content": "hi"}]).content
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_the_key_is_never_logged(models, caplog):
    _, folder = models
    caplog.set_level(logging.DEBUG)
    with Server(create_app(make_engine(folder), MODEL_NAME, api_key=KEY), log_level="debug") as server:
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {"Authorization": "Bearer bad"}):
            httpx.get(f"{server.url}/v1/models", headers=headers)
    records = [(r.name, r.getMessage()) for r in caplog.records]
    assert any(name == "uvicorn.access" and "/v1/models" in text for name, text in records)  # the access log ...
    assert not any(KEY in text for _, text in records)  # ... and every other record, without the key


def test_model_paths_cannot_escape_the_models_root(models, server):
    root, folder = models
    assert resolve_model_path(root, MODEL_NAME) == folder.resolve()
    for name in ("..", "../etc/passwd", f"{MODEL_NAME}/../..", "/etc/passwd", str(folder), "link-out",
                 "link-out/x", "a\\..\\b", ""):
        with pytest.raises(APIError, match="model"):
            resolve_model_path(root, name)
    headers = {"Authorization": f"Bearer {KEY}"}

    def status(model: str) -> int:
        body = {"model": model, "prompt": "a", "max_tokens": 1}
        return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT_S).status_code

    # the served model by its name and by its path under the root; escapes are 400, other names 404
    assert [status(m) for m in (MODEL_NAME, f"./{MODEL_NAME}", "../x", "link-out", "/etc", "other")] == \
        [200, 200, 400, 400, 400, 404]


def test_chat_loop_streams_answers_through_the_openai_client(models):
    _, folder = models
    turns = iter(["hello", "and again", "/exit"])
    console = Console(record=True, width=200)
    with running_server(make_engine(folder)) as (server, _):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        messages = chat_loop(client, MODEL_NAME, lambda prompt: next(turns), console, system="Be brief.",
                             max_tokens=4, temperature=0.0)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    output = console.export_text()
    assert output.count("assistant>") == 2 and messages[2]["content"] and messages[2]["content"] in output
