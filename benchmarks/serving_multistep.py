"""Multi-step decode through the ``Engine``: decode tokens/s for ``decode_steps`` n in (1, 2, 4, 8) at batch 1 and 8.

Models: ``smollm2`` (SmolLM2-135M-Instruct, its real weights, fp32: a step reads 0.54 GB of weights) and ``tiny``
(``serving_decode.TINY_MOE``, a 2-layer MoE with random weights: a step is mostly host and dispatch overhead, the
part multi-step decode removes). At each batch B, B chat prompts (random ids for ``tiny``, which has no tokenizer)
are answered greedily (``ignore_eos``, ``max_tokens = 1 + --decode-tokens``, a multiple of every n, so no call is
cut short) by one engine per model whose ``decode_steps`` is set per run. The runs go round-robin, every n once per
round, so a background load falls on all of them alike (side by side, one process); the first round is untimed (it
compiles). Timed: the decode steps only, from the first step after every sequence has its first token (the
prefill's) to the end. Reported per (model, B, n): decode tokens/s = B * decode tokens / seconds, the median and the
best over ``--repeats`` rounds, their speed-ups over n = 1, device dispatches per run (one per engine step), and
``identical``: the tokens equal n = 1's.

Run: ``python -m benchmarks.serving_multistep`` (writes ``results/serving_multistep_cpu.json`` and .png);
``--models tiny`` takes seconds (the tests run it).
"""

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import format_table, save_plot, write_results
from benchmarks.serving_decode import TINY_MOE
from serving import DecodeSteps, Engine, LoadedModel, SamplingParams, enable_command_buffers
from serving.config import ModelConfig
from serving.models import model_module

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Explain in two sentences why the sky is blue.",
    "Write the numbers from 1 to 40, separated by commas.",
    "Name three programming languages and one feature of each.",
    "Give a short definition of photosynthesis.",
    "Write a haiku about the sea.",
    "List the planets of the solar system in order.",
    "Describe a cat to someone who has never seen one.",
]
MODELS = ("smollm2", "tiny")
BATCHES = (1, 8)
DECODE_STEPS = (1, 2, 4, 8)
DECODE_TOKENS = 64  # per sequence after its first; a multiple of every n in DECODE_STEPS
REPEATS = 5  # timed rounds (median and best)
TINY_PROMPT_LEN = 12  # --model tiny has no tokenizer: prompts of random ids


def load_engine(model: str, max_running: int) -> Engine:
    """SmolLM2-135M-Instruct (fp32), or ``tiny``: ``TINY_MOE`` with random weights."""
    options = dict(dtype=jnp.float32, num_blocks=512, block_size=16, max_running=max_running, token_budget=1024)
    if model == "smollm2":
        return Engine.from_default(**options)
    cfg = ModelConfig.from_hf(TINY_MOE)
    params = model_module(cfg.family).init_params(cfg, jax.random.key(0), jnp.float32)
    return Engine(LoadedModel(cfg, params, None, ()), **options)


def prompts_for(engine: Engine, batch: int) -> list[list[int]]:
    if engine.tokenizer is None:
        rng = np.random.default_rng(0)
        return [rng.integers(3, engine.cfg.vocab, TINY_PROMPT_LEN).tolist() for _ in range(batch)]
    return [engine.encode([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]) for i in range(batch)]


def run(engine: Engine, prompts: list[list[int]], decode_tokens: int, steps: int) -> dict:
    """One greedy run of ``prompts`` with ``decode_steps = steps``: decode seconds, dispatches and the tokens."""
    engine.decode_steps = DecodeSteps(steps)
    params = SamplingParams(temperature=0.0, max_tokens=1 + decode_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while any(not engine.result(i).outputs[0].token_ids for i in ids):  # the prefill: each sequence's first token
        engine.step()
    start, dispatches = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        dispatches += 1
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "dispatches": dispatches,
            "tokens": [engine.release(i).outputs[0].token_ids for i in ids]}


