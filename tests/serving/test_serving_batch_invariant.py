"""serving.batch_invariant: with batch_invariant on, a prompt's logits at every position are BITWISE the same alone
and in batches of 1, 7 and 32 mixed requests, whatever chunks its prefill is cut into (bf16 fixtures; on a CPU
the same kernels run in Pallas' interpreter, on a GPU compiled). Also: no matmul or float sum is left outside
the fixed-geometry kernels, attention does not depend on the table width or the batch, the comparison is
bitwise and a split reduction does change the bits (the control), the errors, the H200 lowering of a
benchmark layer, and the benchmark's overhead column."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF
from helpers.hf import BF16_RTOL, BLOCK, empty_cache, fixture, fixture_params
from jax.extend.core import Jaxpr

from benchmarks import serving_decode
from pallas_kernels.matmul import MatmulConfig, matmul
from pallas_kernels.testing import assert_close, interpret, lower_for_h200
from serving import Engine, SamplingParams, layers
from serving import __main__ as serving_main
from serving.api import cli
from serving.batch_invariant import invariant
from serving.config import ModelConfig
from serving.engine.sampler import SampleRow, sample, sampling_batch
from serving.kv_cache import PagedKV, SeqChunk, make_batch
from serving.models import model_module
from serving.quantization import quantize_params
from serving.spec_decode import SpecConfig

FAMILIES = ("llama", "qwen3_moe", "mixtral", "deepseek_v3")
DTYPE = jnp.bfloat16


def bits(x) -> np.ndarray:
    """The raw bits of a float array: -0.0 and 0.0 differ, a NaN equals only the same NaN."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_bitwise_equal(actual, expected, what: str = "") -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual.shape, expected.shape)
    differ = bits(actual) != bits(expected)
    if differ.any():
        gap = np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max()
        raise AssertionError(f"{what}: {int(differ.sum())} of {differ.size} elements differ in their bits "
                             f"(largest difference {gap:.3g})")


# --------------------------------------------------------------------------- the control


def test_control_the_comparison_is_bitwise_and_a_split_reduction_changes_the_bits():
    """What the other tests could miss, they do not: one ulp, or the sign of a zero, fails the comparison; and the
    same rows summed along K in 4 splits (as a GEMM library may choose for a small M) differ from one K loop,
    while the fixed-geometry kernel gives a row the same bits whatever M."""
    x = np.linspace(-1, 1, 12, dtype=np.float32)
    with pytest.raises(AssertionError, match="1 of 12 elements differ"):
        assert_bitwise_equal(x, np.where(np.arange(12) == 5, np.nextafter(x, np.float32(2)), x), "one ulp")
    with pytest.raises(AssertionError, match="1 of 1 elements differ"):
        assert_bitwise_equal(np.float32([0.0]), np.float32([-0.0]), "signed zero")

    kx, kw = jax.random.split(jax.random.key(0))
    rows, w = jax.random.normal(kx, (16, 512)), jax.random.normal(kw, (512, 32))
    run = functools.partial(matmul, config=MatmulConfig(block_m=16, block_n=16, block_k=16), interpret=interpret())
    one_loop = run(rows, w)
    split_k = sum(run(rows[:, s:s + 128], w[s:s + 128]) for s in range(0, 512, 128))
    assert (bits(one_loop) != bits(split_k)).any()  # the same math, another order: other bits
    assert_bitwise_equal(run(rows[3:5], w), one_loop[3:5], "2 of 16 rows")


# --------------------------------------------------------------------------- what the rewrite leaves


def float_ops_outside_kernels(jaxpr: Jaxpr) -> list[str]:
    """Float matmuls and sums of ``jaxpr`` and its sub-jaxprs, not counting those inside Pallas kernels."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        floats = any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars)
        if eqn.primitive.name in ("dot_general", "reduce_sum", "ragged_dot_general") and floats:
            found.append(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if isinstance(sub, Jaxpr):
                    found += float_ops_outside_kernels(sub)
    return found


def step_inputs(name: str, chunks: list[SeqChunk], **sizes):
    cfg = fixture(name)[0]
    batch = make_batch(chunks, BLOCK, **sizes)
    return fixture_params(name, DTYPE), np.zeros(len(batch.positions), np.int32), batch, empty_cache(cfg, DTYPE)


def model_step(name: str, kernels: layers.KernelPolicy = layers.BATCH_INVARIANT):
    """The fixture's forward with its layers run as ``kernels`` says (default: batch-invariant)."""
    cfg = fixture(name)[0]
    return lambda params, tokens, batch, kv: model_module(cfg.family).forward(params, cfg, tokens, batch, kv,
                                                                              kernels=kernels)


