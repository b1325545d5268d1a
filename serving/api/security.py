"""Who may talk to the server, and what they may send: bind address, API key, body size, model paths.

- The server binds 127.0.0.1 unless told otherwise, and refuses any other address without an API key
  (``check_bind``).
- With a key, every route but ``/health`` needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``
  (Anthropic's header), compared in constant time (``hmac.compare_digest``). The key is never logged.
- A body larger than ``max_body_bytes`` gets 413 before it is parsed: at once from ``Content-Length``, or
  while it is read when the client streams it without one.
- A model a client names is resolved under the models root only (``resolve_model_path``): no absolute path,
  no ``..``, and no symlink that leads outside.
"""

import hmac
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.api.errors import APIError, error_response

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_HOST = "127.0.0.1"
OPEN_PATHS = ("/health", "/dashboard")  # without the key: load balancer probes, the static page (its stats need it)
MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: a 128k-token prompt as JSON text with room to spare


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without an API key."""
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


class GuardMiddleware:
    """ASGI middleware: the API key check and the body size limit (see the module docstring)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_body_bytes = app, max_body_bytes
        self._key = api_key.encode() if api_key else None

    def _authorized(self, scope: Scope) -> bool:
        bearer = _header(scope, b"authorization") or ""
        given = bearer[len("Bearer "):] if bearer.startswith("Bearer ") else _header(scope, b"x-api-key") or ""
        return hmac.compare_digest(given.encode(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self._key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
            return await error_response(path, error)(scope, receive, send)
        length = _header(scope, b"content-length")
        too_large = APIError(413, f"request body over the limit of {self.max_body_bytes} bytes")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await error_response(path, too_large)(scope, receive, send)
        received, started = 0, False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
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
