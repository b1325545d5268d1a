"""Weight quantization quality on the embedded SmolLM2-135M-Instruct: bf16 vs int8 vs fp8 (e4m3) weights.

The bf16 model (the GGUF's weights in bf16, bf16 activations and KV cache) is the reference; int8 and fp8 are
``serving.quantization.quantize_params`` of it (attention and MLP projections, per output channel). On
``len(PROMPTS)`` fixed chat prompts:

  * teacher-forced: each prompt followed by the bf16 model's greedy continuation, one prefill per model; at
    every continuation position (``NEW_TOKENS`` per prompt) the relative logit error
    ``||l_q - l_bf16||_2 / ||l_bf16||_2`` (max and mean over positions) and top-1 agreement with bf16.
  * greedy: ``NEW_TOKENS`` tokens per prompt (EOS not special), all prompts batched through the paged cache;
    the fraction of tokens equal to bf16's at the same position, of prompts with the identical continuation,
    and the mean number of tokens before the first difference.
  * weight bytes of the whole model and of the quantized projections (q + scales vs their bf16 size).

    python benchmarks/serving_quantization.py   # results/serving_quantization_cpu.json (or _gpu on a GPU)
"""

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import format_table, write_results  # noqa: E402
from serving import enable_command_buffers, weights  # noqa: E402
from serving.config import ModelConfig  # noqa: E402
from serving.kv_cache import PagedKV, SeqChunk, make_batch  # noqa: E402
from serving.loaders.gguf import load_gguf  # noqa: E402
from serving.models import llama  # noqa: E402
from serving.quantization import KINDS, QuantizedWeight, quantize_params, weight_bytes  # noqa: E402

NEW_TOKENS = 32
BLOCK_SIZE = 16
DTYPE = jnp.bfloat16
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
    "Give me three tips for staying focused while studying.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Fahrenheit?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "What does a CPU do?",
    "Suggest a name for a small coffee shop.",
    "How do I make a cup of tea?",
    "What is the difference between weather and climate?",
    "Write one sentence about autumn leaves.",
    "What is the largest mammal on Earth?",
    "Summarize the story of Cinderella in two sentences.",
    "What is a prime number?",
    "Tell me a fun fact about octopuses.",
)


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


forward = jax.jit(llama.forward, static_argnums=1)


def batch_forward(params: dict, cfg: ModelConfig, seqs: list[list[int]], kv: PagedKV, tables: list[list[int]],
                  starts: list[int]) -> tuple[list[np.ndarray], PagedKV]:
    """Run ``seqs[s]`` (new tokens from position ``starts[s]``) as one ragged batch: fp32 logits per sequence."""
    chunks = [SeqChunk(t, start, len(s)) for t, start, s in zip(tables, starts, seqs, strict=True)]
    tokens = jnp.asarray(np.concatenate(seqs), jnp.int32)
    logits, kv, _ = forward(params, cfg, tokens, make_batch(chunks, BLOCK_SIZE), kv)
    ends = np.cumsum([0] + [len(s) for s in seqs])
    return [np.asarray(logits[a:b]) for a, b in zip(ends[:-1], ends[1:], strict=True)], kv


def block_tables(lengths: list[int]) -> tuple[list[list[int]], int]:
    """Disjoint block tables holding ``lengths[s] + NEW_TOKENS`` tokens each, and the number of blocks."""
    tables, used = [], 0
    for n in lengths:
        count = math.ceil((n + NEW_TOKENS) / BLOCK_SIZE)
        tables.append(list(range(used, used + count)))
        used += count
    return tables, used


