"""benchmarks/serving_decode.py: the tiny CPU mode runs every serving case through a worker subprocess and
writes them; the roofline's byte count follows the config and the routed experts actually touched."""

import collections
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import serving_decode
from pallas_kernels.grouped_matmul import GATHER_CONFIG, GroupedMatmulConfig
from pallas_kernels.testing import lower_for_h200, on_gpu
from serving import layers
from serving.config import ModelConfig
from serving.kv_cache import PagedKV, SeqChunk, make_batch
from serving.models import model_module


def test_cpu_mode_measures_prefill_and_decode_and_writes_them(tmp_path):
    serving_decode.main(["--cpu", "--out-dir", str(tmp_path), "--engines", "serving,serving-fp8"])
    result = json.loads((tmp_path / "serving_decode_cpu.json").read_text())
    assert result["benchmark"] == "serving_decode_cpu" and result["meta"]["platform"] == "cpu"
    rows = result["rows"]
    settings = serving_decode.SETTINGS["cpu"]
    decode_cases = [(case, b) for b in settings["batches"] for case in ("decode", "decode-multi")]
    # The fp8 engine: the same cases on quantized weights, fewer bytes a step, timed against the serving rows.
    fp8, rows = [r for r in rows if r["engine"] == "serving-fp8"], [r for r in rows if r["engine"] != "serving-fp8"]
    assert [(r["case"], r["batch"]) for r in fp8] == decode_cases + [("prefill", 1)]
    for plain, quantized in zip(rows[:-1], fp8[:-1], strict=True):
        assert quantized["weight_gb"] < plain["weight_gb"] and quantized["overhead_vs_serving"] == pytest.approx(
            quantized["step_ms"] / plain["step_ms"])
    assert [(r["case"], r["batch"]) for r in rows] == decode_cases + [("prefill", 1)]
    for r in rows:
        assert r["status"] == "ok" and r["engine"] == "serving" and r["step_ms"] > 0, r
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * (settings["context"] if r["case"] == "prefill" else 1)
                                                  / (r["step_ms"] * 1e-3))
    for r in rows[:-1]:
        assert r["steps_per_call"] == (settings["decode_steps"] if r["case"] == "decode-multi" else 1)
        assert 0 < r["roofline_pct"] and r["roofline_tokens_per_s"] > 0
        assert r["roofline_ms"] * 1e9 * r["bandwidth_tb_s"] == pytest.approx(r["weight_gb"] * 1e9 + r["kv_gb"] * 1e9)
        assert 1 <= r["touched_experts_per_layer"] <= min(8, r["batch"] * 2)  # tiny-moe: 8 experts, top-2
    # each worker measures the copy bandwidth once; the run's is their median
    assert result["bandwidth_tb_s"] == pytest.approx(np.median([rows[0]["bandwidth_tb_s"], fp8[0]["bandwidth_tb_s"]]))
    assert (tmp_path / "serving_decode_cpu.png").is_file()


def test_weight_bytes_count_touched_experts_and_skip_the_untied_embedding():
    cfg = ModelConfig.from_hf(serving_decode.TINY_MOE)
    shapes = jax.eval_shape(lambda: model_module(cfg.family).init_params(cfg, jax.random.key(0), jnp.bfloat16))
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)  # the sizes are what counts
    every = sum(x.nbytes for x in jax.tree.leaves(params))
    expert = 3 * cfg.hidden * cfg.moe_intermediate * 2  # gate, up, down of one expert, bf16
    embed = cfg.vocab * cfg.hidden * 2
    counts = np.zeros((cfg.layers, cfg.num_experts), np.int32)
    counts[0, [1, 5]] = 3  # layer 0 touched 2 experts, layer 1 touched 1
    counts[1, 2] = 1
    total, experts = serving_decode.weight_bytes_per_step(params, cfg, 4, counts)
    assert experts == 3 * expert
    all_experts = cfg.layers * cfg.num_experts * expert
    assert total == every - all_experts - embed + 4 * cfg.hidden * 2 + 3 * expert


def test_weight_bytes_count_quantized_experts_codes_and_scales():
    from serving.quantization import quantize_params

    cfg = ModelConfig.from_hf(serving_decode.TINY_MOE)
    params = model_module(cfg.family).init_params(cfg, jax.random.key(0), jnp.bfloat16)
    counts = np.ones((cfg.layers, cfg.num_experts), np.int32)  # every expert touched
    plain_total, plain_experts = serving_decode.weight_bytes_per_step(params, cfg, 1, counts)
    total, experts = serving_decode.weight_bytes_per_step(quantize_params(params, "fp8", cfg), cfg, 1, counts)
    scales = cfg.layers * cfg.num_experts * (2 * cfg.moe_intermediate + cfg.hidden) * 4  # float32, per column
    assert experts == plain_experts // 2 + scales and total < plain_total


