"""Prefix-cache tiers below the GPU's blocks: host memory, then an optional disk folder.

The block allocator names a full, computed block by its salted chain hash (``blocks.py``). When it evicts such
a block for new data, the block's pages are *saved* here under that hash instead of being lost; when a later
prefix lookup misses on the GPU, the next hashes are looked up here and a hit is *loaded* into a freshly
allocated GPU block. Equal hashes mean equal salted token prefixes, so a restored block holds bitwise the pages
a recomputation would write, and tenants with different salts never share one.

One block's pages are ``[leaves, block_size, *page]``: every cache leaf (``k[l]``, ``v[l]`` of ``PagedKV``,
``latent[l]`` of ``PagedLatentKV``) stacked, its rows of that block. The host tier keeps them in *batches*: the
pages of up to ``max_batch`` blocks (default ``MAX_BATCH``) saved together, one array
``[n, leaves, block_size, *page]`` in the device's pinned host memory (``memory_kind="pinned_host"``), and a block
is a row of one.

Copies are batched, asynchronous and DMA-fast. The allocator's saves and loads of one scheduling decision are
queued, and ``apply(kv)`` (called by the runner before each step's device call) issues them: the saved blocks are
gathered on the device in power-of-two batches and put into pinned host memory (an asynchronous DMA, no host
memcpy), then every host batch holding a loaded block is put back on the device whole and its rows scattered into
the donated cache. Pinned memory is what makes the copies cheap: DMA at PCIe speed either way, where pageable numpy
arrays go through staging copies and page faults an order of magnitude slower; loading a token's pages must cost
well under recomputing them, or the tier is no gain. The host thread should wait for no copy: the device orders
each scatter after the gathers and steps before it. Whether a ``device_put`` between memories returns before its
source is computed is the runtime's business, so ``KVTiers(copies="program")`` moves the pages inside the gather's
and the scatter's own programs instead (``jax.memory.Space``), one dispatch per copy; ``tools/tier_copy_probe``
times both ways on a busy device. The gathers and scatters run as executables compiled once per batch size and kind
of host batch (``warm_up`` compiles them all): a compiled call takes the cache as a step leaves it, where a jitted
call would need every leaf committed first (a step's compiled executable returns them uncommitted, and jit keys its
cache on that): one ``device_put`` per leaf per copy, a Python call each, 96 for Qwen3-30B-A3B's cache.
Ordering within a window: a block saved and then loaded in the same window is gathered before the scatter
overwrites it; a block loaded and then saved again is saved from the data being loaded (no device read).

Tiers are LRU. The host tier holds at most ``host_blocks`` blocks' pages in memory: the oldest entries are dropped
until the batches still holding a live entry fit (a batch's memory is freed with its last entry; a batch is at most
``host_blocks`` rows). The disk tier (``disk_dir``) is written through: a block saved on the host is written to one
file, ``<hash hex>.kv``, in a folder named by the cache layout's fingerprint (model config, weights sample, dtype,
block size), so a new engine over the same folder and model reuses it. A file is a JSON header line (dtype, shape,
SHA-256 of the payload) and the raw payload; one whose size, layout or checksum does not match is deleted and
counted ``disk_corrupt``, never served (the block is recomputed). ``disk_blocks`` bounds the files (None: no bound),
oldest used dropped first.
"""

import collections
import dataclasses
import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BlockHash = bytes
SUFFIX = ".kv"  # a disk block file's suffix: <hash hex>.kv