def greedy(params: dict, cfg: ModelConfig, prompts: list[list[int]]) -> np.ndarray:
    """``[prompts, NEW_TOKENS]`` greedy tokens: one batched prefill, then one batched decode step per token."""
    tables, num_blocks = block_tables([len(p) for p in prompts])
    kv = PagedKV.create(cfg, num_blocks, BLOCK_SIZE, DTYPE)
    logits, kv = batch_forward(params, cfg, prompts, kv, tables, [0] * len(prompts))
    out = [[int(np.argmax(l[-1]))] for l in logits]
    for step in range(1, NEW_TOKENS):
        logits, kv = batch_forward(params, cfg, [o[-1:] for o in out], kv, tables,
                                   [len(p) + step - 1 for p in prompts])
        for o, l in zip(out, logits, strict=True):
            o.append(int(np.argmax(l[-1])))
    return np.asarray(out)


def teacher_forced(params: dict, cfg: ModelConfig, prompts: list[list[int]], continuation: np.ndarray) -> np.ndarray:
    """Logits ``[prompts, NEW_TOKENS, V]`` predicting each continuation token, prompt + continuation in one prefill."""
    seqs = [p + list(c) for p, c in zip(prompts, continuation, strict=True)]
    tables, num_blocks = block_tables([len(p) for p in prompts])
    logits, _ = batch_forward(params, cfg, seqs, PagedKV.create(cfg, num_blocks, BLOCK_SIZE, DTYPE), tables,
                              [0] * len(seqs))
    return np.stack([l[len(p) - 1:len(p) - 1 + NEW_TOKENS] for l, p in zip(logits, prompts, strict=True)])


def projections(params: dict) -> list[QuantizedWeight]:
    return [w for w in jax.tree.leaves(params, is_leaf=is_quantized) if is_quantized(w)]


def main() -> None:
    checkpoint = load_gguf(weights.default_model_gguf())
    cfg = ModelConfig.from_hf(checkpoint.config)
    tok = checkpoint.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    reference = llama.params_from_hf(cfg, checkpoint.tensors, DTYPE)
    ref_tokens = greedy(reference, cfg, prompts)
    ref_logits = teacher_forced(reference, cfg, prompts, ref_tokens)
    quantized = {kind: quantize_params(reference, kind, cfg) for kind in KINDS}
    bf16_projection_bytes = sum(w.q.size for w in projections(quantized["int8"])) * jnp.dtype(DTYPE).itemsize
    rows = [{"weights": "bf16", "weight_MB": weight_bytes(reference) / 1e6,
             "projection_MB": bf16_projection_bytes / 1e6}]
    for kind, params in quantized.items():
        tokens = greedy(params, cfg, prompts)
        logits = teacher_forced(params, cfg, prompts, ref_tokens)
        rel = np.linalg.norm(logits - ref_logits, axis=-1) / np.linalg.norm(ref_logits, axis=-1)  # [prompts, T]
        same = tokens == ref_tokens
        first_diff = np.where(same.all(axis=1), NEW_TOKENS, np.argmin(same, axis=1))
        rows.append({"weights": kind, "weight_MB": weight_bytes(params) / 1e6,
                     "projection_MB": weight_bytes(projections(params)) / 1e6,
                     "max_rel_logit_err": float(rel.max()), "mean_rel_logit_err": float(rel.mean()),
                     "top1_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).mean()),
                     "greedy_token_agreement": float(same.mean()),
                     "greedy_identical_continuations": float(same.all(axis=1).mean()),
                     "greedy_tokens_before_first_diff": float(first_diff.mean())})
        print(f"{kind}: done", flush=True)
    columns = ["weights", "weight_MB", "projection_MB", "max_rel_logit_err", "mean_rel_logit_err", "top1_agreement",
               "greedy_token_agreement", "greedy_identical_continuations", "greedy_tokens_before_first_diff"]
    print(format_table(rows, columns))
    platform = jax.devices()[0].platform
    path = write_results(f"serving_quantization_{platform}", {
        "model": weights.DEFAULT_MODEL_NAME, "reference": "bf16 weights, activations and KV cache",
        "prompts": list(PROMPTS), "new_tokens": NEW_TOKENS, "rows": rows,
        "reference_continuations": [tok.decode(t, skip_special_tokens=True) for t in ref_tokens[:3]],
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    enable_command_buffers()
    main()
