"""benchmarks/serving_decode.py: the tiny CPU mode runs every serving case through a worker subprocess and
writes them; the roofline's byte count follows the config and the routed experts actually touched."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import serving_decode
from pallas_kernels.testing import lower_for_h200, on_gpu
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
    """One layer of each benchmark model at its real width: B=64 decode and a 2048-token prefill lower for an H200,
    every Triton module passing the MLIR verifier (the GPU run's compile errors, caught on a CPU)."""
    cfg = ModelConfig.from_hf(serving_decode.MODELS[name] | dict(num_hidden_layers=1))
    module = model_module(cfg.family)
    context, blocks = 2048, 2048 // serving_decode.BLOCK_SIZE
    params = jax.eval_shape(lambda: module.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    kv = jax.eval_shape(lambda: PagedKV.create(cfg, 64 * blocks, serving_decode.BLOCK_SIZE, jnp.bfloat16))
    tables = np.arange(64 * blocks).reshape(64, blocks).tolist()
    chunks = ([SeqChunk(t, context - 1, 1) for t in tables] if case == "decode" else [SeqChunk(tables[0], 0, context)])
    batch = make_batch(chunks, serving_decode.BLOCK_SIZE)
    text = lower_for_h200(lambda p, t, b, c: module.forward(p, cfg, t, b, c), params,
                          jax.ShapeDtypeStruct(batch.positions.shape, jnp.int32), batch, kv)
    kernels = ("paged_attention", "flash_attention_causal") + (("grouped_matmul",) if cfg.num_experts else ())
    assert all(f'name = "{k}"' in text for k in kernels), kernels