@dataclasses.dataclass
class TierStats:
    """Counters of the tiers: blocks served by each tier on prefix lookups, bytes moved, host seconds spent."""

    gpu_hits: int = 0  # blocks a prefix lookup found on the GPU
    host_hits: int = 0  # ... in host memory (loaded to the GPU)
    disk_hits: int = 0  # ... on disk (read to the host, loaded to the GPU)
    disk_corrupt: int = 0  # disk blocks whose size, layout or checksum failed (deleted, recomputed)
    saved_blocks: int = 0  # blocks copied device -> host
    loaded_blocks: int = 0  # blocks scattered into the GPU cache from host batches
    load_batches: int = 0  # host batches put on the device for those loads (each whole)
    device_to_host_bytes: int = 0
    host_to_device_bytes: int = 0  # what the loads moved: whole batches, so >= loaded_blocks' bytes
    disk_write_bytes: int = 0
    disk_read_bytes: int = 0
    copy_seconds: float = 0.0  # host time spent issuing and waiting for copies and on disk I/O


MAX_BATCH = 64  # the most blocks in one host batch (default): saves are split into power-of-two batches up to it
COPIES = ("put", "program")  # KVTiers' ways of moving pages between device and host (its docstring)


class _Batch:
    """The pages of blocks saved together: ``array`` ``[n, leaves, block_size, *page]``, in pinned host memory
    (its DMA from the device may still run; numpy pages read from disk stay numpy), ``entries`` the host entries
    of its rows, ``live`` how many of them the host tier still holds (its memory is freed with the last)."""

    def __init__(self, array: Any, entries: list["_Entry"]):
        self.array, self.entries, self.live = array, entries, 0
        self._pages: np.ndarray | None = None

    def numpy(self) -> np.ndarray:
        """The batch as a host numpy array (waits for its copy; kept until ``forget_numpy``)."""
        if self._pages is None:
            self._pages = np.asarray(self.array)
        return self._pages

    def forget_numpy(self) -> None:
        self._pages = None


class _Entry:
    """The pages of the block named ``block_hash``: row ``row`` of ``batch`` (None: its gather is still queued)."""

    def __init__(self, block_hash: BlockHash, batch: _Batch | None = None, row: int = 0):
        self.block_hash, self.batch, self.row = block_hash, batch, row

    def array(self) -> np.ndarray:
        """The block's pages as a numpy array (waits for its copy)."""
        return self.batch.numpy()[self.row]