@pytest.mark.parametrize("name", FAMILIES)
def test_no_float_matmul_or_sum_is_left_outside_the_kernels(name):
    args = step_inputs(name, [SeqChunk([3, 4, 5], 0, 9), SeqChunk([7, 8], 5, 1)])
    assert float_ops_outside_kernels(jax.make_jaxpr(model_step(name, layers.REFERENCE))(*args)) != []  # has teeth
    assert float_ops_outside_kernels(jax.make_jaxpr(invariant(model_step(name)))(*args)) == []


def test_no_float_sum_is_left_in_the_sampler():
    rows = [SampleRow(SamplingParams(temperature=t, top_p=0.9, top_k=5, repetition_penalty=1.1), 7, 0, [3, 4], [5])
            for t in (0.0, 0.8)]
    logits = jnp.zeros((2, 320), jnp.float32)
    assert float_ops_outside_kernels(jax.make_jaxpr(functools.partial(sample, num_top=3))(
        logits, sampling_batch(rows))) != []
    assert float_ops_outside_kernels(jax.make_jaxpr(invariant(functools.partial(sample, num_top=3)))(
        logits, sampling_batch(rows))) == []


# --------------------------------------------------------------------------- attention


def test_attention_of_a_token_does_not_depend_on_the_table_width_or_the_batch(monkeypatch):
    """A token at position 100 attends over the cache in two splits (64-position spans here) whether the batch's
    tables are 32 or 64 blocks wide (2 or 4 splits) and whether it comes alone or last of a 5-token chunk beside
    another sequence's prefill; the results match the reference."""
    monkeypatch.setattr(layers, "INVARIANT_SPLIT_TOKENS", 64)
    heads, kv_heads, dim = 4, 2, 16
    keys = jax.random.split(jax.random.key(1), 4)
    k_pages, v_pages = (jax.random.normal(k, (80, BLOCK, kv_heads, dim)).astype(DTYPE) for k in keys[:2])
    table = list(range(40, 66))  # 26 blocks: 104 positions
    probe = jax.random.normal(keys[2], (heads, dim)).astype(DTYPE)
    attend = jax.jit(invariant(lambda q, k, v, batch: layers.paged_attention(q, k, v, batch, dim**-0.5,
                                                                             kernels=layers.BATCH_INVARIANT)))

    alone = make_batch([SeqChunk(table, 100, 1)], BLOCK, max_blocks=32)
    out_alone = attend(probe[None], k_pages, v_pages, alone)
    batch = make_batch([SeqChunk(list(range(10)), 0, 7), SeqChunk(table, 96, 5)], BLOCK, num_tokens=16,
                       max_blocks=64)
    q = jax.random.normal(keys[3], (16, heads, dim)).astype(DTYPE).at[11].set(probe)
    out = attend(q, k_pages, v_pages, batch)
    assert_bitwise_equal(out[11], out_alone[0], "position 100")
    assert_close(out[:12], layers.paged_attention_reference(q, k_pages, v_pages, batch, dim**-0.5)[:12],
                 rtol=BF16_RTOL)


# --------------------------------------------------------------------------- a model's logits, chunked and batched

PROBE, OTHERS = 0, (1, 2, 3)  # sequence ids of the schedules below
LENGTHS = {PROBE: 15, 1: 12, 2: 10, 3: 8}  # tokens each sequence runs (teacher-forced: no sampling)
ALONE = [[(PROBE, 0, 13)], [(PROBE, 13, 1)], [(PROBE, 14, 1)]]  # one prefill chunk, then two decode steps
ALONE_SIZES = dict(num_tokens=13, num_seqs=1, max_blocks=4)  # no other sequence; one shape, so one compile
# The probe's prefill in chunks of 4, 4 and 5 beside other sequences' prefill chunks and decode steps.
BATCHED = [[(1, 0, 9), (PROBE, 0, 4), (2, 0, 3)],
           [(2, 3, 5), (PROBE, 4, 4), (1, 9, 1)],
           [(1, 10, 1), (PROBE, 8, 5), (3, 0, 6), (2, 8, 1)],
           [(3, 6, 1), (2, 9, 1), (PROBE, 13, 1), (1, 11, 1)],
           [(PROBE, 14, 1), (3, 7, 1)]]
