"""Speculative decoding through the ``Engine``: each drafter against the best non-speculative setting of the same
build, in the same run, at concurrency 1, 16 and 64.

Prompt sets (greedy, ``--max-tokens`` each):
  * ``chat``: the held-out chats of ``examples.train_drafter.prompts`` (the ones ``examples.train_drafter`` never
    trains on, same seed), which no drafter has seen;
  * ``agentic``: code editing with the file in the prompt (``agentic_prompts``: a Python module built from a
    seeded generator, and an edit to make, answered with the whole file), built offline and deterministically.
At concurrency c the engine (``max_running=c``) answers ``max(--prompts, c)`` prompts of the set (cycled), for each
configuration: ``none_d1`` and ``none_d8`` (no drafting, ``decode_steps`` 1 and 8: the baseline is the faster of the
two), then the drafters of ``--drafters``: ``ngram`` (prompt lookup, k = 4) and ``suffix`` (suffix drafting over the
request's context and the finished outputs, k = 8), both adaptive (``AdaptivePolicy``: draft lengths, or none, from
measured acceptance and step times) on top of the baseline that won (its ``decode_steps`` between verifications; 8
where no baseline ran), so that a row's speedup is what drafting adds to it, ``suffix_static`` (k = 8 drafts every
step) and, with ``--drafter DIR``, ``block`` (``BlockDrafter``, adaptive lengths). One ``LoadedModel`` serves every
engine. Each configuration first runs twice untimed (compiles; the second time with the prompts' prefixes cached,
as in the timed runs; the adaptive policy keeps what it measured, as a server would), then until a pass compiles
nothing (a server compiles its verification shapes before serving). Timed passes come in rounds of one pass per
configuration, the order rotated per round, with every engine of the group kept: first ``--rounds`` rounds of the
baselines alone, whose medians pick the baseline the drafting rows build on, then ``--rounds`` rounds of every row.
A row's ``speedup`` is the median over those last rounds of its tokens/s over the best baseline's in that round
(the best: the baseline of the higher median there; ``speedups``: each round's, null where either pass compiled
something, a verification shape the warm passes never met, which a server compiles before serving), so that a slow
stretch of a shared machine weighs on every row of a round alike, not on whichever row ran then (nor is it the
round's faster baseline, whose max over two noisy passes is biased above either). ``tokens_per_s`` is a row's
median pass there (of those that compiled nothing), ``compiles_timed`` what its timed passes compiled. The suffix
drafter's global store is emptied before each pass: it never holds the outputs of the prompts it drafts for from an
earlier pass (within a pass a finished request's output does serve later ones, as on a server). Also reported (over
the timed passes): mean acceptance length (tokens per drafted sequence-step), acceptance rate, ``drafted_steps``
(sequence-steps with drafts), and ``identical_outputs``: prompts whose tokens equal ``none_d1``'s (true fp32 matmuls
by default: ``--matmul-precision``). JSON is rewritten after every group of rows (a run cut short keeps its
groups); ``--time-budget`` skips the configurations left once it is spent.

Run: ``python -m benchmarks.serving_speculative`` (SmolLM2-135M-Instruct; CPU: writes
``results/serving_speculative_cpu.json`` and .png; on a GPU pass ``--name serving_speculative``). ``--model`` takes
a HF folder or GGUF file with a tokenizer instead.
"""

import argparse
import dataclasses
import gc
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.harness import compile_events, format_table, save_plot, write_results
from examples.train_drafter.prompts import chat_prompts
from examples.train_drafter.train import TrainConfig
from serving import SamplingParams, enable_command_buffers
from serving.llm_engine import Engine, Prompt
from serving.loaders import LoadedModel, load_model
from serving.spec_decode import NgramDrafter, SpecConfig, SpecStats, SuffixDrafter

CONCURRENCIES = (1, 16, 64)
PROMPT_SETS = ("chat", "agentic")
BASELINES = {"none_d1": 1, "none_d8": 8}  # decode_steps of the non-speculative rows
DECODE_STEPS = 8  # between an adaptive drafting engine's verifications where no baseline ran (else the winner's)
BEST_BASELINE = None  # a config's decode_steps: those of the faster baseline of its group
NGRAM_K, SUFFIX_K = 4, 8
HELD_OUT = TrainConfig().num_eval_prompts  # train_drafter's held-out chats (same seed)
DRAFTERS = ("ngram", "suffix", "suffix_static")
ENGINE_OPTIONS = dict(num_blocks=2048, block_size=16, token_budget=1024)
UNTIMED_PASSES, MAX_PASSES = 2, 5  # Config.warm: passes before the compile-free one at least, and passes at most
ROUNDS = 3  # timed rounds: one pass of every row each

