"""Speculative decoding on SmolLM2-135M-Instruct: tokens/s with and without drafting, and acceptance length.

Chat prompts: the 8 below (half of them ask to repeat or extend repetitive text, where prompt lookup shines)
and ``--held-out`` of ``examples.train_drafter.prompts``' held-out chats (the ones ``examples.train_drafter`` never
trains on, same seed). At each concurrency c the engine (``max_running=c``) answers all of them greedily, for
each drafter: none (the baseline), ``NgramDrafter`` (prompt lookup), ``DraftModelDrafter.from_target``
(self-speculative: the target's first layers) and, given ``--drafter DIR`` (a checkpoint of
``python -m examples.train_drafter``), ``BlockDrafter`` (a whole block of tokens in one pass from the target's
hidden states; k = its trained block unless ``--block-k``). Each configuration runs twice untimed (compiles;
the second time with the prompts' prefixes cached, as in the timed run) and once timed. Reported: output
tokens/s, speed-up over the baseline, mean acceptance length (tokens emitted per drafted sequence-step),
acceptance rate, and ``identical_outputs``: the prompts whose speculative output equals the baseline's tokens
(true fp32 matmuls by default: ``--matmul-precision``).

Run: ``python -m benchmarks.serving_speculative`` (CPU: writes ``results/serving_speculative_cpu.json`` and .png; on a
GPU pass ``--name serving_speculative`` and larger ``--max-tokens`` and ``--held-out``). ``--drafters
none,block --drafter DIR`` runs only those rows.
"""

import argparse
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.harness import format_table, save_plot, write_results
from examples.train_drafter.prompts import chat_prompts
from examples.train_drafter.train import TrainConfig
from serving import SamplingParams, enable_command_buffers
from serving.llm_engine import Engine, Prompt
from serving.spec_decode import DraftModelDrafter, NgramDrafter, SpecConfig

PROMPTS = [
    "Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig, grape.",
    "What is the capital of France? Answer in one sentence.",
    "Write the numbers from 1 to 40, separated by commas.",
    "Explain in two sentences why the sky is blue.",
    "Copy this sentence twice: The quick brown fox jumps over the lazy dog.",
    "Name three programming languages and one feature of each.",
    "Write a Python function that returns the sum of a list, then write it again with a docstring.",
    "Give a short definition of photosynthesis.",
]
CONCURRENCIES = (1, 16)
K = 4  # draft tokens per step
DRAFT_LAYERS = 8  # of SmolLM2-135M's 30: the self-speculative draft model's depth
NGRAM = 3
HELD_OUT = TrainConfig().num_eval_prompts  # train_drafter's held-out chats (same seed)


def drafters(k: int, draft_layers: int, drafter: str | None = None,
             block_k: int | None = None) -> dict[str, SpecConfig | None]:
    """The configurations by row name: none, ngram, self_spec_<L>l, and block with a ``drafter`` checkpoint."""
    configs = {"none": None,
               "ngram": SpecConfig(NgramDrafter(n=NGRAM), k=k),
               f"self_spec_{draft_layers}l": SpecConfig(functools.partial(DraftModelDrafter.from_target,
                                                                          num_layers=draft_layers), k=k)}
    if drafter is not None:
        configs["block"] = SpecConfig.from_method("block", drafter, block_k)
    return configs


def benchmark_prompts(held_out: int) -> list[Prompt]:
    """The fixed PROMPTS, then the last ``held_out`` held-out chats of ``examples.train_drafter.prompts``."""
    chats = chat_prompts(HELD_OUT)[1][-held_out:] if held_out else []
    return [[{"role": "user", "content": p}] for p in PROMPTS] + chats