def _chunks(n: int, largest: int) -> list[int]:
    """``n`` as descending powers of two of at most ``largest`` (a power of two): one compile per size, no
    padding."""
    return [largest] * (n // largest) + [1 << i for i in reversed(range(largest.bit_length())) if n % largest >> i & 1]


def _memory_kind(array: jax.Array, kind: str) -> Any:
    """``array``'s sharding in memory ``kind`` where its device has that memory, else as it is."""
    device = next(iter(array.devices()))
    kinds = {m.kind for m in device.addressable_memories()}
    return array.sharding.with_memory_kind(kind) if kind in kinds else array.sharding


def _stack(kv: Any, blocks: jax.Array) -> jax.Array:
    """``[n, leaves, block_size, *page]``: every cache leaf's rows ``blocks [n]``, stacked per block."""
    return jnp.stack([leaf[blocks] for leaf in jax.tree.leaves(kv)], axis=1)


_gather = jax.jit(_stack)


@jax.jit
def _gather_to_host(kv: Any, blocks: jax.Array) -> jax.Array:
    """``_stack``'s pages written into host memory by the program itself (``copies="program"``): one dispatch,
    whose device-to-host DMA runs on the device's queue after the gather."""
    return jax.device_put(_stack(kv, blocks), jax.memory.Space.Host)


@functools.partial(jax.jit, donate_argnames="kv")
def _scatter(kv: Any, blocks: jax.Array, data: jax.Array, rows: jax.Array) -> Any:
    """``kv`` with every leaf's rows ``blocks[i]`` set to ``data[rows[i], leaf]``; out-of-range (padding) blocks
    dropped. ``data`` in host memory (``copies="program"``) is moved to the device by the program itself."""
    leaves, tree = jax.tree.flatten(kv)
    picked = jax.device_put(data, jax.memory.Space.Device)[rows]
    return jax.tree.unflatten(tree, [leaf.at[blocks].set(picked[:, i].astype(leaf.dtype), mode="drop")
                                     for i, leaf in enumerate(leaves)])


def layout_fingerprint(cfg: Any, params: Any, dtype: Any, block_size: int) -> str:
    """A hex digest naming what a block's pages depend on besides its tokens: the model config, a sample of the
    weights (the first values of every leaf), the cache dtype and the block size."""
    digest = hashlib.sha256(repr((cfg, str(jnp.dtype(dtype)), block_size)).encode())
    for leaf in jax.tree.leaves(params):
        digest.update(np.asarray(jnp.ravel(leaf[(0,) * (leaf.ndim - 1)] if leaf.ndim > 1 else leaf)[:8]).tobytes())
    return digest.hexdigest()[:32]


class DiskTier:
    """Blocks as files ``<hash hex>.kv`` in ``folder`` (module docstring), LRU over at most ``max_blocks``."""

    def __init__(self, folder: str | Path, shape: tuple[int, ...], dtype: np.dtype, max_blocks: int | None,
                 stats: TierStats):
        if max_blocks is not None and max_blocks < 1:
            raise ValueError(f"DiskTier: max_blocks={max_blocks}: expected None (no bound) or >= 1")
        self.folder, self.shape, self.dtype = Path(folder), tuple(shape), np.dtype(dtype)
        self.max_blocks, self.stats = max_blocks, stats
        self.folder.mkdir(parents=True, exist_ok=True)
        files = sorted(self.folder.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
        self._files: collections.OrderedDict[BlockHash, None] = collections.OrderedDict()
        for path in files:
            try:
                self._files[bytes.fromhex(path.stem)] = None
            except ValueError:
                continue  # not one of ours
        self._trim()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._files

    def __len__(self) -> int:
        return len(self._files)

    def _path(self, block_hash: BlockHash) -> Path:
        return self.folder / (block_hash.hex() + SUFFIX)

    def write(self, block_hash: BlockHash, data: np.ndarray) -> None:
        """Write ``data`` (``shape``, ``dtype``) under ``block_hash``: a temporary file renamed into place."""
        if block_hash in self._files:
            self._files.move_to_end(block_hash)
            return
        payload = np.ascontiguousarray(data).tobytes()
        header = json.dumps({"dtype": self.dtype.name, "shape": list(self.shape),
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode() + b"\n"
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(header + payload)
        os.replace(tmp, path)
        self.stats.disk_write_bytes += len(payload)
        self._files[block_hash] = None
        self._trim()

    def read(self, block_hash: BlockHash) -> np.ndarray | None:
        """The block's pages, or None if absent or corrupt (a corrupt file is deleted and counted)."""
        if block_hash not in self._files:
            return None
        path = self._path(block_hash)
        try:
            raw = path.read_bytes()
            header_line, payload = raw.split(b"\n", 1)
            header = json.loads(header_line)
            valid = (header.get("dtype") == self.dtype.name and header.get("shape") == list(self.shape)
                     and len(payload) == self.dtype.itemsize * int(np.prod(self.shape))
                     and header.get("sha256") == hashlib.sha256(payload).hexdigest())
        except (OSError, ValueError):
            valid = False
        if not valid:
            self.stats.disk_corrupt += 1
            self.drop(block_hash)
            return None
        self._files.move_to_end(block_hash)
        os.utime(path)
        self.stats.disk_read_bytes += len(payload)
        return np.frombuffer(payload, self.dtype).reshape(self.shape)

    def drop(self, block_hash: BlockHash) -> None:
        self._files.pop(block_hash, None)
        self._path(block_hash).unlink(missing_ok=True)

    def _trim(self) -> None:
        while self.max_blocks is not None and len(self._files) > self.max_blocks:
            self.drop(next(iter(self._files)))


class KVTiers:
    """The host tier (and the disk tier under it) of one paged cache ``kv`` (module docstring).

    Args:
      kv: the engine's cache (a ``PagedKV`` or ``PagedLatentKV``; only its shapes and dtype are read).
      host_blocks: blocks the host tier holds (>= 1).
      disk_dir: the disk tier's folder (None: no disk tier); blocks go to ``disk_dir / fingerprint``.
      fingerprint: ``layout_fingerprint`` of the model (names the disk subfolder).
      disk_blocks: the most blocks on disk (None: no bound).
      max_batch: the most blocks in one host batch (a power of two). A load puts its block's whole batch on the
        device, so larger batches mean fewer copies to issue and more bytes moved that no one asked for.
      copies: how the pages cross between device and host (``COPIES``): "put", a jitted gather, then
        ``jax.device_put`` into pinned host memory (and back before the jitted scatter); "program", the gather's
        program writes its output into host memory and the scatter's reads the host batch itself
        (``jax.memory.Space`` inside ``jit``), so each copy is one dispatch and nothing is a host-side transfer call.
    """

    def __init__(self, kv: Any, host_blocks: int, disk_dir: str | Path | None = None, fingerprint: str = "",
                 disk_blocks: int | None = None, max_batch: int = MAX_BATCH, copies: str = "put"):
        if host_blocks < 1:
            raise ValueError(f"KVTiers: host_blocks={host_blocks}: expected >= 1")
        if copies not in COPIES:
            raise ValueError(f"KVTiers: copies={copies!r}: expected one of {COPIES}")
        self.copies = copies
        if max_batch < 1 or max_batch & (max_batch - 1):
            raise ValueError(f"KVTiers: max_batch={max_batch}: expected a power of two >= 1")
        leaves = jax.tree.leaves(kv)
        shapes = {leaf.shape[1:] for leaf in leaves}
        if len(shapes) != 1:
            raise ValueError(f"KVTiers: cache leaves of page shapes {sorted(shapes)}: expected one shape")
        self.num_blocks = leaves[0].shape[0]
        self.block_shape = (len(leaves), *shapes.pop())  # [leaves, block_size, *page]
        self.dtype = np.dtype(leaves[0].dtype)
        self.block_bytes = self.dtype.itemsize * int(np.prod(self.block_shape))
        self.host_blocks = host_blocks
        self.stats = TierStats()
        self._host: collections.OrderedDict[BlockHash, _Entry] = collections.OrderedDict()
        self.disk = (None if disk_dir is None else
                     DiskTier(Path(disk_dir) / (fingerprint or "default"), self.block_shape, self.dtype, disk_blocks,
                              self.stats))
        self._saves: list[tuple[int, _Entry]] = []  # (GPU block, its entry) to gather at the next apply
        self._loads: dict[int, _Entry] = {}  # GPU block -> the entry to scatter into it at the next apply
        # the host tier's memory in blocks: the rows of batches holding a live entry, one per queued live entry
        self._held = 0
        self.batch_limit = min(max_batch, 1 << (host_blocks.bit_length() - 1))  # a batch fits the tier
        self._unwritten: list[_Batch] = []  # saved batches not yet written through to the disk tier
        self._programs: dict[tuple, jax.stages.Compiled] = {}  # the copies' executables (``_run``)

    @property
    def num_host(self) -> int:
        return len(self._host)

    def save(self, block: int, block_hash: BlockHash) -> None:
        """The allocator evicts GPU ``block`` named ``block_hash``: keep its pages (copied at the next ``apply``)."""
        pending = self._loads.pop(block, None)  # a block still to be loaded holds that entry's data
        if block_hash in self._host:
            self._host.move_to_end(block_hash)  # the host holds them already: nothing to copy
            return
        entry = _Entry(block_hash) if pending is None else pending
        if pending is None:
            self._saves.append((block, entry))
        self._put(entry)

    def lookup(self, block_hash: BlockHash) -> _Entry | None:
        """The pages saved under ``block_hash``: the host's (marked recently used), else the disk's (then kept on
        the host too), else None. Counts the hit."""
        entry = self._host.get(block_hash)
        if entry is not None:
            self._host.move_to_end(block_hash)
            self.stats.host_hits += 1
            return entry
        if self.disk is None:
            return None
        start = time.perf_counter()
        data = self.disk.read(block_hash)
        self.stats.copy_seconds += time.perf_counter() - start
        if data is None:
            return None
        self.stats.disk_hits += 1
        entry = _Entry(block_hash)
        entry.batch = _Batch(data[None], [entry])
        self._put(entry)
        return entry

    def load(self, block: int, entry: _Entry) -> None:
        """Fill the freshly allocated GPU ``block`` with ``entry``'s pages at the next ``apply``."""
        self._loads[block] = entry

    def apply(self, kv: Any) -> Any:
        """Issue the queued copies against ``kv`` (the cache the next step reads) and return the cache to use:
        the saved blocks gathered and put into pinned host memory, then each host batch holding a loaded block put
        on the device and its rows scattered into the cache (``kv`` donated). Nothing is waited for; finished
        saves are written through to the disk tier."""
        start = time.perf_counter()
        self._write_through(wait=False)
        if self._saves:
            # entries dropped since their save are gathered only for the disk tier or a load in this window, and
            # apart from live ones, so a host batch holds live rows only
            loading = {id(e) for e in self._loads.values()}
            live = [(b, e) for b, e in self._saves if self._host.get(e.block_hash) is e]
            dead = [(b, e) for b, e in self._saves if self._host.get(e.block_hash) is not e
                    and (self.disk is not None or id(e) in loading)]
            for group in (live, dead):
                done = 0
                for size in _chunks(len(group), self.batch_limit):
                    part = group[done:done + size]
                    done += size
                    batch = _Batch(self._host_batch(kv, np.asarray([b for b, _ in part], np.int32)),
                                   [e for _, e in part])
                    for row, entry in enumerate(batch.entries):
                        entry.batch, entry.row = batch, row
                    batch.live = len(part) if group is live else 0
                    if self.disk is not None:
                        self._unwritten.append(batch)
            self.stats.saved_blocks += len(live) + len(dead)
            self.stats.device_to_host_bytes += (len(live) + len(dead)) * self.block_bytes
            self._saves = []
        if self._loads:
            by_batch: dict[int, tuple[_Batch, list[tuple[int, int]]]] = {}
            for block, entry in self._loads.items():
                by_batch.setdefault(id(entry.batch), (entry.batch, []))[1].append((block, entry.row))
            for batch, pairs in by_batch.values():
                size, data = len(batch.entries), self._scatter_input(batch.array)
                for i in range(0, len(pairs), size):  # a row loaded into several blocks: more pairs than rows
                    blocks = np.full(size, self.num_blocks, np.int32)  # padding: out of range, dropped
                    rows = np.zeros(size, np.int32)
                    part = pairs[i:i + size]
                    blocks[:len(part)], rows[:len(part)] = zip(*part, strict=True)
                    kv = self._run(_scatter, kv, blocks, data, rows)
                self.stats.host_to_device_bytes += size * self.block_bytes
            self.stats.loaded_blocks += len(self._loads)
            self.stats.load_batches += len(by_batch)
            self._loads = {}
        self.stats.copy_seconds += time.perf_counter() - start
        return kv

    def warm_up(self, kv: Any) -> Any:
        """Run the gather, the host round trip and the scatter once at every batch size ``apply`` uses (powers of
        two up to ``batch_limit``), with no effect: every scattered block is out of range. Returns the cache to use
        (the scatter donates it)."""
        for n in (1 << i for i in range(self.batch_limit.bit_length())):
            data = self._scatter_input(self._host_batch(kv, np.zeros(n, np.int32)))
            kv = self._run(_scatter, kv, np.full(n, self.num_blocks, np.int32), data, np.zeros(n, np.int32))
        pages = np.zeros((1, *self.block_shape), self.dtype)  # a block read from disk
        kv = self._run(_scatter, kv, np.full(1, self.num_blocks, np.int32), pages, np.zeros(1, np.int32))
        return jax.block_until_ready(kv)

    def drain(self) -> None:
        """Wait for every started host copy (and write it to disk): for a clean shutdown or a test."""
        start = time.perf_counter()
        jax.block_until_ready([e.batch.array for e in self._host.values() if e.batch is not None])
        self._write_through(wait=True)
        self.stats.copy_seconds += time.perf_counter() - start

    def reset(self) -> None:
        """Forget queued copies (the cache they named is gone); what the host and disk hold stays valid, except
        entries whose gather never ran."""
        for _, entry in self._saves:
            if self._host.get(entry.block_hash) is entry:
                del self._host[entry.block_hash]
        self._saves, self._loads = [], {}

    def _host_batch(self, kv: Any, blocks: np.ndarray) -> jax.Array:
        """The pages of GPU ``blocks`` as a host batch ``[n, leaves, block_size, *page]``, not waited for."""
        if self.copies == "program":
            return self._run(_gather_to_host, kv, blocks)
        return _to_host(self._run(_gather, kv, blocks))

    def _scatter_input(self, array: Any) -> Any:
        """A host batch as ``_scatter`` takes it: as it is for "program" (its program reads the host memory)."""
        return array if self.copies == "program" else _to_device(array)

    def _run(self, program: Any, kv: Any, *args: Any) -> Any:
        """``program(kv, *args)`` (a jitted copy) through its executable for these arguments' shapes, dtypes and
        memories, compiled at the first such call (``warm_up`` makes them all): it takes ``kv``'s leaves committed
        or not (module docstring)."""
        key = (program, *((a.shape, a.dtype, _memory(a)) for a in args))
        compiled = self._programs.get(key)
        if compiled is None:
            compiled = self._programs[key] = program.lower(kv, *args).compile()
        return compiled(kv, *args)

    def _put(self, entry: _Entry) -> None:
        """Keep ``entry`` as the most recent host entry, then drop the oldest while the memory held exceeds
        ``host_blocks``."""
        old = self._host.pop(entry.block_hash, None)
        if old is not None:
            self._release(old)
        self._host[entry.block_hash] = entry
        if entry.batch is None:
            self._held += 1
        else:
            entry.batch.live += 1
            self._held += len(entry.batch.entries) if entry.batch.live == 1 else 0
        self._evict()

    def _evict(self) -> None:
        while self._held > self.host_blocks and self._host:
            old_hash, old = self._host.popitem(last=False)
            if self.disk is not None and old_hash not in self.disk and old.batch is not None:
                self.disk.write(old_hash, old.array())
            self._release(old)

    def _release(self, entry: _Entry) -> None:
        """``entry`` left the host tier: a queued one frees its row, a saved one its batch with the last."""
        if entry.batch is None:
            self._held -= 1
            return
        entry.batch.live -= 1
        if entry.batch.live == 0:
            self._held -= len(entry.batch.entries)
            entry.batch.forget_numpy()

    def _write_through(self, wait: bool) -> None:
        """Write the saved batches whose copies finished (``wait``: all) to the disk tier."""
        keep = []
        for batch in self._unwritten:
            if not (wait or batch.array.is_ready()):
                keep.append(batch)
                continue
            pages = batch.numpy()
            for entry in batch.entries:
                self.disk.write(entry.block_hash, pages[entry.row])
            batch.forget_numpy()
        self._unwritten = keep


def _memory(array: Any) -> str | None:
    """Where an argument of a copy lives: a jax array's memory kind, None for numpy (moved by the call)."""
    return array.sharding.memory_kind if isinstance(array, jax.Array) else None


def _to_host(array: jax.Array) -> jax.Array:
    """``array`` in its device's pinned host memory (an asynchronous DMA), where the device has one."""
    return jax.device_put(array, _memory_kind(array, "pinned_host"))


def _to_device(array: Any) -> Any:
    """A host batch's pages back in device memory (numpy pages as they are: the scatter's call moves them)."""
    return jax.device_put(array, _memory_kind(array, "device")) if isinstance(array, jax.Array) else array