BATCHED_SIZES = dict(num_tokens=16, num_seqs=4, max_blocks=8)  # every batched step one padded shape
ALONE_TABLES = {PROBE: [0, 1, 2, 3]}
BATCHED_TABLES = {PROBE: [17, 3, 29, 8], 1: [5, 22, 11], 2: [30, 0, 14], 3: [9, 25]}  # the probe on other pages


@functools.cache
def jitted_step(name: str, batch_invariant: bool):
    return jax.jit(invariant(model_step(name)) if batch_invariant else model_step(name, layers.REFERENCE))


def run_schedule(name: str, schedule, tables, batch_invariant: bool = True, **sizes) -> dict:
    """Teacher-forced steps over the fixture ``name`` (bf16): {(sequence, position): logits [V]} of every token."""
    cfg = fixture(name)[0]
    tokens = {s: np.random.default_rng(s).integers(3, cfg.vocab, n) for s, n in LENGTHS.items()}
    params, kv = fixture_params(name, DTYPE), empty_cache(cfg, DTYPE)
    step = jitted_step(name, batch_invariant)
    logits_at = {}
    for chunks in schedule:
        batch = make_batch([SeqChunk(tables[s], start, count) for s, start, count in chunks], BLOCK, **sizes)
        ids = np.zeros(len(batch.positions), np.int32)
        flat = np.concatenate([tokens[s][start:start + count] for s, start, count in chunks])
        ids[:len(flat)] = flat
        logits, kv, _ = step(params, ids, batch, kv)
        logits, row = np.asarray(logits), 0
        for s, start, count in chunks:
            logits_at.update({(s, start + i): logits[row + i] for i in range(count)})
            row += count
    return logits_at


