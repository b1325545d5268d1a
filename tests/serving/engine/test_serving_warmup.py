"""``Engine.warm_up`` compiles every step shape the engine can meet, so a varied workload afterwards (prompt lengths
from one token to several chunks, one to max_running sequences, n > 1, greedy and sampled, logprobs, prompt
logprobs, multi-step decode, a constrained request) traces and compiles nothing; JAX's persistent compilation cache
then makes a restart compile nothing either."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers import HF, REPO
from helpers.server import model_folder

from benchmarks.harness import compile_events
from serving import layers, quantization
from serving import llm_engine as engine_module
from serving.engine import executables
from serving.engine.runner import BLOCKS_BUCKET_BASE, MIN_BLOCKS_BUCKET, StepShape, bucket, buckets
from serving.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from serving.llm_engine import Engine
from serving.spec_decode import SpecConfig
from serving.structured import ConstraintSpec


def test_buckets_are_every_value_bucket_takes():
    assert buckets(1, 8) == [8] and buckets(9, 8) == [8, 16] and buckets(64, 8) == [8, 16, 32, 64]
    assert buckets(5) == [1, 2, 4, 8]
    assert buckets(16, 16, 4) == [16] and buckets(17, 16, 4) == [16, 64] and buckets(256, 16, 4) == [16, 64, 256]
    assert [bucket(n, 16, 4) for n in (1, 16, 17, 64, 65)] == [16, 16, 64, 64, 256]
    with pytest.raises(ValueError, match="minimum 12 is not a power of two"):
        bucket(5, 12)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return model_folder(tmp_path_factory.mktemp("warmup"))


def test_only_decode_steps_are_paged_only(folder):
    """A kernel-tracing runner's shapes: every (N, W) of a step on the general path, and the decode steps' own
    (N up to the bucket of max_running = 4 tokens) traced paged-only; a reference runner traces nothing apart."""
    on_gpu = jax.default_backend() == "gpu"  # the default policy traces the kernels where there is a GPU
    for kernels, paged in ((layers.INTERPRET, True), (layers.REFERENCE, False), (layers.DEFAULT, on_gpu)):
        eng = Engine(folder, dtype="float32", num_blocks=64, block_size=4, max_running=4, token_budget=32,
                     max_model_len=256, compilation_cache=False, kernels=kernels)
        assert eng.runner.fixed_width == (64 if paged and kernels is layers.DEFAULT else None)
        widths = [64] if eng.runner.fixed_width else [16, 64]
        assert eng.runner.step_shapes(32) == [StepShape(n, 4, w, False) for n in (8, 16, 32) for w in widths]
        assert eng.runner.step_shapes(32, decode_only=True) == [
            StepShape(n, 4, w, paged) for n in buckets(4, eng.runner.min_decode_tokens) for w in widths]


def test_after_warm_up_a_varied_workload_compiles_nothing(folder):
    eng = Engine(folder, dtype="float32", num_blocks=32, block_size=4, max_running=4, token_budget=16,
                 max_model_len=64, decode_steps=2, compilation_cache=False)
    seen = []
    with compile_events() as events:
        done = eng.warm_up(lambda i, n: seen.append((i, n)))
    assert len(events) >= len(done)  # the listener sees them: each entry traced and compiled
    # On a GPU the kernels are traced: one table width (the widest) and decode steps paged-only (runner docstring).
    paged = layers.traces_kernels(eng.runner.kernels)
    widths = [eng.runner.fixed_width] if eng.runner.fixed_width else buckets(16, MIN_BLOCKS_BUCKET, BLOCKS_BUCKET_BASE)
    steps = [StepShape(n, 4, w, False) for n in (8, 16) for w in widths]
    samplers = [("sample", 4, top, draw, masked, biased) for top in (0, MAX_LOGPROBS) for draw in (False, True)
                for masked in (False, True) for biased in (False, True)]
    decode = [StepShape(n, 4, 16, paged) for n in buckets(4, eng.runner.min_decode_tokens)]  # to max_running
    decodes = [("decode", d, 2, top, draw) for d in decode for top in (0, MAX_LOGPROBS) for draw in (False, True)]
    scores = [s for s in steps if s.num_tokens == 16]  # every scoring step padded to the token budget's bucket
    assert done == [("step", s) for s in steps] + [("scores", s) for s in scores] + samplers \
        + [("step", d) for d in decode if d not in steps] + decodes
    assert seen == [(i + 1, len(done)) for i in range(len(done))]

    with compile_events() as events:
        texts = ["The quick brown fox jumps over the lazy dog", "Hi",
                 "Once upon a time", "a"]
        greedy = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
        eng.generate(texts, [greedy, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=3, n=2),
                             SamplingParams(temperature=0.0, max_tokens=7, logprobs=3, ignore_eos=True),
                             SamplingParams(temperature=1.0, max_tokens=11, logprobs=2, seed=1)])
        digits = ConstraintSpec.regex("[0-9]{4}")
        eng.generate(texts[2:3], SamplingParams(temperature=0.0, max_tokens=6, constraint=digits))
        eng.generate([texts[1]], greedy)
        eng.generate(texts[:2], [SamplingParams(temperature=0.0, max_tokens=5, logit_bias=((7, 5.0),)),
                                 SamplingParams(temperature=0.9, max_tokens=5, seed=4, logit_bias=((3, -100.0),) * 2)])
        scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)  # prompts scored in chunks
        eng.generate([texts[0], texts[2]], [scored, SamplingParams(temperature=0.0, max_tokens=3, logprobs=1)])
    assert events == []


def test_with_one_table_width_the_steps_are_one_per_n_and_the_tokens_unchanged(folder):
    """A runner with a ``fixed_width`` (where the paged kernels read by length: on a GPU) pads every block table to
    it: one shape per N, warm-up compiles only those, and a workload of short and long contexts then compiles
    nothing and samples the same tokens as the bucketed widths (the references mask the padding columns)."""
    def engine():
        return Engine(folder, dtype="float32", num_blocks=128, block_size=4, max_running=4, token_budget=16,
                      max_model_len=256, compilation_cache=False)

    texts = ["The quick brown fox jumps over the lazy dog " * 3, "Hi"]  # 132 tokens (W bucket 64) and 2 (16)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    want = engine().generate(texts, greedy)
    eng = engine()
    eng.runner.fixed_width = eng.runner.max_blocks
    assert eng.runner.max_blocks == 64 and [s.max_blocks for s in eng.runner.step_shapes(16)] == [64, 64]
    eng.warm_up()
    with compile_events() as events:
        got = eng.generate(texts, greedy)
    assert events == []
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(ValueError, match="a step with a sequence of 65 blocks: expected at most max_blocks=64"):
        eng.runner.table_width(65)


def test_with_ngram_speculation_warm_up_compiles_every_verification_and_plain_step(folder):
    eng = Engine(folder, dtype="float32", num_blocks=32, block_size=4, max_running=2, token_budget=16,
                 max_model_len=64, speculative=SpecConfig.from_method("ngram", k=3), compilation_cache=False)
    done = eng.warm_up()
    kinds = [kind for kind, *_ in done]  # steps without drafts are plain ones: both sets
    shapes = eng.runner.step_shapes(16)  # N up to the token budget, one width
    assert kinds.count("score") == 2 * len(shapes) and kinds.count("verify") == 8
    assert {"step", "sample"} <= set(kinds)
    with compile_events() as events:
        texts = ["ab ab ab ab ab ab ab ab", "the cat the cat the cat"]  # n-grams recur: drafts are proposed
        eng.generate(texts, [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                             SamplingParams(temperature=0.7, max_tokens=12, seed=2, logprobs=1)])
        eng.generate(texts[:1], SamplingParams(temperature=0.0, max_tokens=5, constraint=ConstraintSpec.regex("a+")))
        eng.generate(texts, [SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2),  # steps draft nothing
                             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])  # while it scores
    assert eng.spec_stats.num_draft_tokens > 0 and events == []


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize("speculative", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_on_a_mesh_warm_up_leaves_nothing_to_compile(speculative):
    """Plain steps, and with n-gram speculation its scoring forward and verification too (prompts that repeat
    themselves: drafts are verified)."""
    from serving import sharding

    mesh = sharding.make_mesh(2, 2, 2, devices=jax.devices()[:8])
    eng = Engine(HF / "qwen3_moe", dtype="float32", num_blocks=32, block_size=4, max_running=2, token_budget=8,
                 max_model_len=32, mesh=mesh, compilation_cache=False,
                 speculative=SpecConfig.from_method("ngram", k=2) if speculative else None)
    eng.warm_up()
    with compile_events() as events:
        eng.generate([[5, 6, 7] * 2, [9, 10, 11, 12, 13]],
                     SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert events == []
    assert (eng.spec_stats.num_draft_tokens > 0) == speculative


def test_dtype_auto_and_decode_steps_follow_the_backend():
    backend = jax.default_backend()
    # "auto": float32 on the CPU, else the checkpoint's float16 if it says so, else bfloat16 (the fixture: float32)
    assert engine_module.resolve_dtype("auto", HF / "llama") == (jax.numpy.float32 if backend == "cpu"
                                                                 else jax.numpy.bfloat16)
    assert engine_module.resolve_dtype("bfloat16", None) == jax.numpy.bfloat16
    assert engine_module.resolve_dtype(jax.numpy.float32, None) == jax.numpy.float32
    with pytest.raises(ValueError, match="dtype='fp8': expected 'auto' or one of"):
        engine_module.resolve_dtype("fp8", None)
    with pytest.raises(TypeError, match="expected a floating dtype"):
        engine_module.resolve_dtype(jax.numpy.int8, None)
    assert engine_module.DECODE_STEPS["cpu"] == engine_module.DecodeSteps(1)
    assert engine_module.default_decode_steps() == engine_module.DECODE_STEPS[backend]


def test_the_compilation_cache_is_in_the_project_cache_folder_unless_one_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv("APEX_JAX_CACHE", str(tmp_path))
    previous = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", None)  # no compile runs until it is restored
    try:
        assert engine_module.use_compilation_cache(False) is None and not jax.config.jax_compilation_cache_dir
        assert engine_module.use_compilation_cache() == tmp_path / "jax-compilation"
        assert (tmp_path / "jax-compilation").is_dir() and jax.config.jax_persistent_cache_min_compile_time_secs == 0
        assert engine_module.use_compilation_cache(tmp_path / "other") == tmp_path / "jax-compilation"  # kept
    finally:
        jax.config.update("jax_compilation_cache_dir", previous[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous[1])


STARTUP = """
import collections, json, sys, jax
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **_: events.update([name.rsplit("/", 1)[-1]]))
from serving.llm_engine import Engine, SamplingParams
from serving.models import llama
forward = llama.forward
def counted(*args, **kwargs):  # the model traced: each call is one trace of a step
    events.update(["forward"])
    return forward(*args, **kwargs)