def trace_event(pid, tid, name, ts, dur):
    return dict(ph="X", pid=pid, tid=tid, name=name, ts=ts, dur=dur)


# A jax.profiler trace in miniature: a host process, and a GPU process with a CUPTI stream line and a derived line.
TRACE = {"traceEvents": [
    dict(ph="M", pid=1, name="process_name", args=dict(name="/host:CPU")),
    dict(ph="M", pid=2, name="process_name", args=dict(name="/device:GPU:0")),
    dict(ph="M", pid=2, name="process_sort_index", args=dict(sort_index=2)),
    dict(ph="M", pid=2, tid=7, name="thread_name", args=dict(name="Stream #7(Compute)")),
    dict(ph="M", pid=2, tid=8, name="thread_name", args=dict(name="XLA Ops")),
    trace_event(1, 1, "PjitFunction(step)", 0, 100),  # host: not a kernel
    trace_event(2, 7, "loop_add_fusion_3", 100, 2),
    trace_event(2, 7, "gather_matmul", 110, 10),
    trace_event(2, 7, "loop_add_fusion_12", 130, 4),
    trace_event(2, 7, "gather_matmul", 140, 10),
    trace_event(2, 8, "add.3", 100, 2),  # the derived op line repeats the kernels: not counted
]}


def test_profile_counts_the_gpu_stream_kernels_per_step_by_name():
    kernels = serving_decode.device_kernels(TRACE)
    assert [e["name"] for e in kernels] == ["loop_add_fusion_3", "gather_matmul", "loop_add_fusion_12",
                                            "gather_matmul"]
    profile = serving_decode.kernel_profile(kernels, steps=2)
    assert profile.count == 2 and profile.busy_us == 13 and profile.span_us == 25
    assert profile.by_name == [("gather_matmul", 1.0, 10.0), ("loop_add_fusion", 1.0, 3.0)]
    report = serving_decode.format_profile("m, decode batch 1", 0.5, profile, layers=2)
    assert report.splitlines()[0] == ("m, decode batch 1: wall 0.500 ms/step untraced; GPU kernels 0.013 ms/step "
                                      "busy over a 0.025 ms span, 2.0 kernels/step (1.0 per layer)")
    assert report.splitlines()[2].split() == ["1.0", "10.0", "gather_matmul"]


def test_profile_report_lists_the_top_kernels_and_sums_the_rest():
    kernels = [trace_event(2, 7, f"kernel_{c}", 10 * i, 10 - i) for i, c in enumerate("abcd")]
    profile = serving_decode.kernel_profile(kernels, steps=1)
    lines = serving_decode.format_profile("m", 0.5, profile, layers=1, top=2).splitlines()
    assert [line.split()[-1] for line in lines[2:4]] == ["kernel_a", "kernel_b"]
    assert lines[4].split()[:2] == ["2.0", "15.0"] and "2 other kernel names" in lines[4]
    only = serving_decode.format_profile("m", 0.5, profile, layers=1, only="kernel_c").splitlines()
    assert [line.split()[-1] for line in only[2:]] == ["kernel_c"]


def test_cpu_profile_mode_traces_each_decode_batch_and_gather_geometry(tmp_path, capsys):
    argv = ["--cpu", "--profile", "--batches", "2,1", "--gather-configs", "32x64x4x2,16x32x2x1"]
    assert serving_decode.main([*argv, "--out-dir", str(tmp_path)]) == []
    out = capsys.readouterr().out
    titles = [line.split(":")[0] for line in out.splitlines() if "ms/step untraced" in line]
    # the runner's decode steps: paged only where the kernels are traced, not on the CPU's reference path
    assert not layers.traces_kernels(layers.DEFAULT)
    assert titles == [f"tiny-moe, 2 layers, context 64, decode batch {b}, gather {g}"
                      for g in ("32x64x4x2", "16x32x2x1") for b in (2, 1)]
    rows = json.loads((tmp_path / "serving_decode_profile_cpu.json").read_text())["rows"]
    assert [(r["gather_config"], r["batch"]) for r in rows] == [("32x64x4x2", 2), ("32x64x4x2", 1),
                                                                ("16x32x2x1", 2), ("16x32x2x1", 1)]
    assert all(r["wall_ms"] > 0 and not r["paged_only"] for r in rows)
    ranking = [line for line in out.splitlines() if line.startswith("gather sweep")]
    assert [line.split(",")[1] for line in ranking] == [" decode batch 2", " decode batch 1"]
    assert all("32x64x4x2" in line and "16x32x2x1" in line for line in ranking)


