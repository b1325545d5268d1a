"""Who may talk to the server, and what they may send: bind address, API key, body size, model paths.

- The server binds 127.0.0.1 unless told otherwise, and refuses any other address without an API key
  (``check_bind``).
- With a key, every route but ``/health`` needs ``Authorization: Bearer KEY`` (the scheme in any case) or
  ``x-api-key: KEY`` (Anthropic's header); either header holding the key is enough. Keys are compared in
  constant time (``hmac.compare_digest``) and never logged; a blank key is refused at start-up.
- A body larger than ``max_body_bytes`` gets 413 before it is parsed: at once from ``Content-Length``, or
  while it is read when the client streams it without one. A body that stops arriving for
  ``BODY_READ_TIMEOUT_S`` gets 408. A request uvicorn cannot parse (a Content-Length that is not a number)
  gets a 400 in the OpenAI error shape (``JSONErrorHTTPProtocol``).
- A model a client names is resolved under the models root only (``resolve_model_path``): no absolute path,
  no ``..``, and no symlink that leads outside.
"""

import asyncio
import hmac
import json
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serving.api.errors import APIError, error_body, error_response

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_HOST = "127.0.0.1"
OPEN_PATHS = ("/health", "/dashboard")  # without the key: load balancer probes, the static page (its stats need it)
MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: a 128k-token prompt as JSON text with room to spare
# a client that stops sending its body for this long gets a 408 and its connection back: a slow client on a bad
# link still sends something every few seconds, one holding a connection open on purpose does not
BODY_READ_TIMEOUT_S = 30.0


def check_api_key(api_key: str | None) -> None:
    """Refuse a key that is blank or only whitespace (``--api-key " "``: a typo, not a secret)."""
    if api_key is not None and not api_key.strip():
        raise ValueError(f"api key {api_key!r} is blank: expected a non-empty secret (or no key at all)")


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse a blank key, and to listen beyond loopback without an API key."""
    check_api_key(api_key)
    if host not in LOOPBACK_HOSTS and not api_key:
        raise ValueError(f"--host {host!r} exposes the server beyond this machine: expected --api-key too "
                         f"(or a loopback host {LOOPBACK_HOSTS})")


def resolve_model_path(root: Path, name: str) -> Path:
    """The path of model ``name`` under ``root``; ``APIError(400)`` if it is absolute or leaves ``root``
    (``..`` or a symlink out)."""
    if not name or Path(name).is_absolute() or ".." in Path(name).parts or "\\" in name or "\x00" in name:
        raise APIError(400, f"model {name!r}: expected a name relative to the models folder, without '..'",
                       "model")
    root = root.resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise APIError(400, f"model {name!r} resolves outside the models folder", "model")
    return path


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class _BodyTooLarge(Exception):
    pass


class _BodyTimeout(Exception):
    pass


def _given_keys(scope: Scope) -> list[str]:
    """The keys a request offers: ``Authorization: Bearer KEY`` (the scheme in any case) and ``x-api-key``."""
    keys = []
    scheme, _, token = (_header(scope, b"authorization") or "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if (key := _header(scope, b"x-api-key")) is not None:
        keys.append(key.strip())
    return keys


class GuardMiddleware:
    """ASGI middleware: the API key check, the body size limit and the body read timeout (see the module
    docstring). A request is authorized when any key it offers is the server's: a stale ``Authorization``
    header a client library adds does not hide a correct ``x-api-key``."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int = MAX_BODY_BYTES,
                 body_timeout_s: float = BODY_READ_TIMEOUT_S):
        check_api_key(api_key)
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self._key = api_key.encode() if api_key else None

    def _authorized(self, scope: Scope) -> bool:
        matches = [hmac.compare_digest(key.encode(), self._key) for key in _given_keys(scope)]
        return any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self._key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
            return await error_response(path, error)(scope, receive, send)
        length = _header(scope, b"content-length")
        too_large = APIError(413, f"request body over the limit of {self.max_body_bytes} bytes")
        if length is not None and not length.isdigit():
            error = APIError(400, f"invalid Content-Length header {length!r:.50}: expected a byte count")
            return await error_response(path, error)(scope, receive, send)
        if length is not None and int(length) > self.max_body_bytes:
            return await error_response(path, too_large)(scope, receive, send)
        received, started, body_done = 0, False, False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # after the body only a disconnect can come, whenever it does
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except TimeoutError:
                raise _BodyTimeout from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await error_response(path, too_large)(scope, receive, send)
        except _BodyTimeout:
            if not started:
                error = APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s")
                await error_response(path, error)(scope, receive, send)


class JSONErrorHTTPProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol over httptools (a C parser and writer, not the pure-Python h11: every SSE chunk
    goes through it), answering a request it cannot parse (a bad request line, a Content-Length that is not a
    number, broken chunked framing) in the OpenAI error shape instead of plain text: nothing of the request is
    known then, not even its path."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body("", 400, f"invalid HTTP request (request line, headers such as Content-Length, "
                                             f"or body framing): {msg}")).encode()
        head = [b"HTTP/1.1 400 Bad Request", b"content-type: application/json",
                b"content-length: " + str(len(body)).encode(), b"connection: close"]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()
