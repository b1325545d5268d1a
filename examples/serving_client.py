"""``demo_round_trip``: the embedded SmolLM2 behind the server on loopback, one chat request through the
official ``openai`` client (the ``demo`` extra), the reply and its speed.

The engine compiles every step shape before the server starts (``Engine.warm_up``, as ``python -m serving serve``
does before ``/health`` says ready), so the timed request is the first one and compiles nothing."""

import time

import jax.numpy as jnp

from serving import Engine
from serving.api.server import Server, create_app

DEMO_MODEL = "smollm2"
DEMO_QUESTION = "What is the capital of France? Answer in one sentence."


def demo_round_trip(max_tokens: int = 32, question: str = DEMO_QUESTION) -> dict:
    """Serve SmolLM2-135M-Instruct on 127.0.0.1 (a free port), warmed up, ask ``question`` once and return
    {"reply", "completion_tokens", "tokens_per_s", "warm_up_s", "url"}; the server is stopped before returning."""
    import openai  # a test/demo dependency, not needed to serve

    engine = Engine.from_default(dtype=jnp.float32, max_running=4)
    start = time.perf_counter()
    engine.warm_up()
    warm_up_s = time.perf_counter() - start
    with Server(create_app(engine, DEMO_MODEL)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        ask = lambda: client.chat.completions.create(model=DEMO_MODEL, max_tokens=max_tokens, temperature=0.0,
                                                     messages=[{"role": "user", "content": question}])
        start = time.perf_counter()
        response = ask()
        seconds = time.perf_counter() - start
    tokens = response.usage.completion_tokens
    result = {"reply": response.choices[0].message.content, "completion_tokens": tokens,
              "tokens_per_s": tokens / seconds, "warm_up_s": warm_up_s,
              "url": server.url}
    return result
