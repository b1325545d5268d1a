"""The host-side block allocator: allocation, reference counts, prefix caching, LRU eviction, salts."""

import numpy as np
import pytest

from serving.engine.blocks import BlockAllocator, NoFreeBlocks, hash_blocks

BLOCK = 4


def check_invariants(alloc: BlockAllocator) -> None:
    """Counts never negative; free blocks are exactly the count-0 ones, each listed once."""
    assert min(alloc.refcount) >= 0
    free = list(alloc._uncached) + list(alloc._cached)
    assert len(free) == len(set(free)) == alloc.num_free
    assert set(free) == {b for b, c in enumerate(alloc.refcount) if c == 0}
    assert {b: h for h, b in alloc._by_hash.items()} == alloc._hash_of


def test_hashes_chain_over_the_prefix_and_only_full_blocks():
    a = hash_blocks(list(range(10)), BLOCK)
    assert len(a) == 2  # the 2 trailing tokens are not a full block
    b = hash_blocks([99] + list(range(1, 10)), BLOCK)
    assert a[0] != b[0] and a[1] != b[1]  # block 1 holds the same tokens but follows another prefix
    assert hash_blocks(list(range(8)), BLOCK) == a
    assert hash_blocks(list(range(10)), BLOCK, num_blocks=1) == a[:1]


def test_allocate_free_and_exhaustion():
    alloc = BlockAllocator(3, BLOCK)
    blocks = [alloc.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and alloc.num_free == 0
    with pytest.raises(NoFreeBlocks):
        alloc.allocate()
    alloc.free(blocks[1])
    assert alloc.allocate() == blocks[1]


def test_double_free_and_out_of_range_are_errors():
    alloc = BlockAllocator(2, BLOCK)
    block = alloc.allocate()
    alloc.free(block)
    with pytest.raises(ValueError, match="not in use"):
        alloc.free(block)
    with pytest.raises(ValueError, match="outside"):
        alloc.fork(5)
    assert alloc.refcount == [0, 0]


def test_fork_shares_until_the_last_reference_is_freed():
    alloc = BlockAllocator(2, BLOCK)
    block = alloc.fork(alloc.allocate())
    assert alloc.refcount[block] == 2
    alloc.free(block)
    assert alloc.num_free == 1  # still held by the other sequence
    alloc.free(block)
    assert alloc.num_free == 2


def test_prefix_reuse_takes_cached_blocks_even_after_free():
    alloc = BlockAllocator(4, BLOCK)
    tokens = list(range(12))
    hashes = hash_blocks(tokens, BLOCK)
    first = [alloc.allocate() for _ in hashes]
    for block, h in zip(first, hashes, strict=True):
        alloc.register(block, h)
    assert alloc.cached_prefix(hashes) == first  # live sharing
    assert all(alloc.refcount[b] == 2 for b in first)
    for block in first * 2:
        alloc.free(block)
    assert alloc.num_free == 4
    other = hash_blocks(tokens[:8] + [7, 7, 7, 7], BLOCK)
    assert alloc.cached_prefix(other) == first[:2]  # the longest cached prefix only
    check_invariants(alloc)


def test_eviction_uses_uncached_blocks_first_then_least_recently_freed():
    alloc = BlockAllocator(4, BLOCK)
    hashes = hash_blocks(list(range(12)), BLOCK)
    blocks = [alloc.allocate() for _ in hashes]
    for block, h in zip(blocks, hashes, strict=True):
        alloc.register(block, h)
    for block in (blocks[2], blocks[0], blocks[1]):  # freed in this order: blocks[2] is least recent
        alloc.free(block)
    assert alloc.allocate() == 3  # the never-cached block goes first
    assert alloc.allocate() == blocks[2]
    assert not alloc.is_cached(blocks[2])
    assert alloc.cached_prefix(hashes) == blocks[:2]  # the prefix before the evicted block still hits
    check_invariants(alloc)


def test_salt_isolates_identical_prefixes():
    alloc = BlockAllocator(2, BLOCK)
    tokens = list(range(4))
    block = alloc.allocate()
    alloc.register(block, hash_blocks(tokens, BLOCK, salt="tenant-a")[0])
    assert alloc.cached_prefix(hash_blocks(tokens, BLOCK, salt="tenant-b")) == []
    assert alloc.cached_prefix(hash_blocks(tokens, BLOCK)) == []
    assert alloc.cached_prefix(hash_blocks(tokens, BLOCK, salt="tenant-a")) == [block]


def test_randomized_alloc_free_stress_keeps_invariants():
    rng = np.random.default_rng(0)
    alloc = BlockAllocator(16, BLOCK)
    owners: list[list[int]] = []  # each "sequence" holds a list of block references
    for _ in range(3000):
        action = rng.integers(4)
        if action == 0 and alloc.num_free:
            block = alloc.allocate()
            assert all(block not in blocks for blocks in owners)  # never hand out a block in use
            owners.append([block])
            if rng.random() < 0.5:
                alloc.register(block, hash_blocks([int(rng.integers(5))] * BLOCK, BLOCK)[0])
        elif action == 1 and owners:
            blocks = owners.pop(int(rng.integers(len(owners))))
            for block in blocks:
                alloc.free(block)
        elif action == 2 and owners:
            owners.append([alloc.fork(b) for b in owners[int(rng.integers(len(owners)))]])
        elif action == 3:
            owners.append(alloc.cached_prefix(hash_blocks([int(rng.integers(5))] * BLOCK, BLOCK)))
        counts = np.bincount([b for blocks in owners for b in blocks], minlength=16)
        assert list(counts) == alloc.refcount
        check_invariants(alloc)
