"""The prefix cache's host and disk tiers (``serving.engine.kv_tiers``): evicted blocks come back bitwise, salts
keep tenants apart in every tier, a corrupt or truncated disk block is recomputed, and a new engine reuses the
disk tier."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF

from benchmarks.harness import compile_events
from serving import Engine, SamplingParams, sharding
from serving.engine.blocks import BlockAllocator, hash_blocks
from serving.engine.kv_tiers import COPIES, SUFFIX, KVTiers
from serving.kv_cache import PagedKV

BLOCK = 4
SMALL = 16  # GPU blocks of the tiered engines: prompt B evicts most of prompt A's blocks
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
rng = np.random.default_rng(0)
PROMPT_A = rng.integers(3, 320, 26).tolist()
PROMPT_B = rng.integers(3, 320, 52).tolist()


def engine(name: str = "llama", num_blocks: int = SMALL, **kwargs) -> Engine:
    options = dict(dtype=jnp.float32, num_blocks=num_blocks, block_size=BLOCK, max_running=4, token_budget=64,
                   decode_steps=1) | kwargs
    return Engine(HF / name, **options)


def run(eng: Engine, prompt: list[int], salt: str | None = None):
    """(greedy tokens, their logprob entries, prompt tokens the cache supplied) of ``prompt`` alone."""
    request = eng.add_request(prompt, PARAMS, cache_salt=salt)
    while eng.has_unfinished():
        eng.step()
    result = eng.release(request)
    return result.outputs[0].token_ids, result.outputs[0].logprobs, result.num_cached_tokens


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def gpu_cached(request):
    """Prompt A's third run on an engine whose GPU cache keeps all of A: (family, its run)."""
    eng = engine(request.param, num_blocks=64)
    for prompt in (PROMPT_A, PROMPT_B):
        run(eng, prompt)
    return request.param, run(eng, PROMPT_A)


def test_restored_blocks_give_bitwise_the_logits_of_gpu_cached_ones(gpu_cached):
    name, reference = gpu_cached
    eng = engine(name, host_cache_blocks=64)
    first = run(eng, PROMPT_A)
    run(eng, PROMPT_B)  # evicts A's blocks from the GPU: they go to the host
    assert eng.tier_stats.saved_blocks > 0
    again = run(eng, PROMPT_A)
    assert eng.tier_stats.host_hits > 0
    assert again[2] == reference[2] == (len(PROMPT_A) - 1) // BLOCK * BLOCK  # every full prompt block reused
    assert again == reference  # tokens and logprobs bitwise
    assert again[0] == first[0]
    without = engine(name)  # GPU tier only: A is recomputed
    for prompt in (PROMPT_A, PROMPT_B):
        run(without, prompt)
    recomputed = run(without, PROMPT_A)
    assert recomputed[2] < again[2] and recomputed[0] == again[0]


def test_salts_isolate_tenants_across_tiers():
    eng = engine(host_cache_blocks=64)
    run(eng, PROMPT_A, salt="tenant-1")
    run(eng, PROMPT_B, salt="tenant-1")
    assert run(eng, PROMPT_A, salt="tenant-2")[2] == 0  # the host holds A's blocks, under tenant-1's hashes
    assert eng.tier_stats.host_hits == 0
    assert run(eng, PROMPT_A, salt="tenant-1")[2] > 0


def _disk_engine(folder, **kwargs) -> Engine:
    return engine(host_cache_blocks=64, disk_cache_dir=folder, **kwargs)