NAMES = ["total", "count", "items", "values", "limit", "offset", "result", "buffer", "scale", "width", "height",
         "index", "weights", "prices", "scores", "names"]
VERBS = ["compute", "update", "merge", "filter", "normalize", "parse", "render", "validate", "collect", "resize"]
OPS = ["+", "-", "*", "max", "min"]


def code_file(rng: random.Random, num_functions: int = 6) -> str:
    """A small Python module of ``num_functions`` functions, each a loop over a list with a docstring."""
    lines = ['"""Utilities generated for the speculative decoding benchmark."""', "", f"LIMIT = {rng.randint(5, 50)}",
             ""]
    for _ in range(num_functions):
        verb, a, b = rng.choice(VERBS), *rng.sample(NAMES, 2)
        op = rng.choice(OPS)
        step = f"{b} = {op}({b}, x)" if op in ("max", "min") else f"{b} = {b} {op} x"
        lines += ["", f"def {verb}_{a}({a}, {b}=0):", f'    """{verb.capitalize()} the {a} into {b}."""',
                  f"    for x in {a}[:LIMIT]:", f"        {step}", f"    return {b}", ""]
    return "\n".join(lines)


def agentic_prompts(count: int, seed: int = 0) -> list[Prompt]:
    """``count`` code-editing chats: a generated module and one edit, to be answered with the whole file."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        source = code_file(rng)
        old = rng.choice([line.split("(")[0][4:] for line in source.splitlines() if line.startswith("def ")])
        task = rng.choice([f"Rename the function `{old}` to `{old}_v2`.", "Change LIMIT to 100.",
                           "Add the type hint `list` to every first argument.",
                           f"Add a comment above `{old}` saying what it returns."])
        prompts.append([{"role": "user", "content": f"{task} Reply with the whole updated file only.\n\n```python\n"
                                                    f"{source}\n```"}])
    return prompts


def prompt_set(name: str, count: int) -> list[Prompt]:
    """``count`` prompts of set ``name`` (the held-out chats cycled when more are asked for)."""
    if name == "agentic":
        return agentic_prompts(count)
    chats = chat_prompts(HELD_OUT)[1]
    return [chats[i % len(chats)] for i in range(count)]


Configs = dict[str, tuple[Callable[[], SpecConfig | None], int]]


def configs(drafter: str | None, names: tuple[str, ...]) -> Configs:
    """(a maker of the speculative config: a fresh drafter per engine, decode_steps or BEST_BASELINE) by row name:
    the baselines, then ``names`` (and ``block``)."""
    rows: Configs = {name: (lambda: None, steps) for name, steps in BASELINES.items()}
    make = {"ngram": lambda: SpecConfig(NgramDrafter(), k=NGRAM_K, name="ngram", adaptive=True),
            "suffix": lambda: SpecConfig(SuffixDrafter(), k=SUFFIX_K, name="suffix", adaptive=True),
            "suffix_static": lambda: SpecConfig(SuffixDrafter(), k=SUFFIX_K, name="suffix")}
    for name in names:
        rows[name] = make[name], BEST_BASELINE if name != "suffix_static" else 1
    if drafter is not None:
        rows["block"] = lambda: SpecConfig.from_method("block", drafter, adaptive=True), 1
    return rows


class Config:
    """One row's engine over a prompt set: passes until it compiles nothing (``warm``), then timed passes (``time``)
    taken in rounds with every other row's engine, so that each round compares the rows under the same load."""

    def __init__(self, model: LoadedModel, spec: SpecConfig | None, decode_steps: int, concurrency: int,
                 prompts: list[Prompt], max_tokens: int):
        self.engine = Engine(model, max_running=concurrency, decode_steps=decode_steps, speculative=spec,
                             **ENGINE_OPTIONS)
        self.decode_steps = decode_steps
        self.prompts, self.params = prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.passes, self.compiles_timed = 0, 0
        self.stats = SpecStats()  # over the timed passes
        self.outputs: list[list[int]] = []

    def _pass(self) -> tuple[float, list[str]]:
        """One pass over the prompts (the suffix drafter's store emptied first): (seconds, compile events)."""
        for drafter in self.engine.drafters.values():
            if isinstance(drafter, SuffixDrafter):
                drafter.clear()
        self.engine.spec_stats = type(self.engine.spec_stats)()
        with compile_events() as events:
            start = time.perf_counter()
            results = self.engine.generate(self.prompts, self.params)
            seconds = time.perf_counter() - start
        self.passes += 1
        self.outputs = [r.outputs[0].token_ids for r in results]
        return seconds, events

    def warm(self) -> "Config":
        """Passes until one after the first ``UNTIMED_PASSES`` compiles nothing (at most ``MAX_PASSES``; a server
        compiles its shapes in ``Engine.warm_up``, which takes minutes per engine on a CPU)."""
        while True:
            _, events = self._pass()
            if (self.passes > UNTIMED_PASSES and not events) or self.passes >= MAX_PASSES:
                return self

    def time(self) -> float | None:
        """One timed pass: its tokens/s, or None where it compiled something (its time is partly a compile's,
        which a server pays before it serves); the speculation counters and the compiles kept."""
        seconds, events = self._pass()
        self.compiles_timed += len(events)
        for field in dataclasses.fields(SpecStats):
            name = field.name
            setattr(self.stats, name, getattr(self.stats, name) + getattr(self.engine.spec_stats, name))
        return None if events else sum(map(len, self.outputs)) / seconds

    def close(self) -> None:
        """Free the engine (its cache) before the next group's."""
        del self.engine
        gc.collect()


