"""API errors in the two wire shapes: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` and
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (every route under ``/v1/messages``)."""

import json
from typing import Any

from starlette.responses import JSONResponse

ANTHROPIC_PREFIX = "/v1/messages"
# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error"}
# OpenAI's error type for each status
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout", 413: "invalid_request_error", 503: "server_overloaded"}
# any other 4xx (405, 415, 499, ...) is the request's fault, any other 5xx ours
CLIENT_ERROR = {"anthropic": "invalid_request_error", "openai": "invalid_request_error"}
SERVER_ERROR = {"anthropic": "api_error", "openai": "server_error"}
RETRY_AFTER_S = 1  # Retry-After of a 503: the queue drains within about a second at typical load


class APIError(Exception):
    """An error to return to the client with HTTP ``status``; ``param`` names the offending request field."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def overloaded(message: str) -> APIError:
    return APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PREFIX)


def error_type(path: str, status: int) -> str:
    """The error ``type`` field of the API ``path`` belongs to, for HTTP ``status``."""
    api, types = ("anthropic", ANTHROPIC_TYPES) if is_anthropic(path) else ("openai", OPENAI_TYPES)
    return types.get(status) or (CLIENT_ERROR if 400 <= status < 500 else SERVER_ERROR)[api]


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The JSON error body for a request to ``path``."""
    if is_anthropic(path):
        return {"type": "error", "error": {"type": error_type(path, status), "message": message}}
    return {"error": {"message": message, "type": error_type(path, status), "param": param, "code": status}}


def error_response(path: str, error: APIError) -> JSONResponse:
    return JSONResponse(error_body(path, error.status, error.message, error.param), error.status, error.headers)


def sse_error(path: str, status: int, message: str) -> str:
    """An error as a server-sent event (OpenAI: a ``data:`` line; Anthropic: an ``event: error``)."""
    data = json.dumps(error_body(path, status, message))
    return f"event: error\ndata: {data}\n\n" if is_anthropic(path) else f"data: {data}\n\n"