# qwen3_moe: GQA with q/k norms and routed experts, the benchmark models' family; deepseek_v3: MLA, shared experts
# and the grouped sigmoid router. (llama runs through the engine test below; mixtral adds nothing new here.)
@pytest.mark.parametrize("name", ["qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_logits_are_bitwise_equal_alone_and_chunked_in_a_batch(name):
    """The probe's logits at all 15 positions: one prefill chunk and two decode steps alone (13 tokens, 1 sequence,
    4 blocks) vs chunks of 4, 4 and 5 and two decodes beside three other sequences (16 tokens, 4 sequences, 8
    blocks), on other cache pages."""
    alone = run_schedule(name, ALONE, ALONE_TABLES, **ALONE_SIZES)
    batched = run_schedule(name, BATCHED, BATCHED_TABLES, **BATCHED_SIZES)
    for position in range(LENGTHS[PROBE]):
        assert_bitwise_equal(batched[PROBE, position], alone[PROBE, position], f"{name} position {position}")
    reference = run_schedule(name, ALONE, ALONE_TABLES, batch_invariant=False, **ALONE_SIZES)  # the model's logits
    positions = sorted(reference)
    assert_close(np.stack([alone[p] for p in positions]), np.stack([reference[p] for p in positions]), rtol=BF16_RTOL)


def test_control_without_batch_invariant_mode_the_batch_changes_the_bits():
    """The same schedules through the plain-jnp path (XLA's own matmuls, ragged_dot and sums; decode steps alone
    with one token, not padded to 13): the probe's logits in the batch do differ in their bits, so the test above
    would see it. (An observation of XLA:CPU, where it holds at the decode positions; on a GPU far more differs.)"""
    alone = run_schedule("qwen3_moe", ALONE, ALONE_TABLES, batch_invariant=False)
    batched = run_schedule("qwen3_moe", BATCHED, BATCHED_TABLES, batch_invariant=False, **BATCHED_SIZES)
    assert any((bits(batched[PROBE, p]) != bits(alone[PROBE, p])).any() for p in range(LENGTHS[PROBE]))


# --------------------------------------------------------------------------- the engine: alone and in 1, 7 and 32


class LogitsRecorder:
    """A model forward that also hands every step's logits to the host: ``logits[(prompt, position)]`` for every
    token any engine it is installed in computes (``install``), checked equal if computed twice."""

    def __init__(self, forward):
        self.forward, self.logits, self.prompts = forward, {}, []

    def __call__(self, params, cfg, tokens, batch, kv, kernels=layers.DEFAULT, rows=None):
        logits, kv, counts = self.forward(params, cfg, tokens, batch, kv, kernels=kernels)  # at every token
        jax.debug.callback(self.record, batch.seq_ids, batch.positions, logits)
        return logits if rows is None else logits[rows], kv, counts

    def record(self, seq_ids, positions, logits):
        for n in np.flatnonzero(np.asarray(seq_ids) >= 0):
            key = (self.prompts[seq_ids[n]], int(positions[n]))
            row = np.asarray(logits[n])
            if key in self.logits:
                assert_bitwise_equal(row, self.logits[key], f"{key} computed twice")
            self.logits[key] = row

    def install(self, engine: Engine) -> Engine:
        """Route ``engine``'s steps through this recorder (the sequences' prompts name their rows)."""
        dispatch = engine.runner.dispatch

        def recorded_dispatch(chunks, token_ids, rows, num_top=0, previous=None, images=None, targets=None):
            self.prompts = [tuple(r.prompt_ids) for r in rows]
            return dispatch(chunks, token_ids, rows, num_top, previous, images, targets)

        engine.runner.forward, engine.runner.dispatch = self, recorded_dispatch
        return engine


@pytest.mark.slow  # a few dozen batch shapes compile, each with the kernels in Pallas' interpreter
def test_engine_logits_are_bitwise_equal_alone_and_in_batches_of_1_7_32():
    """The probe prompt alone (one prefill chunk), alone under a 4-token budget (4 chunks), among 7 and among 32
    requests (prompts of 1-20 tokens, greedy and seeded sampling mixed, budgets that chunk prefill differently):
    its logits at every prompt and generated position, and its tokens, are bitwise the same; so are those of the
    6 requests the batches of 7 and 32 share."""
    rng = np.random.default_rng(0)
    probe = rng.integers(3, 320, 13).tolist()
    others = [rng.integers(3, 320, rng.integers(1, 21)).tolist() for _ in range(31)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    params = [greedy] + [greedy if i % 2 else SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, seed=i,
                                                             ignore_eos=True) for i in range(31)]
    recorder = LogitsRecorder(model_module("llama").forward)
    runs = {}
    for label, size, budget, running in (("alone", 1, 64, 32), ("1", 1, 4, 32), ("7", 7, 16, 8), ("32", 32, 48, 32)):
        engine = recorder.install(Engine(HF / "llama", dtype=DTYPE, num_blocks=160, block_size=BLOCK,
                                         max_running=running, token_budget=budget, batch_invariant=True))
        recorder.logits = {}
        results = engine.generate([probe, *others[:size - 1]], params[:size])
        runs[label] = {tuple(r.prompt_ids): r.outputs[0].token_ids for r in results}, recorder.logits
    tokens, logits = runs["alone"]
    assert len(logits) == 13 + 3  # every prompt position and the generated tokens but the last
    for label in ("1", "7", "32"):
        assert runs[label][0][tuple(probe)] == tokens[tuple(probe)], label
        for key, row in logits.items():
            assert_bitwise_equal(runs[label][1][key], row, f"batch {label}, position {key[1]}")
    shared = [tuple(p) for p in others[:6]]
    for prompt in shared:
        assert runs["7"][0][prompt] == runs["32"][0][prompt]
    for key, row in runs["7"][1].items():
        if key[0] in shared:
            assert_bitwise_equal(runs["32"][1][key], row, f"{key[1]} of a shared request")


# --------------------------------------------------------------------------- what batch-invariant mode refuses


def test_refuses_what_it_cannot_make_invariant():
    cfg = fixture("qwen3_moe")[0]
    params, tokens, batch, kv = step_inputs("qwen3_moe", [SeqChunk([3, 4], 0, 5)])
    quantized = quantize_params(params, "int8", cfg)
    with pytest.raises(ValueError, match=r"ragged_dot \(quantized expert weights\)"):
        jax.make_jaxpr(invariant(model_step("qwen3_moe")))(quantized, tokens, batch, kv)
    x = jnp.ones((4, 8), jnp.float16)
    with pytest.raises(ValueError, match="a matmul in float16: expected bfloat16 or float32"):
        jax.make_jaxpr(invariant(lambda a: a @ a.T))(x)
    with pytest.raises(ValueError, match="a sum in float16"):
        jax.make_jaxpr(invariant(lambda a: jax.lax.reduce(a, np.float16(0), jax.lax.add, (1,))))(x)  # jnp: fp32
    q, pages = jnp.ones((5, 2, 8), DTYPE), jnp.ones((4, BLOCK, 1, 8), DTYPE)  # head_dim 8: no kernel takes it
    with pytest.raises(ValueError, match=r"batch-invariant mode runs the Pallas kernels, which do not take "
                                         r"bfloat16\[5, 2, 8\]"):
        jax.make_jaxpr(invariant(lambda q, p, b: layers.paged_attention(q, p, p, b, 1.0,
                                                                         kernels=layers.BATCH_INVARIANT)))(
            q, pages, batch)


def test_cli_flag_makes_a_batch_invariant_engine():
    command = ["serve", "--model", str(HF / "llama"), "--num-blocks", "16"]
    for flags, expected in (([], False), (["--batch-invariant"], True)):
        engine, _, _ = cli._engine(serving_main.parser().parse_args(command + flags))
        assert engine.runner.batch_invariant is expected


# --------------------------------------------------------------------------- the GPU step and the benchmark


@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_a_benchmark_layer_lowers_for_an_h200_with_no_xla_matmul_left(case):
    """One Qwen3-30B-A3B layer at real width in batch-invariant mode (B=64 decode, a 2048-token prefill) lowers for
    an H200: every Triton module verifies, and the HLO has no dot left for cuBLAS or XLA to tile."""
    cfg = ModelConfig.from_hf(serving_decode.QWEN3_30B_A3B | dict(num_hidden_layers=1))
    module = model_module(cfg.family)
    context, blocks = 2048, 2048 // serving_decode.BLOCK_SIZE
    params = jax.eval_shape(lambda: module.init_params(cfg, jax.random.key(0), DTYPE))
    kv = jax.eval_shape(lambda: PagedKV.create(cfg, 64 * blocks, serving_decode.BLOCK_SIZE, DTYPE))
    tables = np.arange(64 * blocks).reshape(64, blocks).tolist()
    chunks = [SeqChunk(t, context - 1, 1) for t in tables] if case == "decode" else [SeqChunk(tables[0], 0, context)]
    batch = make_batch(chunks, serving_decode.BLOCK_SIZE)
    tokens = jax.ShapeDtypeStruct(batch.positions.shape, jnp.int32)
    step = invariant(lambda p, t, b, kv: module.forward(p, cfg, t, b, kv, kernels=layers.BATCH_INVARIANT))
    text = lower_for_h200(step, params, tokens, batch, kv)
    assert "stablehlo.dot_general" not in text
    assert all(kernel in text for kernel in ("matmul", "grouped_matmul", "paged_attention"))


@pytest.mark.slow  # two tiny-model subprocesses, one with the kernels in Pallas' interpreter
def test_benchmark_cpu_mode_runs_the_batch_invariant_engine(tmp_path):
    serving_decode.main(["--cpu", "--engines", "serving", "--batch-invariant", "--out-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "serving_decode_cpu.json").read_text())["rows"]
    invariant_rows = [r for r in rows if r["engine"] == "serving-bi"]
    assert [(r["case"], r["batch"]) for r in invariant_rows] == [("decode", 1), ("decode", 2), ("prefill", 1)]
    assert all(r["status"] == "ok" and r["overhead_vs_serving"] > 0 for r in invariant_rows)


def test_benchmark_overhead_is_the_step_time_over_the_serving_rows():
    rows = [dict(model="m", engine="serving", layers=2, case="decode", batch=8, step_ms=2.0, tokens_per_s=4000.0),
            dict(model="m", engine="serving-bi", layers=2, case="decode", batch=8, step_ms=3.0, tokens_per_s=2667.0),
            dict(model="m", engine="serving-bi", layers=2, case="prefill", batch=1, step_ms=9.0, tokens_per_s=7.0)]
    rows = serving_decode.add_speedups(rows)
    assert rows[1]["overhead_vs_serving"] == 1.5
    assert rows[2]["overhead_vs_serving"] is None  # no serving prefill row to compare with
    assert "overhead_vs_serving" not in rows[0]


@pytest.mark.slow  # verification shapes compile too, with the kernels in Pallas' interpreter
def test_speculative_greedy_tokens_equal_the_plain_batch_invariant_engines():
    """Verification passes are traced in kernel mode BATCH_INVARIANT as well, so a drafted position's logits are
    those a one-token step gives: greedy tokens with suffix drafting (drafts accepted) are the plain engine's."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 320, 10).tolist() * 2, rng.integers(3, 320, 7).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    options = dict(dtype=DTYPE, num_blocks=64, block_size=BLOCK, max_running=4, token_budget=32, batch_invariant=True)
    plain = Engine(HF / "llama", **options).generate(prompts, params)
    engine = Engine(HF / "llama", speculative=SpecConfig.from_method("suffix", k=4), **options)
    drafted = engine.generate(prompts, params)
    assert [r.outputs[0].token_ids for r in drafted] == [r.outputs[0].token_ids for r in plain]
    assert engine.spec_stats.num_accepted_tokens > 0
