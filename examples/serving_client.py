"""``demo_round_trip``: the embedded SmolLM2 behind the server on loopback, one chat request through the
official ``openai`` client (the ``demo`` extra), the reply and its speed.

The engine compiles every step shape before the server starts (``Engine.warm_up``, as ``python -m serving serve``
does before ``/health`` says ready), so the timed request is the first one and compiles nothing."""

import time

import jax.numpy as jnp

from serving import Engine
from serving.api.server import Server, create_app

DEMO_MODEL = "smollm2"
# An answer of ~44 tokens: its decode rate is timed over 43 steps, not the 7 of a one-sentence answer.
DEMO_QUESTION = "Name the first five planets from the Sun, with one fact about each."


def demo_round_trip(max_tokens: int = 64, question: str = DEMO_QUESTION) -> dict:
    """Serve SmolLM2-135M-Instruct on 127.0.0.1 (a free port), warmed up, ask ``question`` once, streamed, and return
    {"reply", "completion_tokens", "tokens_per_s", "ttft_s", "total_s", "warm_up_s", "url"}: ``tokens_per_s`` is
    the decode rate a client sees, (tokens - 1) / (time of the chunk that ends the answer - time of the first
    token), and ``ttft_s`` the time to the first token (the prompt's prefill and the first step); the server is
    stopped before returning. The end is the chunk carrying ``finish_reason``, not the last text: an answer's last
    token is often its end-of-turn token, which streams no text (8 tokens, 7 text chunks for the default question),
    and timing tokens - 1 steps over the text chunks' 6 would overstate the rate by 7/6."""
    import openai  # a test/demo dependency, not needed to serve

    engine = Engine.from_default(dtype=jnp.float32, max_running=4, max_model_len=1024)  # a short chat: fewer shapes
    start = time.perf_counter()
    engine.warm_up()
    warm_up_s = time.perf_counter() - start
    with Server(create_app(engine, DEMO_MODEL)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        start = time.perf_counter()
        stream = client.chat.completions.create(model=DEMO_MODEL, max_tokens=max_tokens, temperature=0.0, stream=True,
                                                stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": question}])
        pieces, arrivals, tokens, finished_s = [], [], 0, None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                arrivals.append(time.perf_counter() - start)
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                finished_s = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        total_s = time.perf_counter() - start
    decode_s = (finished_s or arrivals[-1]) - arrivals[0]
    return {"reply": "".join(pieces), "completion_tokens": tokens,
            "tokens_per_s": (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0,
            "ttft_s": arrivals[0], "total_s": total_s, "warm_up_s": warm_up_s, "url": server.url}
