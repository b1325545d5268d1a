"""End to end on the embedded model: SmolLM2-135M-Instruct from its GGUF answers a question coherently.

This checks the loader, the q/k un-permutation, the tokenizer and chat template, and the Llama forward pass
together: a wrong permutation or a wrong token id turns the answer into noise.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving import weights
from serving.config import ModelConfig
from serving.kv_cache import PagedKV, SeqChunk, make_batch
from serving.loaders.gguf import load_gguf
from serving.models import llama

BLOCK_SIZE = 16
NEW_TOKENS = 20


def greedy_generate(params: dict, cfg: ModelConfig, prompt: list[int], max_new_tokens: int,
                    eos_ids: tuple[int, ...]) -> list[int]:
    """Prefill the prompt in one step, then decode one token per step, always taking the argmax."""
    blocks = list(range(math.ceil((len(prompt) + max_new_tokens) / BLOCK_SIZE)))
    kv = PagedKV.create(cfg, len(blocks), BLOCK_SIZE, jnp.float32)
    forward = jax.jit(llama.forward, static_argnums=1)
    batch = make_batch([SeqChunk(blocks, 0, len(prompt))], BLOCK_SIZE)
    logits, kv, _ = forward(params, cfg, jnp.asarray(prompt, jnp.int32), batch, kv)
    out = [int(jnp.argmax(logits[-1]))]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        batch = make_batch([SeqChunk(blocks, len(prompt) + len(out) - 1, 1)], BLOCK_SIZE)
        logits, kv, _ = forward(params, cfg, jnp.asarray(out[-1:], jnp.int32), batch, kv)
        out.append(int(jnp.argmax(logits[-1])))
    return out


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france():
    checkpoint = load_gguf(weights.default_model_gguf())
    cfg = ModelConfig.from_hf(checkpoint.config)
    params = llama.params_from_hf(cfg, checkpoint.tensors, jnp.float32)
    tok = checkpoint.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                        add_special_tokens=False)
    ids = greedy_generate(params, cfg, prompt, NEW_TOKENS, tok.eos_token_ids)
    answer = tok.decode(ids, skip_special_tokens=True)
    assert "Paris" in answer, answer
    stream = tok.decode_stream()
    assert "".join(stream.add(i) for i in ids) + stream.finish() == answer
    assert np.unique(ids).size > 3, answer  # not one token repeated