def test_cpu_profile_mode_traces_a_quantized_engine(tmp_path, capsys):
    """``--engines serving-int8``: the steps traced are those of the int8 weights (their rows say so)."""
    argv = ["--cpu", "--profile", "--batches", "1", "--engines", "serving-int8", "--out-dir", str(tmp_path)]
    assert serving_decode.main(argv) == []
    assert "tiny-moe (int8), 2 layers, context 64, decode batch 1:" in capsys.readouterr().out
    rows = json.loads((tmp_path / "serving_decode_profile_cpu.json").read_text())["rows"]
    assert [(r["engine"], r["batch"]) for r in rows] == [("serving-int8", 1)]


def test_gather_configs_parse_and_the_sweep_is_valid():
    assert serving_decode.gather_config("32x256x4x3") == GroupedMatmulConfig(16, 32, 256, 4, 3, e4m3_f16=True)
    assert serving_decode.gather_config("fma:64x64x4x4") == GroupedMatmulConfig(16, 64, 64, 4, 4, tensor_cores=False)
    assert serving_decode.gather_config("bf16:64x128x4x4") == GroupedMatmulConfig(16, 64, 128, 4, 4)
    assert serving_decode.gather_config("64x128x4x3x4") == GroupedMatmulConfig(16, 64, 128, 4, 3, e4m3_f16=True,
                                                                               split_k=4)
    assert serving_decode.gather_config("64x128x4x4xauto").split_k is None
    assert len({serving_decode.gather_config(spec) for spec in serving_decode.GATHER_SWEEP}) == len(
        serving_decode.GATHER_SWEEP)
    assert serving_decode.gather_config(serving_decode.GATHER_SWEEP[0]) == GATHER_CONFIG  # the default runs first
    for spec in ("32x100x4x3", "bf8:64x128x4x4", "64x128x4x4x0", "64x128x4x4x2x2"):
        with pytest.raises(ValueError, match=rf"gather config '{spec}': expected \[fma:\|bf16:\]block_n x block_k"):
            serving_decode.gather_config(spec)


@pytest.mark.parametrize("argv", [["--profile", "--models", "tiny-moe,tiny-moe"], ["--batches", "1,0"],
                                  ["--batches", "one"], ["--profile", "--gather-configs", "32x128x4"],
                                  ["--profile", "--engines", "serving,serving-fp8"]])
def test_rejects_bad_profile_arguments(argv):
    with pytest.raises(SystemExit):
        serving_decode.main(["--cpu", *argv])


def test_rejects_unknown_models():
    with pytest.raises(SystemExit):
        serving_decode.main(["--cpu", "--models", "gpt-5"])


@pytest.mark.skipif(on_gpu(), reason="on a GPU this would start the full benchmark")
def test_gpu_mode_refuses_to_run_without_a_gpu():
    with pytest.raises(SystemExit):
        serving_decode.main(["--engines", "serving"])


def test_a_case_past_its_time_limit_costs_its_rows_not_the_run(tmp_path):
    serving_decode.main(["--cpu", "--out-dir", str(tmp_path), "--timeout", "0.5"])
    rows = json.loads((tmp_path / "serving_decode_cpu.json").read_text())["rows"]
    assert rows == [dict(model="tiny-moe", engine="serving", layers=2, case="-", status="timeout (> 0.5 s)")]


