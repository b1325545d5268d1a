"""Do the prefix-cache tiers' copies make the host wait while the device is busy?

``serving.engine.kv_tiers`` issues its copies from the engine's loop, between steps that are still running on the
device. Each copy must return at once (the device orders it after the work before it); a copy that waits for its
source, or for the device to drain, stalls the loop for a whole step. This times, with a long computation in
flight, how long each call takes to return on the host and how long until its result is ready:

* ``gather``: ``kv_tiers._gather`` of blocks from a cache the running computation writes (a jitted dispatch);
* ``to pinned_host``: ``device_put`` of that not-yet-computed gather into pinned host memory (a save);
* ``from pinned_host``: ``device_put`` of a ready pinned host batch onto the device (a load);
* ``scatter``: ``kv_tiers._scatter`` of it into the donated cache (the load's second half);
* ``gather to host (program)``: ``kv_tiers._gather_to_host``, whose program writes the pages into host memory
  (a save with ``KVTiers(copies="program")``);
* ``scatter from host (program)``: ``kv_tiers._scatter`` of the pinned host batch itself, moved by its program
  (that mode's load, in one call);
* ``apply: save`` / ``apply: load`` (both ways of copying): ``KVTiers.apply`` as the engine's runner calls it,
  on the cache as a step's compiled executable leaves it (every leaf uncommitted), that step in flight: a save of
  ``rows`` blocks, then their load into other blocks;
* ``commit each leaf``: a ``device_put`` of each such leaf to its own sharding, what a jitted copy would need
  before every call on such a cache (jit keys its cache on committed arguments; ``apply``'s compiled copies take
  the leaves as they are), timed beside ``apply`` for comparison.

A row whose ``returned_ms`` is close to ``busy_ms`` waited for the device; ``compiles`` counts the compile events
during the measured call (a nonzero one timed a compile, not a copy). Prints a table and writes
``tier_copy_probe.json`` through the benchmarks' harness (device, versions, date, commit).

    python3 -m tools.tier_copy_probe          # on the GPU machine: a few seconds
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.harness import compile_events, write_results  # noqa: E402
from serving.engine.kv_tiers import COPIES, KVTiers, _gather, _gather_to_host, _memory_kind, _scatter  # noqa: E402


def probe(blocks: int = 1024, rows: int = 64, page: tuple[int, ...] = (16, 8, 128), leaves: int = 8,
          busy_iters: int = 200, size: int = 4096) -> list[dict]:
    """Each call's host return time and ready time, in ms from its dispatch, while ``busy`` (``busy_iters``
    matmuls of ``size`` squared) runs; every call compiled and run once before."""
    dtype = jnp.bfloat16
    # committed: the jitted calls' first pass then compiles for the argument shardings the measured pass meets
    kv = jax.device_put([jnp.zeros((blocks, *page), dtype) for _ in range(leaves)], jax.devices()[0])
    busy = jax.jit(lambda kv, x: ([leaf + 1 for leaf in kv], jax.lax.fori_loop(
        0, busy_iters, lambda i, a: jnp.tanh(a @ a * 1e-3), x)), donate_argnums=0)
    step = busy.lower(kv, jnp.ones((size, size), dtype)).compile()  # as the runner calls it: leaves uncommitted
    tiers = {copies: KVTiers(kv, host_blocks=2 * rows, max_batch=rows, copies=copies) for copies in COPIES}
    for t in tiers.values():
        kv = t.warm_up(kv)
    saved = 0  # names of saved blocks, new each pass
    x = jnp.ones((size, size), dtype)
    ids = np.arange(rows, dtype=np.int32)
    kv, _ = jax.block_until_ready(busy(kv, x))  # the cache as a step leaves it (committed), as the tiers see it
    pinned = _memory_kind(_gather(kv, ids), "pinned_host")
    on_device = _memory_kind(kv[0], "device")
    host_batch = jax.block_until_ready(jax.device_put(_gather(kv, ids), pinned))

    def one_pass(kv):
        """Each call dispatched right after ``busy``, on the cache ``busy`` is writing: (rows, the cache)."""
        nonlocal saved
        out = []

        def timed(name, fn, compiled_step=False):
            nonlocal kv
            kv, y = (step if compiled_step else busy)(kv, x)
            with compile_events() as events:
                start = time.perf_counter()
                result = fn(kv)
                returned = time.perf_counter()
                jax.block_until_ready(result)
            out.append(dict(call=name, returned_ms=1e3 * (returned - start),
                            ready_ms=1e3 * (time.perf_counter() - start), compiles=len(events)))
            y.block_until_ready()
            return result

        timed("gather", lambda kv: _gather(kv, ids))
        timed("to pinned_host", lambda kv: jax.device_put(_gather(kv, ids), pinned))
        data = timed("from pinned_host", lambda kv: jax.device_put(host_batch, on_device))
        padding = np.full(rows, blocks, np.int32)  # out of range: scattered rows are dropped
        kv = timed("scatter", lambda kv: _scatter(kv, padding, data, np.zeros(rows, np.int32)))
        timed("gather to host (program)", lambda kv: _gather_to_host(kv, ids))
        kv = timed("scatter from host (program)", lambda kv: _scatter(kv, padding, host_batch,
                                                                      np.zeros(rows, np.int32)))
        for copies, t in tiers.items():
            names = [f"{saved + i}".encode() for i in range(rows)]
            saved += rows
            for block, name in enumerate(names):
                t.save(block, name)
            kv = timed(f"apply: save {rows} blocks ({copies})", t.apply, compiled_step=True)
            for block, name in enumerate(names):
                t.load(rows + block, t.lookup(name))
            kv = timed(f"apply: load {rows} blocks ({copies})", t.apply, compiled_step=True)
        kv = timed("commit each leaf", lambda kv: [jax.device_put(leaf, leaf.sharding) for leaf in kv],
                   compiled_step=True)
        return out, kv

    _, kv = one_pass(kv)  # compiles every call on the signatures the measured pass meets
    start = time.perf_counter()
    kv, y = busy(kv, x)
    y.block_until_ready()
    busy_ms = 1e3 * (time.perf_counter() - start)
    return [dict(row, busy_ms=busy_ms) for row in one_pass(kv)[0]]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-iters", type=int, default=200, help="matmuls of the computation in flight")
    parser.add_argument("--size", type=int, default=4096, help="their matrices' side")
    parser.add_argument("--leaves", type=int, default=8, help="cache leaves (a model's K and V per layer: 96 for "
                        "Qwen3-30B-A3B's 48 layers); each copy's programs take every one")
    parser.add_argument("--page", default="16,8,128", help="a leaf's block shape: block size, kv heads, head dim "
                        "(Qwen3-30B-A3B: 16,4,128)")
    parser.add_argument("--out-dir", help="where tier_copy_probe.json goes (default benchmarks/results/; a copy "
                        "into $OUT when set)")
    args = parser.parse_args(argv)
    try:
        page = tuple(int(n) for n in args.page.split(","))
    except ValueError:
        parser.error(f"--page {args.page!r}: expected comma-separated integers")
    if args.leaves < 1 or not page or min(page) < 1:
        parser.error(f"--leaves {args.leaves} / --page {args.page}: expected positive sizes")
    rows = probe(page=page, leaves=args.leaves, busy_iters=args.busy_iters, size=args.size)
    for row in rows:
        print(f"{row['call']:<32} returned {row['returned_ms']:8.2f} ms  ready {row['ready_ms']:8.2f} ms  "
              f"(computation in flight: {row['busy_ms']:.1f} ms)" + (f"  COMPILED {row['compiles']}x" if row["compiles"]
                                                                      else ""))
    write_results("tier_copy_probe", dict(busy_iters=args.busy_iters, size=args.size, leaves=args.leaves, page=page,
                                          rows=rows), args.out_dir)
    return rows


if __name__ == "__main__":
    main()
