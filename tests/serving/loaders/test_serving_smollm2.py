"""End to end on the embedded model: SmolLM2-135M-Instruct from its GGUF, served by the engine, answers a question.

This checks the loader, the q/k un-permutation, the tokenizer and chat template, the Llama forward pass, and
the engine (scheduler, runner, sampler, streaming detokenization) together: a wrong permutation, token id or
cache slot turns the answer into noise.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from serving import Engine, SamplingParams

NEW_TOKENS = 20
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_smollm2_chat_via_the_engine_knows_the_capital_of_france():
    engine = Engine.from_default(dtype=jnp.float32, num_blocks=64, block_size=16, max_running=4, token_budget=128)
    request = engine.add_request(QUESTION, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    streamed, ids = "", []
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.text
            ids.append(out.token_id)
    result = engine.result(request).outputs[0]
    assert "Paris" in result.text, result.text
    assert streamed == result.text == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert result.finish_reason in ("stop", "length")
    assert np.unique(ids).size > 3, result.text  # not one token repeated
