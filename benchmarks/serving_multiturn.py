"""Multi-turn chat through the ``Engine`` with the prefix cache on the GPU alone vs with its host tier
(``serving.engine.kv_tiers``), side by side in one run, at a load where the GPU's blocks cannot hold every
conversation.

Workload: ``--users`` conversations of ``--turns`` turns each share one system prompt of ``--system-len`` random
token ids; turn t sends the whole conversation so far (system prompt, every earlier user message and answer) plus a
new user message of ``--user-len`` ids, and the answer is ``--answer-len`` greedy tokens (``ignore_eos``). The users
run as a closed loop: every user's next turn is queued ``--think-ms`` after its answer ends (0: at once, so up to
``--users`` requests are in flight; the users start spread over one think time). The working set (every
conversation's blocks) is larger than the GPU's ``--num-blocks``: with the GPU tier alone, earlier turns are evicted
and recomputed; with the host tier they are loaded back.

One engine serves every mode, so they run the same compiled steps: GPU only (no tiers), then with a host tier of
``--host-cache-gb`` (a fresh ``KVTiers``; one mode per ``--host-batches`` size, the most blocks a host batch holds:
a load moves its block's whole batch, and per ``--tier-copies`` way of copying, ``KVTiers``' ``copies``); each run
starts with an empty GPU prefix cache
(``Engine.reset_prefix_cache``). Before timing, the engine compiles every step shape and the tiers' copies
(``Engine.warm_up``, on an accelerator; ``--no-warm-up`` skips it) and each mode runs an untimed round of the same
workload with other prompts (the same lengths, so the same shapes). Per mode: TTFT (a request's queueing, the moment
its user is done thinking, to its first token, over every request: median, p99 and all of them sorted; the wait
part of it, to the request's first scheduled chunk: median, p99; the slowest requests' breakdowns), prefill
tokens computed (prompt tokens the model ran, preemptions' recomputation included: counted from the scheduled
chunks), prompt tokens served by the cache, output tokens/s over the run, preemptions, executables compiled while
timed (none should be), the tier counters, and the
fraction of answers equal to the GPU-only run's. Ratios: TTFT median and p99 (GPU only / tiered), prefill tokens
(GPU only / tiered) and throughput (tiered / GPU only).

Models: ``tiny`` (``serving_decode.TINY_MOE``, random weights, fp32), ``moe-1b`` (``serving_decode.MOE_1B``) and
``qwen3-30b-a3b`` (``serving_decode.QWEN3_30B_A3B``), random weights, bfloat16 on a GPU; ``--layers N`` keeps a
model's first N layers. A model's prefill cost per token bounds the TTFT the tier can save, so beside the 1B MoE
there is Qwen3-30B-A3B's shape, with several times its compute per token. ``--cpu``: tiny, 4 users x 3 turns
(seconds; the tests run it).

The JSON is rewritten after every mode, so a run cut short (a device call's time limit) keeps the modes it finished.

    python -m benchmarks.serving_multiturn                # GPU: moe-1b, results/serving_multiturn.json + .png
    python -m benchmarks.serving_multiturn --cpu          # CPU: results/serving_multiturn_cpu.json + .png
"""

import argparse
import dataclasses
import heapq
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import COMPILE_EVENTS, compile_events, format_table, save_plot, write_results
from benchmarks.serving_decode import MOE_1B, QWEN3_30B_A3B, TINY_MOE, num_layers, with_layers
from serving import Engine, LoadedModel, SamplingParams, enable_command_buffers
from serving.config import ModelConfig
from serving.engine.kv_tiers import COPIES, MAX_BATCH, KVTiers
from serving.models import model_module

