"""The FastAPI app over one engine (``create_app``) and a uvicorn server on a background thread (``Server``).

The engine runs on a thread of this process (an ``Engine``: ``AsyncEngine``) or in an engine core process of
its own (an ``EngineSpec``: ``ProcessEngine``), so that HTTP, tokenization, JSON and SSE here never hold the GIL
the scheduler and device steps need.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/models`` and
``/v1/models/{id}`` (OpenAI), ``/v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic),
``/health`` (200 ``{"status": "ok"}`` while the engine serves, 503 ``{"status": "warming", ...}`` until it is
ready and 503 once it stopped; never needs the key) and ``/metrics`` (Prometheus). Every
error, unknown routes and unexpected exceptions included, has the JSON shape of the API it was sent to, and
every response an ``x-request-id`` header.
``/dashboard``: a live page of the server's load with a chat box, and ``/dashboard/stats``, the JSON it polls.
"""

import contextlib
import logging
import re
import threading
import time
import uuid
from pathlib import Path

import anyio
import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.api import security
from serving.api.anthropic_api import AnthropicRoutes
from serving.api.async_engine import AsyncEngine
from serving.api.dashboard import DashboardRoutes
from serving.api.engine_client import OK, WARMING
from serving.api.engine_spec import EngineSpec
from serving.api.errors import APIError, error_response
from serving.api.frontend import Frontend
from serving.api.images import ImageOptions
from serving.api.metrics import Metrics
from serving.api.openai_api import OpenAIRoutes
from serving.api.process_engine import ProcessEngine
from serving.api.responses_api import ResponsesRoutes
from serving.api.security import BODY_READ_TIMEOUT_S, DEFAULT_HOST, MAX_BODY_BYTES, GuardMiddleware, check_api_key
from serving.llm_engine import Engine

STARTUP_TIMEOUT_S = 60.0  # how long ``Server.start`` waits for uvicorn to listen
POLL_S = 0.01
# a client's own x-request-id is echoed when it looks like an id (a proxy's trace id), else one is made
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# uvicorn as the server runs it: uvloop's event loop and the httptools parser (C, not pure-Python asyncio and h11:
# the front end's time per streamed chunk is what a client waits for at high concurrency), a JSON 400 for a
# request it cannot parse, and a second for the streams still open at shutdown.
UVICORN_OPTIONS = {"loop": "uvloop", "http": security.JSONErrorHTTPProtocol, "timeout_graceful_shutdown": 1}
ENGINE_WATCH_S = 0.5  # how often ``serve`` checks that its engine still runs
log = logging.getLogger(__name__)


def _request_id(scope: Scope) -> str:
    for key, value in scope["headers"]:
        if key == b"x-request-id" and CLIENT_REQUEST_ID.fullmatch(given := value.decode("latin-1")):
            return given
    return f"req_{uuid.uuid4().hex}"


class _CountRequests:
    """ASGI middleware: count requests by route and HTTP status (unknown paths count as route "other"), and
    give every response an ``x-request-id`` header."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"

        request_id = _request_id(scope).encode()

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(engine: Engine | EngineSpec, model_name: str, *, model_path: Path | None = None,
               models_root: Path | None = None, api_key: str | None = None, max_queue: int | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_READ_TIMEOUT_S,
               image_options: ImageOptions | None = None) -> FastAPI:
    """The app serving ``engine`` as ``model_name``; the engine runs while the app does (lifespan): an ``Engine``
    on a thread of this process, an ``EngineSpec`` built and run in an engine core process.

    Args:
      model_path, models_root: clients may name the model by its path under ``models_root`` too.
      api_key: required on every route but /health when set; a blank one is a ValueError.
      body_timeout_s: a request whose body stops arriving for this long gets a 408.
      max_queue: sequences admitted beyond the engine's max_running (default: the engine's max_queue; with
        an ``EngineSpec``, its own).
      image_options: limits on image inputs and whether remote image URLs are fetched (default: ``ImageOptions()``,
        no fetching).
    """
    check_api_key(api_key)  # a blank key is refused before an engine starts
    if isinstance(engine, EngineSpec):
        if max_queue is not None:
            raise ValueError(f"create_app: max_queue={max_queue} with an EngineSpec: expected it in the spec")
        async_engine = ProcessEngine(engine)
    else:
        async_engine = AsyncEngine(engine, max_queue)
    metrics = Metrics(async_engine)
    async_engine.on_step = metrics.on_step
    frontend = Frontend(async_engine, model_name, model_path, models_root, metrics, image_options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        # anyio imports its asyncio backend at first use, which is a streamed answer's task group (starlette's
        # StreamingResponse): tens of ms, more on a cold disk, that the first request's TTFT would pay
        async with anyio.create_task_group():
            pass
        yield
        async_engine.stop()

    app = FastAPI(title="serving", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = frontend
    routers = [OpenAIRoutes(frontend).router, ResponsesRoutes(frontend).router, AnthropicRoutes(frontend).router,
               DashboardRoutes(frontend).router]
    for router in routers:
        app.include_router(router)

    @app.get("/health")
    async def health() -> Response:
        status = async_engine.status()
        return JSONResponse(status, 200 if status["status"] == OK else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> Response:
        return error_response(request.url.path, error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        return error_response(request.url.path, APIError(error.status_code, f"{request.method} {request.url.path}: "
                                                         f"{error.detail}"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        return error_response(request.url.path, APIError(500, f"internal error: {type(error).__name__}"))

    routes = {route.path for router in routers for route in router.routes} | {"/health", "/metrics"}
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s)
    app.add_middleware(_CountRequests, metrics=metrics, routes=routes)
    return app


class Server:
    """uvicorn serving ``app`` on a background thread (tests, demos, the in-process chat).

    ``port=0`` picks a free port; ``url`` is known once ``start`` returns.
    """

    def __init__(self, app: FastAPI, host: str = DEFAULT_HOST, port: int = 0, log_level: str = "warning"):
        # log_config=None: uvicorn's records go to the host program's logging instead of new stdout handlers
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=None,
                                                    **UVICORN_OPTIONS))
        self.thread = threading.Thread(target=self.server.run, name="serving-http", daemon=True)
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Server":
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.host} did not start")
            time.sleep(POLL_S)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(app: FastAPI, host: str = DEFAULT_HOST, port: int = 8000, api_key: str | None = None,
          log_level: str = "info") -> None:
    """Serve ``app`` in the foreground (the CLI); refuses a non-loopback ``host`` without ``api_key``.

    The server ends, and this raises ``SystemExit`` naming why, once its engine has stopped on its own (an engine
    core that could not load the model or warm up, or whose process died; the in-process engine's thread ended):
    such a server could answer nothing but 503s until restarted, and a supervisor restarts a process that exits."""
    security.check_bind(host, api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, **UVICORN_OPTIONS))
    engine, stopped = app.state.frontend.async_engine, []

    def watch() -> None:
        while not server.should_exit:
            status = engine.status()  # before start-up (the lifespan starts the engine) an engine reads stopped
            if server.started and status["status"] not in (OK, WARMING) and not server.should_exit:
                stopped.append(status)
                server.should_exit = True
                return
            time.sleep(ENGINE_WATCH_S)

    threading.Thread(target=watch, name="serving-engine-watch", daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down for, as uvicorn.run swallows it
        pass
    if stopped:
        detail = stopped[0].get("error")
        raise SystemExit(f"serve stopped: {stopped[0]['status']}{': ' + detail if detail else ''}")