def run(spec: SpecConfig | None, concurrency: int, prompts: list[Prompt], max_tokens: int) -> dict:
    engine = Engine.from_default(dtype=jnp.float32, num_blocks=512, block_size=16, max_running=concurrency,
                                 token_budget=1024, speculative=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for _ in range(2):  # compiles the shapes this load visits: the second run's prefills hit the prefix cache, as
        engine.generate(prompts, params)  # the timed run's do, and are shorter (other shapes)
    if engine.speculative:
        engine.spec_stats = type(engine.spec_stats)()
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    outputs = [r.outputs[0].token_ids for r in results]
    stats = engine.spec_stats
    return {"tokens": sum(map(len, outputs)), "seconds": seconds, "tokens_per_s": sum(map(len, outputs)) / seconds,
            "mean_acceptance_length": stats.mean_acceptance_length if spec else 1.0,
            "acceptance_rate": stats.acceptance_rate if spec else None, "outputs": outputs}


def plot(rows: list[dict], name: str, out_dir: str | Path | None = None, *, k: int) -> None:
    """Per drafter, one bar per concurrency: speed-up over no drafting (labelled with tokens/s) and mean
    acceptance length (at most ``k + 1``: every draft token accepted, plus the target's own)."""
    import matplotlib.pyplot as plt

    drafted = [r for r in rows if r["drafter"] != "none"]
    if not drafted:
        return
    names = list(dict.fromkeys(r["drafter"] for r in drafted))
    levels = sorted({r["concurrency"] for r in drafted})
    width = 0.8 / len(levels)
    fig, (speed, accept) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, level in enumerate(levels):
        mine = {r["drafter"]: r for r in drafted if r["concurrency"] == level}
        x = [j + (i - (len(levels) - 1) / 2) * width for j, n in enumerate(names) if n in mine]
        present = [mine[n] for n in names if n in mine]
        bars = speed.bar(x, [r["speedup"] for r in present], width, color=f"C{i}", label=f"concurrency {level}")
        speed.bar_label(bars, [f"x{r['speedup']:.2f}\n{r['tokens_per_s']:.0f} tok/s" for r in present], fontsize=8)
        bars = accept.bar(x, [r["mean_acceptance_length"] for r in present], width, color=f"C{i}",
                          label=f"concurrency {level}")
        accept.bar_label(bars, [f"{r['mean_acceptance_length']:.2f}" for r in present], fontsize=8)
    speed.axhline(1, color="k", ls="--", lw=1, label="no drafting")
    speed.set(ylabel="output tokens/s over no drafting", title="speed-up (higher is better)")
    accept.axhline(k + 1, color="k", ls=":", lw=1, label=f"every draft accepted (k={k})")
    accept.set(ylabel="tokens per drafted sequence-step", title="mean acceptance length")
    for ax in (speed, accept):
        ax.set_xticks(range(len(names)), names)
        ax.margins(y=0.2)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Speculative decoding, greedy")
    fig.tight_layout()
    save_plot(fig, name, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--held-out", type=int, default=0, help="held-out drafter chats added to the 8 prompts")
    parser.add_argument("--k", type=int, default=K)
    parser.add_argument("--draft-layers", type=int, default=DRAFT_LAYERS)
    parser.add_argument("--drafter", default=None, help="a block drafter checkpoint folder (adds the block row)")
    parser.add_argument("--block-k", type=int, default=None, help="block drafter's k (default: its trained block)")
    parser.add_argument("--drafters", default=None, help="comma-separated rows to run (default: all; none always)")
    parser.add_argument("--name", default="serving_speculative_cpu")
    parser.add_argument("--matmul-precision", default="highest", choices=("default", "high", "highest"),
                        help="float32 matmuls: 'highest' is true fp32; the GPU default (TF32) rounds each batch shape "
                             "differently, so greedy outputs can part at near-ties")
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    configs = drafters(args.k, args.draft_layers, args.drafter, args.block_k)
    if args.drafters:
        wanted = {"none", *args.drafters.split(",")}
        unknown = sorted(wanted - set(configs))
        if unknown:
            parser.error(f"--drafters: unknown {unknown}; expected names among {sorted(configs)}")
        configs = {name: spec for name, spec in configs.items() if name in wanted}
    if not 0 <= args.held_out <= HELD_OUT:
        parser.error(f"--held-out {args.held_out}: expected 0 .. {HELD_OUT} (train_drafter's held-out chats)")
    prompts = benchmark_prompts(args.held_out)
    rows = []
    for concurrency in CONCURRENCIES:
        baseline = None
        for name, spec in configs.items():
            result = run(spec, concurrency, prompts, args.max_tokens)
            baseline = baseline or result
            rows.append({"drafter": name, "concurrency": concurrency, "tokens": result["tokens"],
                         "seconds": round(result["seconds"], 3), "tokens_per_s": round(result["tokens_per_s"], 2),
                         "speedup": round(result["tokens_per_s"] / baseline["tokens_per_s"], 3),
                         "mean_acceptance_length": round(result["mean_acceptance_length"], 3),
                         "acceptance_rate": None if result["acceptance_rate"] is None else
                         round(result["acceptance_rate"], 3),
                         "identical_outputs": sum(o == b for o, b in zip(result["outputs"], baseline["outputs"],
                                                                          strict=True))})
            print(format_table(rows[-1:], list(rows[-1])), flush=True)
    columns = ["drafter", "concurrency", "tokens", "tokens_per_s", "speedup", "mean_acceptance_length",
               "acceptance_rate", "identical_outputs"]
    print(format_table(rows, columns))
    write_results(args.name, {"device": jax.devices()[0].device_kind, "k": args.k, "draft_layers": args.draft_layers,
                              "drafter": args.drafter, "matmul_precision": args.matmul_precision,
                              "block_k": configs["block"].k if "block" in configs else None,
                              "max_tokens": args.max_tokens, "prompts": [p[0]["content"] for p in prompts],
                              "rows": rows})
    plot(rows, args.name, k=args.k)


if __name__ == "__main__":
    enable_command_buffers()
    main()