@pytest.mark.parametrize("gpu_cached", ["llama"], indirect=True)  # one family is enough for the disk tier
def test_disk_tier_is_reused_by_a_new_engine_and_corrupt_blocks_are_recomputed(tmp_path, gpu_cached):
    _, reference = gpu_cached
    first = _disk_engine(tmp_path)
    run(first, PROMPT_A)
    run(first, PROMPT_B)
    first.tiers.drain()  # every started host copy read in and written through
    evicted = {p.stem for p in first.tiers.disk.folder.glob("*" + SUFFIX)}
    assert len(evicted) == first.tier_stats.saved_blocks > 0
    on_gpu = {h.hex() for _, h in first.allocator.registered()}
    assert first.persist_cache() == len(on_gpu) > 0  # the blocks still on the GPU too
    files = sorted(first.tiers.disk.folder.glob("*" + SUFFIX))
    assert {p.stem for p in files} == evicted | on_gpu

    restarted = _disk_engine(tmp_path)  # a new engine over the same folder and model
    assert len(restarted.tiers.disk) == len(files)
    again = run(restarted, PROMPT_A)
    assert restarted.tier_stats.disk_hits > 0 and restarted.tier_stats.disk_corrupt == 0
    assert again == reference

    # A's blocks on disk, in prefix order: corrupt one byte of the first's payload, truncate the second
    hashes = hash_blocks(PROMPT_A, BLOCK)
    paths = [restarted.tiers.disk.folder / (h.hex() + SUFFIX) for h in hashes]
    on_disk = [p for p in paths if p.exists()]
    assert len(on_disk) >= 2
    raw = bytearray(on_disk[0].read_bytes())
    raw[-1] ^= 0x01
    on_disk[0].write_bytes(bytes(raw))
    on_disk[1].write_bytes(on_disk[1].read_bytes()[:-7])
    third = _disk_engine(tmp_path)
    recomputed = run(third, PROMPT_A)
    assert third.tier_stats.disk_corrupt == 1  # the lookup stops at the first bad block; it is deleted
    assert not on_disk[0].exists()
    assert recomputed[0] == reference[0] and recomputed[2] < reference[2]
    assert third.tiers.disk.read(hashes[paths.index(on_disk[1])]) is None  # truncated: detected, deleted
    assert third.tier_stats.disk_corrupt == 2 and not on_disk[1].exists()


def test_a_different_model_does_not_read_the_disk_tier(tmp_path):
    first = _disk_engine(tmp_path)
    run(first, PROMPT_A)
    run(first, PROMPT_B)
    first.tiers.drain()
    other = Engine(HF / "llama", dtype=jnp.float32, num_blocks=SMALL, block_size=2 * BLOCK, max_running=4,
                   token_budget=64, decode_steps=1, host_cache_blocks=64, disk_cache_dir=tmp_path)
    assert other.tiers.disk.folder != first.tiers.disk.folder and len(other.tiers.disk) == 0


# ----------------------------------------------------------------------------------------- the tiers alone


def _cache(num_blocks: int = 8) -> PagedKV:
    keys = jax.random.split(jax.random.key(1), 4)
    shape = (num_blocks, BLOCK, 2, 3)
    return PagedKV(*((jax.random.normal(keys[i], shape), jax.random.normal(keys[i + 2], shape)) for i in (0, 1)))


def _block(kv: PagedKV, block: int) -> np.ndarray:
    return np.stack([np.asarray(leaf[block]) for leaf in jax.tree.leaves(kv)])


@pytest.mark.parametrize("copies", COPIES)
def test_saved_blocks_load_back_bitwise_in_any_window_order(copies):
    kv = _cache()
    tiers = KVTiers(kv, host_blocks=8, copies=copies)
    original = {b: _block(kv, b) for b in range(8)}
    tiers.save(2, b"two")
    tiers.save(3, b"three")
    tiers.load(2, tiers.lookup(b"three"))  # 2 is saved, then overwritten with 3's pages in the same window
    kv = tiers.apply(kv)
    np.testing.assert_array_equal(_block(kv, 2), original[3])
    tiers.load(5, tiers.lookup(b"two"))
    tiers.save(5, b"two")  # loaded, then evicted again before any step: saved from the data being loaded
    tiers.load(5, tiers.lookup(b"three"))
    kv = tiers.apply(kv)
    tiers.drain()
    np.testing.assert_array_equal(_block(kv, 5), original[3])
    np.testing.assert_array_equal(tiers.lookup(b"two").array(), original[2])
    for b in (0, 1, 4, 6, 7):
        np.testing.assert_array_equal(_block(kv, b), original[b])
    assert tiers.stats.saved_blocks == 2 and tiers.stats.host_hits == 4


@pytest.mark.parametrize("copies", COPIES)
def test_host_tier_is_lru_and_drops_to_disk(tmp_path, copies):
    kv = _cache()
    tiers = KVTiers(kv, host_blocks=2, disk_dir=tmp_path, fingerprint="f", copies=copies)
    tiers.save(0, b"a")
    tiers.save(1, b"b")
    tiers.lookup(b"a")  # a is now the most recent: b goes first
    tiers.save(2, b"c")
    tiers.apply(kv)
    tiers.drain()  # every saved block is written through to disk, b too
    assert tiers.num_host == 2 and len(tiers.disk) == 3
    np.testing.assert_array_equal(tiers.lookup(b"b").array(), _block(kv, 1))  # read back from disk
    assert tiers.stats.disk_hits == 1


