"""Prefix-cache tiers below the GPU's blocks: host memory, then an optional disk folder.

The block allocator names a full, computed block by its salted chain hash (``blocks.py``). When it evicts such
a block for new data, the block's pages are *saved* here under that hash instead of being lost; when a later
prefix lookup misses on the GPU, the next hashes are looked up here and a hit is *loaded* into a freshly
allocated GPU block. Equal hashes mean equal salted token prefixes, so a restored block holds bitwise the pages
a recomputation would write, and tenants with different salts never share one.

One block's pages on the host are one array ``[leaves, block_size, *page]``: every cache leaf (``k[l]``, ``v[l]``
of ``PagedKV``, ``latent[l]`` of ``PagedLatentKV``) stacked, its rows of that block.

Copies are batched and never waited for by the step that does not need them. The allocator's saves and loads
of one scheduling decision are queued, and ``apply(kv)`` (called by the runner before each step's device call)
issues them in two device calls: one gather of the saved blocks, whose result starts its device->host copy at
once (``copy_to_host_async``) and is read into host memory only once it is ready (or when its data is needed),
then one scatter of the loaded blocks into the donated cache. Ordering: a block saved and then loaded in the same
window is gathered before the scatter overwrites it; a block loaded and then saved again is saved from the data
being loaded (no device read); a load of data whose save is still in the window waits for that gather.

Tiers are LRU. The host tier holds ``host_blocks`` blocks (oldest dropped first). The disk tier (``disk_dir``)
is written through: a block saved on the host is written to one file, ``<hash hex>.kv``, in a folder named by
the cache layout's fingerprint (model config, weights sample, dtype, block size), so a new engine over the same
folder and model reuses it. A file is a JSON header line (dtype, shape, SHA-256 of the payload) and the raw
payload; one whose size, layout or checksum does not match is deleted and counted ``disk_corrupt``, never served
(the block is recomputed). ``disk_blocks`` bounds the files (None: no bound), oldest used dropped first.
"""

import collections
import dataclasses
import functools
import hashlib
import json
import math
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
    device_to_host_bytes: int = 0
    host_to_device_bytes: int = 0
    disk_write_bytes: int = 0
    disk_read_bytes: int = 0
    copy_seconds: float = 0.0  # host time spent issuing and waiting for copies and on disk I/O


class _Transfer:
    """One batched device->host copy ``[n, leaves, block_size, *page]``, started at once, read when needed."""

    def __init__(self, device: jax.Array):
        device.copy_to_host_async()
        self.device, self.host = device, None

    def ready(self) -> bool:
        return self.host is not None or self.device.is_ready()

    def result(self) -> np.ndarray:
        if self.host is None:
            self.host, self.device = np.asarray(self.device), None
        return self.host


class _Entry:
    """The pages of the block named ``block_hash`` on the host: a numpy array, or row ``row`` of a pending
    ``_Transfer`` (neither: its gather is still queued)."""

    def __init__(self, block_hash: BlockHash, data: np.ndarray | None = None):
        self.block_hash, self.data, self.transfer, self.row = block_hash, data, None, 0

    def array(self) -> np.ndarray:
        if self.data is None:  # a copy: the batch (and its padding rows) is freed once every row is read
            self.data = self.transfer.result()[self.row].copy()
            self.transfer = None
        return self.data


@jax.jit
def _gather(kv: Any, blocks: jax.Array) -> jax.Array:
    """``[n, leaves, block_size, *page]``: every cache leaf's rows ``blocks [n]``, stacked per block."""
    return jnp.stack([leaf[blocks] for leaf in jax.tree.leaves(kv)], axis=1)


@functools.partial(jax.jit, donate_argnames="kv")
def _scatter(kv: Any, blocks: jax.Array, data: jax.Array) -> Any:
    """``kv`` with every leaf's rows ``blocks`` set to ``data[:, leaf]``; out-of-range (padding) blocks dropped."""
    leaves, tree = jax.tree.flatten(kv)
    return jax.tree.unflatten(tree, [leaf.at[blocks].set(data[:, i].astype(leaf.dtype), mode="drop")
                                     for i, leaf in enumerate(leaves)])


