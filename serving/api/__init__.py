"""HTTP serving: OpenAI- and Anthropic-compatible API over one engine (fastapi + uvicorn).

Data flow: a route (``openai_api.py``, ``anthropic_api.py``) parses and checks the request (``frontend.py``),
then submits it to ``AsyncEngine`` (``async_engine.py``), whose thread owns the ``Engine`` and steps it; the
outputs come back on an asyncio queue per request and go out as JSON or server-sent events. ``security.py``
guards the door (bind address, API key, body size, model paths), ``metrics.py`` counts, ``server.py`` puts it
together and runs uvicorn, ``cli.py`` is ``python -m serving serve|chat``.
"""

from serving.api.server import Server, create_app

__all__ = ["Server", "create_app"]