def timed_rounds(configs: dict[str, Config], rounds: int) -> dict[str, list[float | None]]:
    """``rounds`` rounds of one timed pass per config, the order rotated each round (so that none always runs
    right after the same one): each config's tokens/s, one a round (None: that pass compiled)."""
    names = list(configs)
    speeds: dict[str, list[float | None]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            speeds[name].append(configs[name].time())
    return speeds


def median(values: list[float | None]) -> float | None:
    """The median of the passes that compiled nothing (None if every one did)."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def rounded(value: float | None, digits: int) -> float | None:
    """``round(value, digits)``; None (a median of passes that all compiled) stays None."""
    return None if value is None else round(value, digits)


def best_baseline(group: dict[str, Config], rounds: int) -> int:
    """The decode_steps of the faster baseline of ``group`` by its median in rounds of the baselines alone
    (``DECODE_STEPS`` where none ran): what the drafting rows build on."""
    baselines = {name: config for name, config in group.items() if name in BASELINES}
    if not baselines:
        return DECODE_STEPS
    speeds = timed_rounds(baselines, rounds)
    return baselines[max(speeds, key=lambda name: median(speeds[name]) or 0.0)].decode_steps


def plot(rows: list[dict], name: str, out_dir: str | Path | None = None) -> None:
    """Per prompt set, per drafter, one bar per concurrency: speed-up over the best non-speculative setting
    (labelled with tokens/s and mean acceptance length; whiskers: the slowest and fastest round, where rows have
    ``speedups``)."""
    import matplotlib.pyplot as plt

    drafted = [r for r in rows if r["drafter"] not in BASELINES and r["speedup"] is not None]
    if not drafted:
        return
    sets = list(dict.fromkeys(r["prompts"] for r in drafted))
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.5), squeeze=False)
    for ax, prompts in zip(axes[0], sets, strict=True):
        mine = [r for r in drafted if r["prompts"] == prompts]
        names = list(dict.fromkeys(r["drafter"] for r in mine))
        levels = sorted({r["concurrency"] for r in mine})
        width = 0.8 / len(levels)
        for i, level in enumerate(levels):
            at = {r["drafter"]: r for r in mine if r["concurrency"] == level}
            x = [j + (i - (len(levels) - 1) / 2) * width for j, n in enumerate(names) if n in at]
            present = [at[n] for n in names if n in at]
            spread = [[v for v in r.get("speedups") or [r["speedup"]] if v is not None] for r in present]
            whiskers = [[r["speedup"] - min(v) for r, v in zip(present, spread, strict=True)],
                        [max(v) - r["speedup"] for r, v in zip(present, spread, strict=True)]]
            bars = ax.bar(x, [r["speedup"] for r in present], width, yerr=whiskers, capsize=3, color=f"C{i}",
                          label=f"concurrency {level}")
            ax.bar_label(bars, [f"x{r['speedup']:.2f}\n{r['tokens_per_s']:.0f}/s\nacc {r['mean_acceptance_length']:.2f}"
                                for r in present], fontsize=7, label_type="center")
        ax.axhline(1, color="k", ls="--", lw=1, label="best of decode_steps 1, 8")
        ax.set_xticks(range(len(names)), names)
        ax.set(ylabel="output tokens/s over the best non-speculative", title=f"{prompts} prompts")
        ax.margins(y=0.25)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Speculative decoding, greedy")
    fig.tight_layout()
    save_plot(fig, name, out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a HF folder or GGUF with a tokenizer (default: SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per run at least (max with concurrency)")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)))
    parser.add_argument("--sets", default=",".join(PROMPT_SETS))
    parser.add_argument("--drafters", default=",".join(DRAFTERS), help=f"among {DRAFTERS}")
    parser.add_argument("--drafter", default=None, help="a block drafter checkpoint folder (adds the block row)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed passes per row, one per round")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; rows left after it are skipped")
    parser.add_argument("--name", default="serving_speculative_cpu")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--matmul-precision", default="highest", choices=("default", "high", "highest"),
                        help="float32 matmuls: 'highest' is true fp32; the GPU default (TF32) rounds each batch shape "
                             "differently, so greedy outputs can part at near-ties")
    args = parser.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    names = tuple(n for n in args.drafters.split(",") if n)
    sets = tuple(s for s in args.sets.split(",") if s)
    if unknown := sorted(set(names) - set(DRAFTERS)) + sorted(set(sets) - set(PROMPT_SETS)):
        parser.error(f"unknown drafters or prompt sets {unknown}: expected among {DRAFTERS} and {PROMPT_SETS}")
    levels = [int(c) for c in args.concurrency.split(",")]
    start = time.perf_counter()
    model = load_model(args.model, jnp.float32)
    if model.tokenizer is None:
        parser.error(f"--model {args.model!r} has no tokenizer: the prompts are chats")
    rows, skipped = [], []
    meta = {"device": jax.devices()[0].device_kind, "model": args.model or "SmolLM2-135M-Instruct",
            "matmul_precision": args.matmul_precision, "max_tokens": args.max_tokens, "ngram_k": NGRAM_K,
            "suffix_k": SUFFIX_K, "drafter": args.drafter, "rows": rows,
            "skipped": skipped}
    for concurrency in levels:  # concurrency 1 of every set first: the rows a --time-budget must keep
        for prompts_name in sets:
            prompts = prompt_set(prompts_name, max(args.prompts, concurrency))
            group: dict[str, Config] = {}
            chosen = None  # the decode_steps of the best baseline, once the first drafting row needs it
            for name, (make, decode_steps) in configs(args.drafter, names).items():  # the baselines first
                if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
                    skipped.append({"prompts": prompts_name, "concurrency": concurrency, "drafter": name})
                    continue
                if decode_steps is BEST_BASELINE:
                    chosen = chosen or best_baseline(group, args.rounds)
                    decode_steps = chosen
                group[name] = Config(model, make(), decode_steps, concurrency, prompts, args.max_tokens).warm()
            speeds = timed_rounds(group, args.rounds)
            best = max((n for n in group if n in BASELINES), key=lambda n: median(speeds[n]) or 0.0, default=None)
            reference = next(iter(group.values())).outputs if group else []
            for name, config in group.items():
                ratios = [None if a is None or b is None else a / b  # a round where either compiled: none
                          for a, b in zip(speeds[name], speeds[best] if best else [None] * args.rounds, strict=True)]
                tokens_per_s, speedup = median(speeds[name]), median(ratios)
                rows.append({"prompts": prompts_name, "drafter": name, "concurrency": concurrency,
                             "decode_steps": config.decode_steps, "num_prompts": len(prompts),
                             "tokens": sum(map(len, config.outputs)),
                             "tokens_per_s": rounded(tokens_per_s, 2), "speedup": rounded(speedup, 3),
                             "speedups": [rounded(r, 3) for r in ratios], "rounds": args.rounds,
                             "mean_acceptance_length": round(config.stats.mean_acceptance_length, 3)
                             if config.stats.num_steps else 1.0,
                             "acceptance_rate": round(config.stats.acceptance_rate, 3)
                             if config.engine.drafters else None,
                             "drafted_steps": config.stats.num_steps, "passes": config.passes,
                             "compiles_timed": config.compiles_timed,
                             "identical_outputs": sum(o == b for o, b in zip(config.outputs, reference, strict=True))})
                config.close()
            print(format_table(rows[-len(group):], list(rows[-1])) if group else "", flush=True)
            write_results(args.name, meta | {"rows": rows}, args.out_dir)
    columns = ["prompts", "drafter", "concurrency", "tokens_per_s", "speedup", "speedups", "mean_acceptance_length",
               "acceptance_rate", "identical_outputs", "num_prompts", "compiles_timed"]
    print(format_table(rows, columns))
    if skipped:
        print(f"skipped (--time-budget {args.time_budget} s): {skipped}")
    write_results(args.name, meta, args.out_dir)
    plot(rows, args.name, args.out_dir)


if __name__ == "__main__":
    enable_command_buffers()
    main()