@pytest.mark.parametrize("name", list(serving_decode.MODELS))
@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_the_benchmark_models_lower_to_the_default_kernels_for_an_h200(name, case):
    """One layer of each benchmark model at its real width: B=64 decode (paged only, as the benchmark traces it) and
    a 2048-token prefill lower for an H200, every Triton module passing the MLIR verifier (the GPU run's compile
    errors, caught on a CPU). The prefill runs the Mosaic GPU flash attention, or the Triton one where the layer
    has sinks or a window, and its experts the Mosaic GPU grouped matmul where their widths are whole 256-column
    tiles (not GPT-OSS's 2880)."""
    cfg = ModelConfig.from_hf(serving_decode.MODELS[name] | dict(num_hidden_layers=1))
    module = model_module(cfg.family)
    context, blocks = 2048, 2048 // serving_decode.BLOCK_SIZE
    params = jax.eval_shape(lambda: module.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    kv = jax.eval_shape(lambda: PagedKV.create(cfg, 64 * blocks, serving_decode.BLOCK_SIZE, jnp.bfloat16))
    tables = np.arange(64 * blocks).reshape(64, blocks).tolist()
    chunks = ([SeqChunk(t, context - 1, 1) for t in tables] if case == "decode" else [SeqChunk(tables[0], 0, context)])
    batch = make_batch(chunks, serving_decode.BLOCK_SIZE)
    assert layers.all_paged(batch) == (case == "decode")
    policy = layers.KernelPolicy(paged_only=case == "decode")
    text = lower_for_h200(lambda p, t, b, c: module.forward(p, cfg, t, b, c, kernels=policy), params,
                          jax.ShapeDtypeStruct(batch.positions.shape, jnp.int32), batch, kv)
    triton = cfg.attention_sinks or any(cfg.layer_windows)
    flash = 'name = "flash_attention_causal"' if triton else "flash_attention_mgpu_causal"
    kernels = {'name = "paged_attention"', 'name = "flash_attention_causal"', "flash_attention_mgpu_causal",
               'name = "grouped_matmul"', "grouped_matmul_mgpu"}  # 512 expert pairs: grouped
    mosaic_experts = case == "prefill" and cfg.hidden % 256 == 0 and cfg.moe_intermediate % 256 == 0
    experts = "grouped_matmul_mgpu" if mosaic_experts else 'name = "grouped_matmul"'
    expected = {'name = "paged_attention"'} | ({flash} if case == "prefill" else set()) | (
        {experts} if cfg.num_experts else set())
    assert {k for k in kernels if k in text} == expected


def decode_layer_ops(num_layers: int) -> collections.Counter:
    """StableHLO op counts of Qwen3-30B-A3B's shape with ``num_layers`` layers, one decode token at 2k context (paged
    only), lowered for an H200."""
    cfg = ModelConfig.from_hf(serving_decode.MODELS["qwen3-30b-a3b"] | dict(num_hidden_layers=num_layers))
    module = model_module(cfg.family)
    blocks = 2048 // serving_decode.BLOCK_SIZE
    params = jax.eval_shape(lambda: module.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    kv = jax.eval_shape(lambda: PagedKV.create(cfg, blocks, serving_decode.BLOCK_SIZE, jnp.bfloat16))
    batch = make_batch([SeqChunk(list(range(blocks)), 2047, 1)], serving_decode.BLOCK_SIZE)
    policy = layers.KernelPolicy(paged_only=True)
    text = lower_for_h200(lambda p, t, b, c: module.forward(p, cfg, t, b, c, kernels=policy), params,
                          jax.ShapeDtypeStruct((1,), jnp.int32), batch, kv)
    return executed_ops(text)


def executed_ops(text: str) -> collections.Counter:
    """The op counts of a StableHLO module's ``main`` with every call inlined (a function shared by the layers, as
    the trace-once attention and MoE are, counts once per call), each call of a Pallas kernel function as
    ``kernel <name>``."""
    bodies = {}
    for chunk in re.split(r"\n(?=  func\.func )", text)[1:]:
        bodies[re.search(r"@([\w.$-]+)\(", chunk).group(1)] = chunk

    @functools.cache
    def inlined(name: str) -> collections.Counter:
        body = bodies[name]
        ops = collections.Counter(re.findall(r"= \"?((?:stablehlo|chlo)\.[a-z_]+)", body))
        for callee in re.findall(r"call @([\w.$-]+)\(", body):
            kernel = re.match(r"(paged_attention|gather_matmul)", callee)
            ops += collections.Counter([f"kernel {kernel.group(1)}"]) if kernel else inlined(callee)
        return ops

    return inlined("main")


def test_a_batch_1_decode_layer_lowers_to_few_ops():
    """What one more layer adds at batch 1: q/k/v/o and router projections, the two cache writes, one top-k, the
    attention kernel and the two gather_matmul launches; no sort, no [E]-wide softmax's divide, no bincount scatter,
    no gather but the layer's block-table rows. The total bounds the small XLA kernels around them (StableHLO ops:
    278 per layer at 9929046, 244 after the routing, expert-count, combine and cache-write rewrites, 253 with the
    sliding-window and sink support merged at 906b463, not yet traced to its source)."""
    one, two = decode_layer_ops(1), decode_layer_ops(2)
    per_layer = two - one
    assert per_layer["stablehlo.dot_general"] == 5  # q, k, v, o, router
    assert per_layer["kernel paged_attention"] == 1 and per_layer["kernel gather_matmul"] == 2
    assert per_layer["stablehlo.scatter"] == 2  # k and v pages
    assert per_layer["chlo.top_k"] == 1
    assert per_layer["stablehlo.gather"] <= 1 and per_layer["stablehlo.sort"] == 0
    assert sum(per_layer.values()) <= 256, per_layer
