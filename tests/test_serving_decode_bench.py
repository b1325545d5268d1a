"""benchmarks/serving_decode.py: the tiny CPU mode runs every serving case through a worker subprocess and
writes them; the roofline's byte count follows the config and the routed experts actually touched."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import serving_decode
from pallas_kernels.testing import lower_for_h200, on_gpu
from serving import layers
from serving.config import ModelConfig
from serving.kv_cache import PagedKV, SeqChunk, make_batch
from serving.models import model_module


def test_cpu_mode_measures_prefill_and_decode_and_writes_them(tmp_path):
    serving_decode.main(["--cpu", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "serving_decode_cpu.json").read_text())
    assert result["benchmark"] == "serving_decode_cpu" and result["meta"]["platform"] == "cpu"
    rows = result["rows"]
    settings = serving_decode.SETTINGS["cpu"]
    assert [(r["case"], r["batch"]) for r in rows] == [("decode", b) for b in settings["batches"]] + [("prefill", 1)]
    for r in rows:
        assert r["status"] == "ok" and r["engine"] == "serving" and r["step_ms"] > 0, r
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * (settings["context"] if r["case"] == "prefill" else 1)
                                                  / (r["step_ms"] * 1e-3))
    for r in rows[:-1]:
        assert 0 < r["roofline_pct"] and r["roofline_tokens_per_s"] > 0
        assert 1 <= r["touched_experts_per_layer"] <= min(8, r["batch"] * 2)  # tiny-moe: 8 experts, top-2
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


def test_cpu_profile_mode_traces_each_decode_batch(tmp_path, capsys):
    assert serving_decode.main(["--cpu", "--profile", "--batches", "2,1", "--out-dir", str(tmp_path)]) == []
    out = capsys.readouterr().out
    titles = [line.split(":")[0] for line in out.splitlines() if "ms/step untraced" in line]
    assert titles == [f"tiny-moe, 2 layers, context 64, decode batch {b} (paged only)" for b in (2, 1)]
    assert not list(tmp_path.iterdir())  # no result rows


@pytest.mark.parametrize("argv", [["--profile", "--models", "tiny-moe,tiny-moe"], ["--batches", "1,0"],
                                  ["--batches", "one"]])
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
def test_the_benchmark_models_lower_to_the_triton_kernels_for_an_h200(name, case):
    """One layer of each benchmark model at its real width: B=64 decode (paged only, as the benchmark traces it) and
    a 2048-token prefill lower for an H200, every Triton module passing the MLIR verifier (the GPU run's compile
    errors, caught on a CPU)."""
    cfg = ModelConfig.from_hf(serving_decode.MODELS[name] | dict(num_hidden_layers=1))
    module = model_module(cfg.family)
    context, blocks = 2048, 2048 // serving_decode.BLOCK_SIZE
    params = jax.eval_shape(lambda: module.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    kv = jax.eval_shape(lambda: PagedKV.create(cfg, 64 * blocks, serving_decode.BLOCK_SIZE, jnp.bfloat16))
    tables = np.arange(64 * blocks).reshape(64, blocks).tolist()
    chunks = ([SeqChunk(t, context - 1, 1) for t in tables] if case == "decode" else [SeqChunk(tables[0], 0, context)])
    batch = make_batch(chunks, serving_decode.BLOCK_SIZE)
    assert layers.all_paged(batch) == (case == "decode")
    with layers.paged_only(case == "decode"):
        text = lower_for_h200(lambda p, t, b, c: module.forward(p, cfg, t, b, c), params,
                              jax.ShapeDtypeStruct(batch.positions.shape, jnp.int32), batch, kv)
    kernels = {"paged_attention", "flash_attention_causal", "grouped_matmul"}  # 512 expert pairs: grouped
    expected = {"paged_attention"} | ({"flash_attention_causal"} if case == "prefill" else set()) | (
        {"grouped_matmul"} if cfg.num_experts else set())
    assert {k for k in kernels if f'name = "{k}"' in text} == expected
