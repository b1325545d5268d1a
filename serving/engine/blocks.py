"""Host-side allocator of paged-cache blocks, with reference counts and prefix caching.

Every block has a reference count (the sequences whose block table holds it). A block with count 0 is free.
Prefix caching: a FULL block of a sequence is named by a chained hash over everything before it,

    hash_i = SHA-256(hash_{i-1} || token ids of block i || salt)        (hash_{-1} = b"")

so equal hashes mean equal token prefixes (and equal salts: a per-request salt keeps tenants apart; a block holding
image placeholder tokens has its images' digests in its salt, as equal placeholders of other pixels hold other
k/v). Once a
full block's k/v are written it is registered under its hash; a later sequence with the same prefix takes
the block (count + 1) instead of recomputing it. A freed block keeps its hash and stays reusable until the
allocator needs it for new data: blocks that never held a registered hash go first, then cached blocks in
least-recently-freed order (LRU eviction), which drops their hash. A block with count > 0 is never handed out.

With ``tiers`` (``kv_tiers.KVTiers``), an evicted block's pages are saved to the host (and disk) tier under its
hash, and a prefix lookup that misses on the GPU continues there: each hit is loaded into a freshly allocated
block (registered under its hash), while free blocks last.
"""

import collections
import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from serving.engine.kv_tiers import BlockHash, KVTiers


def hash_block(previous: BlockHash, block_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    """``SHA-256(previous || token ids (int64) || salt)``: one link of the chain (``previous`` = b"" first)."""
    salt_bytes = b"" if salt is None else salt.encode()
    return hashlib.sha256(previous + np.asarray(block_ids, np.int64).tobytes() + salt_bytes).digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, salt: str | None | Callable[[int], str | None] = None,
                num_blocks: int | None = None) -> list[BlockHash]:
    """Chained hashes of the first ``num_blocks`` (default: all) full blocks of ``token_ids``; ``salt``: one for
    every block, or block i's as ``salt(i)``."""
    full = len(token_ids) // block_size
    count = full if num_blocks is None else min(num_blocks, full)
    hashes, previous = [], b""
    for i in range(count):
        previous = hash_block(previous, token_ids[i * block_size:(i + 1) * block_size],
                              salt(i) if callable(salt) else salt)
        hashes.append(previous)
    return hashes


class NoFreeBlocks(RuntimeError):
    """Raised by ``allocate`` when every block is in use (the scheduler checks ``num_free`` first)."""


class BlockAllocator:
    """Blocks ``0 .. num_blocks - 1`` of ``block_size`` tokens: allocate, free, fork, and prefix-cache lookup."""

    def __init__(self, num_blocks: int, block_size: int, tiers: KVTiers | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockAllocator: num_blocks={num_blocks}, block_size={block_size}: expected >= 1 each")
        self.num_blocks, self.block_size, self.tiers = num_blocks, block_size, tiers
        self.refcount = [0] * num_blocks
        self._uncached = collections.deque(range(num_blocks))  # free blocks holding no registered hash
        self._cached = collections.OrderedDict()  # free blocks with a hash, least recently freed first
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now (cached free blocks included: they are evicted on demand)."""
        return len(self._uncached) + len(self._cached)

    def allocate(self) -> int:
        """A block for new data (count 1): an uncached free block, else the least recently freed cached one."""
        if self._uncached:
            block = self._uncached.popleft()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            block_hash = self._hash_of.pop(block)
            del self._by_hash[block_hash]  # evicted: its old contents are about to be overwritten
            if self.tiers is not None:
                self.tiers.save(block, block_hash)
        else:
            raise NoFreeBlocks(f"all {self.num_blocks} blocks are in use")
        self.refcount[block] = 1
        return block

    def fork(self, block: int) -> int:
        """Share an in-use ``block`` with one more sequence (count + 1); returns it."""
        self._check_in_use(block, "fork")
        self.refcount[block] += 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference; at 0 the block is free (and, if registered, stays cached for reuse)."""
        self._check_in_use(block, "free")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._uncached.append(block)

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Name the full, computed, in-use ``block`` by ``block_hash`` (a no-op if the hash already has a block)."""
        self._check_in_use(block, "register")
        if block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Take the blocks of the longest prefix of ``hashes`` that is cached (count + 1 each); returns them. A
        hash cached in the tiers only is loaded into a new block while one is free."""
        blocks = []
        for block_hash in hashes:
            block = self._by_hash.get(block_hash)
            if block is None:
                block = self._restore(block_hash)
                if block is None:
                    break
                blocks.append(block)
                continue
            if self.tiers is not None:
                self.tiers.stats.gpu_hits += 1
            if self.refcount[block] == 0:
                del self._cached[block]
            self.refcount[block] += 1
            blocks.append(block)
        return blocks

    def _restore(self, block_hash: BlockHash) -> int | None:
        """A new block (count 1) registered under ``block_hash`` and loaded from the tiers, or None (no tiers, no
        free block, or a miss)."""
        if self.tiers is None or self.num_free == 0:
            return None
        entry = self.tiers.lookup(block_hash)
        if entry is None:
            return None
        block = self.allocate()
        self.register(block, block_hash)
        self.tiers.load(block, entry)
        return block

    def registered(self) -> list[tuple[int, BlockHash]]:
        """Every (block, hash) the prefix cache names now, in use or free."""
        return list(self._hash_of.items())

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def _check_in_use(self, block: int, action: str) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"{action}: block {block} is outside [0, {self.num_blocks})")
        if self.refcount[block] <= 0:
            raise ValueError(f"{action}: block {block} is not in use (reference count {self.refcount[block]})")