@pytest.mark.parametrize("copies", COPIES)
def test_saves_go_to_pinned_host_memory_in_power_of_two_batches_and_memory_stays_within_host_blocks(copies):
    """Seven saves make batches of 4, 2 and 1 rows (blocks 0-3, 4-5, 6) in pinned host memory. The tier's memory
    counts a batch until its last entry leaves, so an eighth save past ``host_blocks`` drops the oldest entries
    until a batch is freed: 1, 2 and 3 (block 0, used since, keeps the first batch), then 4 and 5. What is left
    loads back bitwise."""
    kv = _cache()
    tiers = KVTiers(kv, host_blocks=7, copies=copies)
    original = {b: _block(kv, b) for b in range(8)}
    for b in range(7):
        tiers.save(b, bytes([b]))
    kv = tiers.apply(kv)
    batches = {id(e.batch): e.batch for e in tiers._host.values()}.values()
    assert sorted(len(b.entries) for b in batches) == [1, 2, 4]
    assert {b.array.sharding.memory_kind for b in batches} == {"pinned_host"}
    tiers.lookup(bytes([0]))
    tiers.save(7, bytes([7]))
    assert list(tiers._host) == [bytes([6]), bytes([0]), bytes([7])]
    kept = (6, 0, 7)
    for i, b in enumerate(kept):
        tiers.load(i, tiers.lookup(bytes([b])))
    kv = tiers.apply(kv)
    for i, b in enumerate(kept):
        np.testing.assert_array_equal(_block(kv, i), original[b])


def test_max_batch_bounds_the_host_batches_and_loads_count_the_whole_batches_they_move():
    kv = _cache()
    tiers = KVTiers(kv, host_blocks=8, max_batch=2)
    original = {b: _block(kv, b) for b in range(8)}
    for b in range(7):
        tiers.save(b, bytes([b]))
    kv = tiers.apply(kv)
    batches = {id(e.batch): e.batch for e in tiers._host.values()}.values()
    assert sorted(len(b.entries) for b in batches) == [1, 2, 2, 2]
    tiers.load(7, tiers.lookup(bytes([3])))  # one row of a two-row batch: the whole batch moves
    tiers.load(6, tiers.lookup(bytes([6])))  # the one-row batch
    kv = tiers.apply(kv)
    np.testing.assert_array_equal(_block(kv, 7), original[3])
    np.testing.assert_array_equal(_block(kv, 6), original[6])
    stats = tiers.stats
    assert (stats.loaded_blocks, stats.load_batches) == (2, 2)
    assert stats.host_to_device_bytes == 3 * tiers.block_bytes and stats.device_to_host_bytes == 7 * tiers.block_bytes
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"max_batch={bad}: expected a power of two"):
            KVTiers(kv, host_blocks=8, max_batch=bad)
    with pytest.raises(ValueError, match=r"copies='dma': expected one of \('put', 'program'\)"):
        KVTiers(kv, host_blocks=8, copies="dma")


@pytest.mark.parametrize("copies", COPIES)
def test_after_the_tiers_warm_up_saves_and_loads_compile_nothing(tmp_path, copies):
    """Every batch size's gather, host round trip and scatter (and a disk block's scatter) compiled by ``warm_up``,
    in either way of copying."""
    kv = _cache()
    tiers = KVTiers(kv, host_blocks=8, disk_dir=tmp_path, fingerprint="f", copies=copies)
    kv = tiers.warm_up(kv)
    original = {b: _block(kv, b) for b in range(8)}
    with compile_events() as events:
        for b in range(7):
            tiers.save(b, bytes([b]))
        kv = tiers.apply(kv)
        tiers.drain()
        fresh = KVTiers(kv, host_blocks=8, disk_dir=tmp_path, fingerprint="f", copies=copies)
        for block, saved in ((7, 2), (6, 5)):
            tiers.load(block, tiers.lookup(bytes([saved])))
        kv = tiers.apply(kv)
        fresh.load(0, fresh.lookup(bytes([4])))  # read from disk: numpy pages
        kv = fresh.apply(kv)
    assert events == []
    for block, saved in ((7, 2), (6, 5), (0, 4)):
        np.testing.assert_array_equal(_block(kv, block), original[saved])


@pytest.mark.parametrize("copies", COPIES)
def test_copies_take_the_cache_as_a_compiled_step_leaves_it(copies, monkeypatch):
    """A step's compiled executable returns the cache's leaves uncommitted. The copies take them so: no
    ``device_put`` of each leaf before a copy (host time per leaf, per copy), nothing compiled after warm-up, and
    the pages round-trip."""
    kv = _cache()
    tiers = KVTiers(kv, host_blocks=8, copies=copies)
    step = jax.jit(lambda kv: jax.tree.map(lambda leaf: leaf * 1, kv)).lower(kv).compile()
    kv = step(tiers.warm_up(kv))
    assert not any(leaf.committed for leaf in jax.tree.leaves(kv))
    original = _block(kv, 1)
    puts, device_put = [], jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *args, **kwargs: puts.append(x) or device_put(x, *args, **kwargs))
    with compile_events() as events:
        tiers.save(1, b"one")
        kv = step(tiers.apply(kv))
        tiers.load(3, tiers.lookup(b"one"))
        kv = tiers.apply(kv)
    assert events == []
    assert len(puts) == (2 if copies == "put" else 0)  # the host batch out and back in; none of the cache's leaves
    np.testing.assert_array_equal(_block(kv, 3), original)


