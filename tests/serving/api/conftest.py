"""Fixtures of the API tests: a loopback server over the tiny Llama fixture, one per test module (``api_server``),
and the unmodified OpenAI and Anthropic clients pointed at it (``oai``, ``claude``). A module that needs a server
set up otherwise (an API key, a models root, a small cache) defines its own fixture under another name."""

import anthropic
import openai
import pytest
from helpers.server import make_engine, model_folder, running_server

CLIENT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    engine = make_engine(model_folder(tmp_path_factory.mktemp("models")))
    with running_server(engine) as (server, _):
        yield server


@pytest.fixture(scope="module")
def oai(api_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", timeout=CLIENT_TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def claude(api_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api_server.url, api_key="unused", timeout=CLIENT_TIMEOUT_S, max_retries=0)