MODELS = {"tiny": TINY_MOE, "moe-1b": MOE_1B, "qwen3-30b-a3b": QWEN3_30B_A3B}
# The GPU workload: 32 users x 8 turns reach 4096 tokens each, a working set of 6208 blocks over 3072 GPU blocks;
# Engine.warm_up of moe-1b took ~3 minutes cold on an H200 at serving_load's larger token budget (2048).
GPU_WORKLOAD = dict(model="moe-1b", users=32, turns=8, system_len=1024, user_len=256, answer_len=128, think_ms=0.0,
                    num_blocks=3072, block_size=16, max_running=8, token_budget=1024, host_cache_gb=8.0)
CPU_WORKLOAD = dict(model="tiny", users=4, turns=3, system_len=24, user_len=8, answer_len=4, think_ms=0.0,
                    num_blocks=24, block_size=4, max_running=2, token_budget=64, host_cache_gb=0.01)
# Saturated closed loops (think 0, more users than running slots) make TTFT the wait for a slot, which a faster
# prefill shortens little; with think time the running slots are not all taken and TTFT is the prefill itself.


@dataclasses.dataclass(frozen=True)
class Workload:
    users: int
    turns: int
    system_len: int
    user_len: int
    answer_len: int
    think_ms: float = 0.0

    def working_set_blocks(self, block_size: int) -> int:
        """Blocks of every conversation at its end, the shared system prompt once."""
        private = self.turns * (self.user_len + self.answer_len)
        return -(-self.system_len // block_size) + self.users * -(-private // block_size)


def load_model(config: dict, dtype: jnp.dtype) -> LoadedModel:
    """A HF config's model with random weights (seeded: every run serves the same model)."""
    cfg = ModelConfig.from_hf(config)
    return LoadedModel(cfg, model_module(cfg.family).init_params(cfg, jax.random.key(0), dtype), None, ())


SLOWEST = 12  # requests whose TTFT breakdown a row keeps, slowest first


class PrefillCounter:
    """Prompt tokens the engine's scheduled chunks compute (a chunk's positions before its sequence's prompt end),
    counted by wrapping the scheduler's two ways to schedule: ``schedule`` and, for the step dispatched ahead of
    the one in flight (async scheduling), ``schedule_after``; and the moment each request was first scheduled
    (``admitted``, by request id), which splits a TTFT into its wait for admission and its prefill."""

    def __init__(self, engine: Engine):
        self.tokens = 0
        self.admitted: dict[str, float] = {}
        for name in ("schedule", "schedule_after"):
            setattr(engine.scheduler, name, self._counting(getattr(engine.scheduler, name)))

    def _counting(self, schedule: Callable[..., list]) -> Callable[..., list]:
        def counted(*args, **kwargs) -> list:
            chunks = schedule(*args, **kwargs)
            if not chunks:  # schedule_after's None: nothing scheduled
                return chunks
            now = time.perf_counter()
            for c in chunks:
                self.admitted.setdefault(c.seq.request_id, now)
            self.tokens += sum(max(0, min(c.start + c.count, len(c.seq.prompt_ids)) - c.start) for c in chunks)
            return chunks

        return counted


def run_workload(engine: Engine, workload: Workload, seed: int, vocab: int,
                 admitted: dict[str, float] | None = None) -> dict:
    """Every user's turns as a closed loop (module docstring): per request its TTFT; the run's wall time, output
    tokens, prompt tokens served by the cache, and every answer (by user and turn). With ``admitted`` (request id
    -> when first scheduled, ``PrefillCounter.admitted``), ``requests`` splits each TTFT into the wait for
    admission and the rest (prefill, tier loads), with the prompt and cached lengths."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, vocab, workload.system_len).tolist()
    messages = rng.integers(3, vocab, (workload.users, workload.turns, workload.user_len)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=workload.answer_len, ignore_eos=True)
    history = [list(system) for _ in range(workload.users)]
    turn, queued, first_token = [0] * workload.users, {}, {}
    ttft, answers, cached, output_tokens, requests = [], {}, 0, 0, []

    def submit(user: int, at: float) -> None:
        prompt = history[user] + messages[user][turn[user]]
        request = engine.add_request(prompt, params, request_id=f"u{user}t{turn[user]}")
        queued[request] = (user, prompt, at)

    think = workload.think_ms / 1e3
    start = time.perf_counter()
    # a heap of (ready time, user); ascending as built
    thinking = [(start + think * user / workload.users, user) for user in range(workload.users)]
    while queued or thinking:
        now = time.perf_counter()
        while thinking and thinking[0][0] <= now:
            ready, user = heapq.heappop(thinking)
            submit(user, ready)
        if not engine.has_unfinished():
            if thinking:
                time.sleep(max(0.0, thinking[0][0] - time.perf_counter()))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id not in first_token:
                first_token[out.request_id] = now
                ttft.append(now - queued[out.request_id][2])
            if out.finished:
                user, prompt, at = queued.pop(out.request_id)
                result = engine.release(out.request_id)
                answer = result.outputs[0].token_ids
                answers[out.request_id] = answer
                if admitted is not None:
                    first = first_token[out.request_id]
                    wait = admitted.get(out.request_id, first) - at
                    requests.append(dict(id=out.request_id, ttft_ms=round((first - at) * 1e3, 2),
                                         wait_ms=round(wait * 1e3, 2), prompt_tokens=len(prompt),
                                         cached_tokens=result.num_cached_tokens))
                cached += result.num_cached_tokens
                output_tokens += len(answer)
                history[user] = prompt + answer
                turn[user] += 1
                if turn[user] < workload.turns:
                    heapq.heappush(thinking, (now + think, user))
    return dict(seconds=time.perf_counter() - start, ttft=ttft, answers=answers, cached_tokens=cached,
                output_tokens=output_tokens, requests=requests)


def use_tiers(engine: Engine, tiers: KVTiers | None) -> None:
    """Serve with ``tiers`` (None: the GPU tier alone) from an empty GPU prefix cache."""
    engine.tiers = engine.runner.tiers = tiers
    engine.reset_prefix_cache()


def measure(engine: Engine, modes: dict[str, Callable[[], KVTiers | None]], workload: Workload,
            vocab: int, done: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """One row per mode (its tiers made by ``modes[mode]()``): an untimed round of ``workload`` with other prompts,
    then the timed one, each from empty caches; ``done(rows)`` after each mode (a run cut short keeps its rows).
    The first mode is the base of every row's ratios."""
    rows, counter, base_answers = [], PrefillCounter(engine), {}
    for mode, make_tiers in modes.items():
        use_tiers(engine, make_tiers())
        run_workload(engine, workload, seed=1, vocab=vocab)
        use_tiers(engine, make_tiers())
        counter.tokens, counter.admitted = 0, {}
        preemptions = engine.scheduler.num_preemptions
        with compile_events() as events:  # after the warm-up and the untimed round none should come
            result = run_workload(engine, workload, seed=0, vocab=vocab, admitted=counter.admitted)
        ttft_ms = np.asarray(result["ttft"]) * 1e3
        waits = np.asarray([r["wait_ms"] for r in result["requests"]])
        row = dict(mode=mode, requests=len(result["ttft"]), ttft_median_ms=float(np.median(ttft_ms)),
                   ttft_p99_ms=float(np.percentile(ttft_ms, 99)), prefill_tokens=counter.tokens,
                   cached_prompt_tokens=result["cached_tokens"], output_tokens=result["output_tokens"],
                   seconds=result["seconds"], output_tokens_per_s=result["output_tokens"] / result["seconds"],
                   preemptions=engine.scheduler.num_preemptions - preemptions, answers=result["answers"],
                   compiles=events.count(COMPILE_EVENTS[1]),
                   ttft_ms=np.round(np.sort(ttft_ms), 2).tolist(), wait_median_ms=float(np.median(waits)),
                   wait_p99_ms=float(np.percentile(waits, 99)),
                   slowest=sorted(result["requests"], key=lambda r: -r["ttft_ms"])[:SLOWEST])
        if engine.tier_stats is not None:  # this run's tiers' counters (they start at 0)
            row["tiers"] = dataclasses.asdict(engine.tier_stats)
        answers = row.pop("answers")
        if not rows:
            base_answers = answers
        base = rows[0] if rows else row
        row["same_answers"] = float(np.mean([answers[k] == base_answers[k] for k in base_answers]))
        row["ttft_median_speedup"] = base["ttft_median_ms"] / row["ttft_median_ms"]
        row["ttft_p99_speedup"] = base["ttft_p99_ms"] / row["ttft_p99_ms"]
        row["prefill_reduction"] = base["prefill_tokens"] / max(row["prefill_tokens"], 1)
        row["throughput_ratio"] = row["output_tokens_per_s"] / base["output_tokens_per_s"]
        rows.append(row)
        done(rows)
    return rows


def plot(rows: list[dict], name: str, out_dir: str | Path | None = None) -> None:
    """Bars per mode: TTFT median and p99, prefill tokens computed, output tokens/s; and each mode's TTFTs as a
    distribution (the fraction of requests whose first token came within t)."""
    import matplotlib.pyplot as plt

    panels = [("ttft_median_ms", "TTFT median (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)"),
              ("prefill_tokens", "prefill tokens computed"), ("output_tokens_per_s", "output tokens/s")]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4 * (len(panels) + 1), 3.8))
    for i, row in enumerate(rows):
        ttft = row["ttft_ms"]
        axes[-1].step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", color=f"C{i}", label=row["mode"])
    axes[-1].set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT distribution")
    axes[-1].legend(fontsize=8)
    for ax, (key, title) in zip(axes, panels, strict=False):
        values = [r[key] for r in rows]
        ax.bar([r["mode"] for r in rows], values, color=[f"C{i}" for i in range(len(rows))])
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=9)
        ax.set_title(title)
    fig.suptitle(f"{name}: multi-turn chat, prefix cache on the GPU vs with a host tier")
    fig.tight_layout()
    save_plot(fig, name, out_dir)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny model and workload (CPU_WORKLOAD)")
    parser.add_argument("--model", choices=list(MODELS))
    for key in ("users", "turns", "system_len", "user_len", "answer_len", "num_blocks", "block_size",
                "max_running", "token_budget"):
        parser.add_argument("--" + key.replace("_", "-"), type=int)
    parser.add_argument("--layers", type=int, help="the model's first N layers (a shape whose whole compile or "
                        "weights do not fit)")
    parser.add_argument("--host-cache-gb", type=float)
    parser.add_argument("--host-batches", default=str(MAX_BATCH),
                        help="comma-separated host batch sizes (KVTiers max_batch, powers of two): a tiered mode "
                        f"each; the default size's mode is 'gpu+host', another's 'gpu+host/N' (default {MAX_BATCH})")
    parser.add_argument("--tier-copies", default=COPIES[0],
                        help=f"comma-separated ways of copying pages (KVTiers copies, of {COPIES}): a tiered mode "
                        f"each; one but {COPIES[0]!r} adds '/<way>' to the mode's name (default {COPIES[0]})")
    parser.add_argument("--think-ms", type=float, help="a user's pause between an answer and its next turn")
    parser.add_argument("--decode-steps", type=int, help="Engine(decode_steps=N): decode steps per device call "
                        "(default: the engine's, by backend and batch)")
    parser.add_argument("--no-warm-up", action="store_true", help="skip Engine.warm_up (on the CPU it is skipped: "
                        "the untimed rounds compile what the timed ones meet)")
    parser.add_argument("--name", default=None, help="results file name (default: serving_multiturn[_cpu])")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    settings = dict(CPU_WORKLOAD if args.cpu else GPU_WORKLOAD)
    settings |= {k: v for k, v in vars(args).items() if k in settings and v is not None}
    for key, value in settings.items():
        if key != "model" and (value < 0 if key == "think_ms" else value <= 0):
            parser.error(f"--{key.replace('_', '-')}={value}: expected {'>= 0' if key == 'think_ms' else '> 0'}")
    if args.decode_steps is not None and args.decode_steps < 1:
        parser.error(f"--decode-steps={args.decode_steps}: expected >= 1")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers={args.layers}: expected >= 1")
    config = with_layers(MODELS[settings["model"]], args.layers)
    settings["layers"] = num_layers(config)
    workload = Workload(*(settings[k] for k in ("users", "turns", "system_len", "user_len", "answer_len", "think_ms")))
    try:
        host_batches = [int(x) for x in args.host_batches.split(",")]
    except ValueError:
        parser.error(f"--host-batches={args.host_batches!r}: expected comma-separated integers")
    if any(n < 1 or n & (n - 1) or n > MAX_BATCH for n in host_batches):
        parser.error(f"--host-batches={args.host_batches}: expected powers of two up to {MAX_BATCH} (what warm_up "
                     "compiles)")
    tier_copies = args.tier_copies.split(",")
    if not tier_copies or any(c not in COPIES for c in tier_copies):
        parser.error(f"--tier-copies={args.tier_copies!r}: expected comma-separated ways of {COPIES}")
    max_len = workload.system_len + workload.turns * (workload.user_len + workload.answer_len)
    if max_len >= config["max_position_embeddings"]:
        parser.error(f"conversations reach {max_len} tokens: expected fewer than the model's "
                     f"{config['max_position_embeddings']}")
    working_set = workload.working_set_blocks(settings["block_size"])
    if working_set <= settings["num_blocks"]:
        parser.error(f"the working set ({working_set} blocks) fits the GPU's {settings['num_blocks']} blocks: "
                     "expected a load where the GPU tier alone evicts")
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    loaded = load_model(config, dtype)
    options = dict(dtype=dtype, num_blocks=settings["num_blocks"], block_size=settings["block_size"],
                   max_running=settings["max_running"], token_budget=settings["token_budget"], max_model_len=max_len,
                   decode_steps=args.decode_steps)
    engine = Engine(loaded, host_cache_gb=settings["host_cache_gb"], **options)
    host_blocks = engine.tiers.host_blocks
    if not (on_cpu or args.no_warm_up):
        engine.warm_up()  # every step shape, and the tiers' copies
    else:
        engine.runner.kv = engine.tiers.warm_up(engine.runner.kv)

    def tiers(size: int, copies: str) -> KVTiers:
        """Fresh tiers over the engine's cache as it is now, their copies compiled (a warm-up has no effect)."""
        made = KVTiers(engine.runner.kv, host_blocks, max_batch=size, copies=copies)
        engine.runner.kv = made.warm_up(engine.runner.kv)
        return made

    modes = {"gpu": lambda: None} | {
        "gpu+host" + ("" if size == MAX_BATCH else f"/{size}") + ("" if copies == COPIES[0] else f"/{copies}"):
            lambda size=size, copies=copies: tiers(size, copies)
        for size in host_batches for copies in tier_copies}
    name = args.name or ("serving_multiturn_cpu" if args.cpu else "serving_multiturn")
    settings["decode_steps"] = dataclasses.asdict(engine.decode_steps)

    def write(rows: list[dict]) -> None:
        write_results(name, dict(benchmark=name, settings=settings, working_set_blocks=working_set, rows=rows),
                      args.out_dir)

    rows = measure(engine, modes, workload, config["vocab_size"], done=write)
    print(format_table(rows, ["mode", "requests", "ttft_median_ms", "ttft_p99_ms", "wait_p99_ms", "prefill_tokens",
                              "cached_prompt_tokens", "output_tokens_per_s", "preemptions", "compiles", "same_answers",
                              "ttft_median_speedup", "prefill_reduction", "throughput_ratio"]))
    plot(rows, name, args.out_dir)
    return rows


if __name__ == "__main__":
    enable_command_buffers()
    main()