def measure(engine: Engine, batch: int, steps_list: tuple[int, ...], decode_tokens: int, repeats: int,
            model: str) -> list[dict]:
    """The rows of one batch: every n in ``steps_list`` run once per round, an untimed round first."""
    prompts = prompts_for(engine, batch)
    runs = {n: [] for n in steps_list}
    for round_ in range(repeats + 1):
        for n in steps_list:
            result = run(engine, prompts, decode_tokens, n)
            if round_ > 0:
                runs[n].append(result)
    rows = []
    for n in steps_list:
        seconds = [r["seconds"] for r in runs[n]]
        median, best = statistics.median(seconds), min(seconds)
        rows.append(dict(model=model, batch=batch, decode_steps=n, decode_tokens=decode_tokens,
                         decode_seconds=median, decode_tokens_per_s=batch * decode_tokens / median,
                         best_tokens_per_s=batch * decode_tokens / best, ms_per_token_step=median / decode_tokens * 1e3,
                         dispatches=runs[n][0]["dispatches"],
                         identical=all(r["tokens"] == runs[steps_list[0]][0]["tokens"] for r in runs[n])))
    for row in rows:
        row["speedup"] = row["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
        row["best_speedup"] = row["best_tokens_per_s"] / rows[0]["best_tokens_per_s"]
    return rows


def plot(rows: list[dict], name: str, out_dir: str | Path | None = None) -> None:
    """Per model, the speed-up of the median decode tokens/s over n = 1 against n, one line per batch, each point
    labelled with its tokens/s."""
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for i, batch in enumerate(sorted({r["batch"] for r in rows if r["model"] == model})):
            mine = [r for r in rows if r["model"] == model and r["batch"] == batch]
            ax.plot([r["decode_steps"] for r in mine], [r["speedup"] for r in mine], "o-", color=f"C{i}",
                    label=f"batch {batch}")
            for r in mine:
                ax.annotate(f"{r['decode_tokens_per_s']:.0f}", (r["decode_steps"], r["speedup"]),
                            textcoords="offset points", xytext=(0, 6 if i % 2 == 0 else -12), ha="center",
                            fontsize=8, color=f"C{i}")  # batches alternate above and below: no overlap at n = 1
        steps = sorted({r["decode_steps"] for r in rows if r["model"] == model})
        ax.axhline(1, color="k", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(steps, [str(n) for n in steps])
        ax.set(xlabel="decode steps per device call", ylabel="decode tokens/s over decode_steps=1", title=model)
        ax.margins(y=0.15)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Multi-step decode on {jax.devices()[0].platform}, greedy (labels: tokens/s, median)")
    fig.tight_layout()
    save_plot(fig, name, out_dir)


def model_names(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    if not set(names) <= set(MODELS) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct names of {MODELS}")
    return names


def positive_ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers >= 1")
    return values


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=model_names, default=MODELS, help=f"comma-separated subset of {MODELS}")
    parser.add_argument("--batches", type=positive_ints, default=BATCHES)
    parser.add_argument("--steps", type=positive_ints, default=DECODE_STEPS, help="decode_steps values (first: base)")
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--name", default="serving_multistep_cpu")
    parser.add_argument("--out-dir", help="where the JSON and PNG go (default benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.steps[0] != 1:
        parser.error(f"--steps {args.steps}: expected 1 first (the baseline every speed-up is over)")
    if args.decode_tokens < 1 or args.repeats < 1:
        parser.error(f"--decode-tokens {args.decode_tokens}, --repeats {args.repeats}: expected >= 1 each")
    rows = []
    for model in args.models:
        engine = load_engine(model, max(args.batches))
        for batch in args.batches:
            rows += measure(engine, batch, args.steps, args.decode_tokens, args.repeats, model)
            print(format_table(rows, ["model", "batch", "decode_steps", "decode_tokens_per_s", "speedup",
                                      "best_tokens_per_s", "best_speedup", "ms_per_token_step", "dispatches",
                                      "identical"]), flush=True)
    write_results(args.name, {"meta": {"repeats": args.repeats}, "rows": rows}, args.out_dir)
    plot(rows, args.name, args.out_dir)
    return rows


if __name__ == "__main__":
    enable_command_buffers()
    main()