def _bucket(n: int) -> int:
    """Batched copies are padded to a power of two (one compile per size class)."""
    return 1 << max(n - 1, 0).bit_length()


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
    """

    def __init__(self, kv: Any, host_blocks: int, disk_dir: str | Path | None = None, fingerprint: str = "",
                 disk_blocks: int | None = None):
        if host_blocks < 1:
            raise ValueError(f"KVTiers: host_blocks={host_blocks}: expected >= 1")
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
        self._transfers: list[tuple[_Transfer, list[_Entry]]] = []  # started, not yet read in

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
        self._put(block_hash, entry)

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
        entry = _Entry(block_hash, data)
        self._put(block_hash, entry)
        return entry

    def load(self, block: int, entry: _Entry) -> None:
        """Fill the freshly allocated GPU ``block`` with ``entry``'s pages at the next ``apply``."""
        self._loads[block] = entry

    def apply(self, kv: Any) -> Any:
        """Issue the queued copies against ``kv`` (the cache the next step reads) and return the cache to use:
        one gather of the saved blocks (its host copy started, not waited for), then one scatter of the loaded
        ones (``kv`` donated). Reads finished host copies into host memory (and writes them to disk)."""
        start = time.perf_counter()
        self._collect(wait=False)
        if self._saves:
            blocks = np.full(_bucket(len(self._saves)), 0, np.int32)
            blocks[:len(self._saves)] = [b for b, _ in self._saves]
            transfer = _Transfer(_gather(kv, blocks))
            for row, (_, entry) in enumerate(self._saves):
                entry.transfer, entry.row = transfer, row
            self._transfers.append((transfer, [e for _, e in self._saves]))
            self.stats.saved_blocks += len(self._saves)
            self.stats.device_to_host_bytes += len(self._saves) * self.block_bytes
            self._saves = []
        if self._loads:
            blocks = np.full(_bucket(len(self._loads)), self.num_blocks, np.int32)  # padding: out of range
            blocks[:len(self._loads)] = list(self._loads)
            data = np.zeros((len(blocks), *self.block_shape), self.dtype)
            for row, entry in enumerate(self._loads.values()):
                data[row] = entry.array()
            kv = _scatter(kv, blocks, data)
            self.stats.host_to_device_bytes += len(self._loads) * self.block_bytes
            self._loads = {}
        self.stats.copy_seconds += time.perf_counter() - start
        return kv

    def warm_up(self, kv: Any) -> Any:
        """Run the gather and the scatter once at every batch size ``apply`` can pad to (powers of two up to the
        GPU's blocks; the scatter's up to the host tier's too), with no effect: the gather's result is dropped and
        every scattered block is out of range. Returns the cache to use (the scatter donates it)."""
        for n in (1 << i for i in range(math.ceil(math.log2(self.num_blocks)) + 1)):
            jax.block_until_ready(_gather(kv, np.zeros(n, np.int32)))
            if n <= _bucket(min(self.num_blocks, self.host_blocks)):
                kv = _scatter(kv, np.full(n, self.num_blocks, np.int32), np.zeros((n, *self.block_shape), self.dtype))
        return kv

    def drain(self) -> None:
        """Wait for every started host copy and read it in (and to disk): for a clean shutdown or a test."""
        start = time.perf_counter()
        self._collect(wait=True)
        self.stats.copy_seconds += time.perf_counter() - start

    def reset(self) -> None:
        """Forget queued copies (the cache they named is gone); what the host and disk hold stays valid, except
        entries whose gather never ran."""
        for _, entry in self._saves:
            if self._host.get(entry.block_hash) is entry:
                del self._host[entry.block_hash]
        self._saves, self._loads = [], {}

    def _put(self, block_hash: BlockHash, entry: _Entry) -> None:
        self._host[block_hash] = entry
        self._host.move_to_end(block_hash)
        while len(self._host) > self.host_blocks:
            old_hash, old = self._host.popitem(last=False)
            if self.disk is not None and old_hash not in self.disk and not self._queued(old):
                self.disk.write(old_hash, old.array())

    def _queued(self, entry: _Entry) -> bool:
        """Whether ``entry``'s gather has not been issued yet (its data does not exist anywhere but the GPU)."""
        return entry.data is None and entry.transfer is None

    def _collect(self, wait: bool) -> None:
        """Read in the started host copies that are ready (``wait``: all), writing their blocks to disk."""
        keep = []
        for transfer, entries in self._transfers:
            if not (wait or transfer.ready()):
                keep.append((transfer, entries))
                continue
            for entry in entries:
                data = entry.array()
                if self.disk is not None:
                    self.disk.write(entry.block_hash, data)
        self._transfers = keep