def test_allocator_restores_a_prefix_from_the_host():
    kv = _cache()
    tiers = KVTiers(kv, host_blocks=8)
    allocator = BlockAllocator(8, BLOCK, tiers)
    blocks = [allocator.allocate() for _ in range(8)]
    for i, b in enumerate(blocks):
        allocator.register(b, bytes([i]))
    for b in reversed(blocks):
        allocator.free(b)
    original = _block(kv, blocks[0])
    taken = [allocator.allocate() for _ in range(8)]  # evicts all eight: saved
    kv = tiers.apply(kv)
    for b in taken:
        allocator.free(b)
    prefix = allocator.cached_prefix([bytes([0]), bytes([1]), b"missing"])
    assert len(prefix) == 2 and tiers.stats.host_hits == 2
    kv = tiers.apply(kv)
    np.testing.assert_array_equal(_block(kv, prefix[0]), original)
    with pytest.raises(ValueError, match="host_blocks=0"):
        KVTiers(kv, host_blocks=0)


def test_reset_forgets_queued_copies_and_keeps_what_the_host_holds():
    kv = _cache()
    tiers = KVTiers(kv, host_blocks=8)
    tiers.save(0, b"a")
    kv = tiers.apply(kv)
    tiers.save(1, b"b")  # queued: its gather never runs
    tiers.load(2, tiers.lookup(b"a"))
    tiers.reset()
    assert tiers.lookup(b"b") is None and tiers.lookup(b"a") is not None
    assert tiers.apply(kv) is kv  # nothing queued


@pytest.mark.parametrize("options, match", [
    (dict(host_cache_blocks=8, host_cache_gb=1.0), "expected one"),
    (dict(disk_cache_dir="x"), "without a host tier"),
    (dict(host_cache_blocks=-1), "host_cache_blocks=-1"),
    (dict(host_cache_gb=1e-12), "holds no block"),
])
def test_bad_tier_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        engine(**options)
    with pytest.raises(ValueError, match="no cache tiers"):
        engine().persist_cache()


@pytest.mark.slow  # ~60 s on 2 shared cores: the mesh engine compiles its steps
@pytest.mark.needs_devices(2)
@pytest.mark.parametrize("gpu_cached", ["llama"], indirect=True)
def test_tiers_on_a_tensor_parallel_mesh_keep_the_cache_split_and_the_tokens(gpu_cached):
    name, reference = gpu_cached
    mesh = sharding.make_mesh(1, 2, 1, devices=jax.devices()[:2])
    eng = engine(name, host_cache_blocks=64, mesh=mesh)
    shardings = [leaf.sharding for leaf in jax.tree.leaves(eng.runner.kv)]
    for prompt in (PROMPT_A, PROMPT_B):
        run(eng, prompt)
    again = run(eng, PROMPT_A)
    assert eng.tier_stats.host_hits > 0 and again[2] == reference[2] and again[0] == reference[0]
    for leaf, before in zip(jax.tree.leaves(eng.runner.kv), shardings, strict=True):
        assert leaf.sharding.is_equivalent_to(before, leaf.ndim)  # gathers and scatters kept the cache split


def test_reset_prefix_cache_starts_cold_and_needs_an_idle_engine():
    eng = engine(num_blocks=64)
    run(eng, PROMPT_A)
    assert run(eng, PROMPT_A)[2] > 0
    eng.reset_prefix_cache()
    assert run(eng, PROMPT_A)[2] == 0
    eng.add_request(PROMPT_A, PARAMS)
    with pytest.raises(RuntimeError, match="unfinished requests"):
        eng.reset_prefix_cache()


def test_after_warm_up_evictions_and_restores_compile_nothing():
    eng = engine(host_cache_blocks=64, token_budget=16, compilation_cache=False)
    eng.warm_up()
    with compile_events() as events:
        for prompt in (PROMPT_A, PROMPT_B, PROMPT_A):
            run(eng, prompt)
    assert eng.tier_stats.host_hits > 0 and events == []