llama.forward = counted
from serving.loaders import load_model
from serving.quantization import quantize_params
model = sys.argv[1]
if sys.argv[3]:  # the weights quantized as serve --quantize does: QuantizedWeight nodes in every call's pytree
    model = load_model(model, jax.numpy.float32)
    model = model._replace(params=quantize_params(model.params, sys.argv[3], model.cfg))
eng = Engine(model, num_blocks=8, block_size=4, max_running=1, token_budget=8, max_model_len=32,
             compilation_cache=sys.argv[2])
events.clear()
entries = eng.warm_up()
[result] = eng.generate([[5, 17, 42, 7, 99]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
print(json.dumps({"dtype": str(eng.dtype), "hits": events["cache_hits"], "misses": events["cache_misses"],
                  "entries": len(entries), "loaded": eng.runner.executables.loaded,
                  "traced": events["forward"], "tokens": result.outputs[0].token_ids}))
"""


@pytest.mark.parametrize("quantize", ["", "int8"], ids=["plain", "int8"])
def test_a_restart_reads_every_call_and_compile_back_from_the_caches(tmp_path, quantize):
    """Two processes warm up the same engine with the same cache folder: the first traces every call, keeps it
    exported and compiles it; the second traces none of the model (each call read back from the folder of exported
    calls: only their thin wrappers are traced), compiles nothing (XLA's cache holds them all) and samples the same
    tokens. Quantized weights too (their pytree nodes serialize with the calls)."""
    cache = tmp_path / "jax-cache"

    def start() -> dict:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)  # the caller's packages too
        env = os.environ | {"PYTHONPATH": path, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "true"}
        env.pop("XLA_FLAGS", None)
        run = subprocess.run([sys.executable, "-c", STARTUP, str(HF / "llama"), str(cache), quantize],
                             capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    cold = start()
    assert cold["misses"] >= 5 and cold["dtype"] == "float32" and any(cache.iterdir())
    assert cold["loaded"] == 0 and len(list((cache / engine_module.EXPORTED).iterdir())) == cold["entries"]
    warm = start()
    assert warm["misses"] == 0 and warm["hits"] == cold["misses"] + cold["hits"]
    assert warm["loaded"] == warm["entries"] == cold["entries"] and warm["tokens"] == cold["tokens"]
    assert cold["traced"] == 3 and warm["traced"] == 0  # a step, its scoring variant, a decode step


def test_k_major_quantized_weights_keep_their_layout_through_an_exported_call():
    executables._register_pytrees()
    w = quantization.with_expert_layout(
        {"mlp": {"gate": quantization.quantize(jax.numpy.arange(24.0).reshape(2, 3, 4), "int8")}}, k_major=True)
    exported = jax.export.export(jax.jit(lambda p: quantization.dequantize(p["mlp"]["gate"])))(w)
    back = jax.export.deserialize(exported.serialize())
    assert back.in_tree == exported.in_tree  # a PyTreeDef's equality compares k_major (the node's static data)
    assert (back.call(w) == quantization.dequantize(w["mlp"]["gate"])).all()


def test_the_cli_defaults_are_the_engines(folder):
    from serving import __main__ as serving_main
    from serving.api import cli

    command = ["serve", "--model", str(folder), "--num-blocks", "16", "--no-compilation-cache"]
    eng = cli._engine(serving_main.parser().parse_args(command))[0]
    assert (eng.dtype, eng.decode_steps, eng.scheduler.prefill_chunk, eng.compilation_cache) == (
        engine_module.resolve_dtype("auto", folder), engine_module.default_decode_steps(), 256, None)
    flags = ["--dtype", "bfloat16", "--prefill-chunk", "100", "--token-budget", "200"]
    eng = cli._engine(serving_main.parser().parse_args(command + flags))[0]
    assert (eng.dtype, eng.scheduler.prefill_chunk) == (jax.numpy.bfloat16, 100)
    assert jax.tree.leaves(eng.runner.params)[0].dtype == jax.numpy.bfloat16


@pytest.mark.parametrize("kernels", ["default", "interpret"])
def test_a_run_over_padding_leaves_the_cache_and_the_outputs_as_they_were(folder, kernels):
    """``ModelRunner.run_padding`` and ``run_decode_padding`` (warm-up's first run of each forward step and
    multi-step decode on an accelerator, beside the samplers') write nothing:
    every slot of its batch is PAD, so a cache holding a request's blocks is bitwise unchanged, and the request run
    again (its prefix cached) gives the same tokens."""
    import numpy as np

    policy = {"default": layers.DEFAULT, "interpret": layers.INTERPRET}[kernels]  # interpret: the Pallas kernels
    eng = Engine(folder, dtype="float32", num_blocks=32, block_size=4, max_running=4, token_budget=16,
                 max_model_len=64, compilation_cache=False, kernels=policy)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [want] = eng.generate(["Once upon a time there was"], greedy)
    before = jax.device_get(eng.runner.kv)
    assert any(np.abs(leaf).sum() > 0 for leaf in jax.tree.leaves(before))  # the request's blocks are cached
    runner = eng.runner
    step_logits = {}
    for shape in runner.step_shapes(16):
        step_logits[shape.num_seqs] = runner.run_padding(shape)
        runner.run_padding(shape, scores=True)
    for shape in runner.step_shapes(16, decode_only=True):
        runner.run_padding(shape)
        runner.run_decode_padding(shape, 2, MAX_LOGPROBS, True)  # a multi-step decode over padding
    for variant in ((0, False, False, False), (MAX_LOGPROBS, True, True, True)):  # samplers over a step's logits
        runner.run_sample_padding(step_logits[4], *variant)
    after = jax.device_get(eng.runner.kv)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True))
    [again] = eng.generate(["Once upon a time there was"], greedy)
    assert again.outputs[0].token_ids == want.outputs[0].token_ids


def _call_signature(args) -> tuple:
    """What a compiled call's fast path is keyed on beside shapes and dtypes: each argument leaf a numpy array or a
    device array, committed or not, and its sharding."""
    return tuple((type(leaf).__name__, getattr(leaf, "committed", None), str(getattr(leaf, "sharding", None)))
                 for leaf in jax.tree.leaves(list(args)))


def test_serving_calls_every_executable_as_warm_up_ran_it(folder, monkeypatch):
    """A compiled call dispatched with arguments of a kind its runs have not met (numpy where warm-up passed a device
    array, a committed array where it passed an uncommitted one) takes jax's slow path once, on some request's
    TTFT: warm-up's runs over padding pass every argument as serving does, a step fed from the host and one chained
    behind another (fed on the device) alike, and each sampler a step's own logits."""
    eng = Engine(folder, dtype="float32", num_blocks=64, block_size=4, max_running=4, token_budget=16,
                 max_model_len=64, compilation_cache=False, decode_steps=4)
    monkeypatch.setattr(eng.runner, "platform", "gpu")  # warm-up runs every call once, as on an accelerator
    seen, phase = {"warm-up": set(), "serving": set()}, ["warm-up"]
    call = executables.Executables.call

    def recorded(self, name, jitted, fixed, args, static):
        seen[phase[0]].add((name, self.key(name, args, static), _call_signature(args)))
        return call(self, name, jitted, fixed, args, static)

    monkeypatch.setattr(executables.Executables, "call", recorded)
    eng.warm_up()
    phase[0] = "serving"
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eng.generate(["Once upon a time there was", "The"], greedy)  # prefill, chained single and multi-step decodes
    eng.generate(["A long time ago"], SamplingParams(temperature=0.8, max_tokens=6, seed=1, logprobs=2))
    assert {name for name, *_ in seen["serving"]} >= {"step", "sample", "decode"}
    assert seen["serving"] - seen["warm-up"] == set()
