"""The Hugging Face reference fixtures (tests/fixtures/hf) hold what the JAX serving models are tested against.

No torch here: configs are read as JSON, weights with ``safetensors.numpy``. The fixtures are made by
``tests/fixtures/make_hf_fixtures.py``.
"""

import json

import numpy as np
import pytest
from helpers import HF
from safetensors.numpy import load_file

MODELS = ("llama", "qwen3", "qwen3_moe", "mixtral", "mixtral_window", "deepseek_v3", "gpt_oss")
MOE_MODELS = ("qwen3_moe", "mixtral", "mixtral_window", "deepseek_v3")  # per-expert tensors (GPT-OSS: fused)
MODEL_TYPES = {"mixtral_window": "mixtral"}
PAD_ID = 0  # make_hf_fixtures.PAD_ID
NEW_TOKENS = 32  # make_hf_fixtures.NEW_TOKENS
MAX_TOTAL_BYTES = 6_000_000
# One bf16 rounding per op over a few layers, plus the odd expert chosen differently: a few percent.
BF16_RTOL = 0.1

# model: (expert tensor prefix in a layer, the three projections (gate, up, down), config key of the count)
EXPERTS = {
    "qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj"), "num_local_experts"),
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2"), "num_local_experts"),
    "mixtral_window": ("block_sparse_moe.experts", ("w1", "w3", "w2"), "num_local_experts"),
    "deepseek_v3": ("mlp.experts", ("gate_proj", "up_proj", "down_proj"), "n_routed_experts"),
}
EXPERT_WIDTH = {"qwen3_moe": "moe_intermediate_size", "mixtral": "intermediate_size",
                "mixtral_window": "intermediate_size", "deepseek_v3": "moe_intermediate_size"}


def config(model: str) -> dict:
    return json.loads((HF / model / "config.json").read_text())


def tensors(model: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, merged over its safetensors files."""
    merged = {}
    for file in sorted((HF / model).glob("*.safetensors")):
        merged.update(load_file(file))
    return merged


def reference(model: str) -> dict[str, np.ndarray]:
    with np.load(HF / model / "reference.npz") as npz:
        return dict(npz)


def moe_layers(model: str) -> list[int]:
    c = config(model)
    return list(range(c.get("first_k_dense_replace", 0), c["num_hidden_layers"]))


@pytest.mark.parametrize("model", MODELS)
def test_config_parses_with_gqa_and_fp32(model):
    c = config(model)
    assert c["model_type"] == MODEL_TYPES.get(model, model)
    assert c["transformers_version"] == "5.24.0"  # saved as transformers 5 writes it, keys untouched
    assert c["dtype"] == "float32"
    assert c["vocab_size"] > 256 and c["hidden_size"] == 64
    if model == "deepseek_v3":  # MLA: per-head k and v come from one latent, so kv heads == heads
        dims = [c[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
        assert len(set(dims)) == len(dims), f"MLA dims {dims} should be distinct"
        assert c["first_k_dense_replace"] == 1 and c["n_shared_experts"] >= 1
        assert c["routed_scaling_factor"] != 1 and c["topk_group"] < c["n_group"]
        assert c["rope_parameters"]["rope_type"] == "yarn"
        assert {"mscale", "mscale_all_dim"} <= set(c["rope_parameters"])
    else:
        assert c["num_key_value_heads"] < c["num_attention_heads"]


@pytest.mark.parametrize("model", MODELS)
def test_every_tensor_is_finite_fp32(model):
    files = sorted((HF / model).glob("*.safetensors"))
    assert files
    for file in files:
        for name, array in load_file(file).items():
            assert array.dtype == np.float32, f"{file.name}:{name} is {array.dtype}"
            assert np.isfinite(array).all(), f"{file.name}:{name} has non-finite values"


def test_sharded_index_lists_every_tensor_exactly_once():
    sharded = [m for m in MODELS if (HF / m / "model.safetensors.index.json").exists()]
    assert sharded == ["deepseek_v3"]
    index = json.loads((HF / "deepseek_v3" / "model.safetensors.index.json").read_text())
    shards = sorted((HF / "deepseek_v3").glob("*.safetensors"))
    assert 2 <= len(shards) <= 3
    where = {}
    for shard in shards:
        for name, array in load_file(shard).items():
            assert name not in where, f"{name} is in {where.get(name)} and {shard.name}"
            where[name] = (shard.name, array.nbytes)
    assert index["weight_map"] == {name: file for name, (file, _) in where.items()}
    assert index["metadata"]["total_size"] == sum(nbytes for _, nbytes in where.values())
    for model in set(MODELS) - set(sharded):
        assert [f.name for f in (HF / model).glob("*.safetensors")] == ["model.safetensors"]


@pytest.mark.parametrize("model", MOE_MODELS)
def test_experts_are_per_expert_tensors(model):
    c, weights = config(model), tensors(model)
    prefix, projections, count_key = EXPERTS[model]
    n_experts, width, hidden = c[count_key], c[EXPERT_WIDTH[model]], c["hidden_size"]
    assert not [k for k in weights if k.endswith(("gate_up_proj", "experts.down_proj"))], "fused expert tensors"
    names = {(l, e): [f"model.layers.{l}.{prefix}.{e}.{p}.weight" for p in projections]
             for l in moe_layers(model) for e in range(n_experts)}
    expected = {name for triple in names.values() for name in triple}
    found = {k for k in weights if ".experts." in k}
    assert found == expected, f"missing {sorted(expected - found)[:3]}, unexpected {sorted(found - expected)[:3]}"
    for gate, up, down in names.values():
        assert weights[gate].shape == weights[up].shape == (width, hidden)  # nn.Linear: [out, in]
        assert weights[down].shape == (hidden, width)
    for l in moe_layers(model):
        assert weights[f"model.layers.{l}.{prefix.removesuffix('.experts')}.gate.weight"].shape == (n_experts, hidden)


def test_deepseek_dense_first_layer_and_shared_experts():
    c, weights = config("deepseek_v3"), tensors("deepseek_v3")
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (c["intermediate_size"], c["hidden_size"])
    shared = c["moe_intermediate_size"] * c["n_shared_experts"]
    for l in moe_layers("deepseek_v3"):
        assert weights[f"model.layers.{l}.mlp.shared_experts.gate_proj.weight"].shape == (shared, c["hidden_size"])


def test_deepseek_correction_bias_is_random_and_non_zero():
    c, weights = config("deepseek_v3"), tensors("deepseek_v3")
    for l in moe_layers("deepseek_v3"):
        bias = weights[f"model.layers.{l}.mlp.gate.e_score_correction_bias"]
        assert bias.shape == (c["n_routed_experts"],)
        # a constant shift would not change which experts win, so the bias must vary across experts
        assert np.abs(bias).min() > 0 and bias.std() > 0.01


def test_deepseek_mla_weight_shapes():
    c, weights = config("deepseek_v3"), tensors("deepseek_v3")
    d, h = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    attn = "model.layers.1.self_attn"
    assert weights[f"{attn}.q_a_proj.weight"].shape == (c["q_lora_rank"], d)
    assert weights[f"{attn}.q_b_proj.weight"].shape == (h * (nope + rope), c["q_lora_rank"])
    assert weights[f"{attn}.kv_a_proj_with_mqa.weight"].shape == (c["kv_lora_rank"] + rope, d)
    assert weights[f"{attn}.kv_b_proj.weight"].shape == (h * (nope + v), c["kv_lora_rank"])
    assert weights[f"{attn}.o_proj.weight"].shape == (d, h * v)


@pytest.mark.parametrize("model", MODELS)
def test_lm_head_is_tied_only_in_llama_and_qwen3(model):
    c, weights = config(model), tensors(model)
    assert c["tie_word_embeddings"] == (model in ("llama", "qwen3"))
    assert ("lm_head.weight" in weights) == (not c["tie_word_embeddings"])
    assert weights["model.embed_tokens.weight"].shape == (c["vocab_size"], c["hidden_size"])


def test_configs_are_transformers_5_spellings():
    """No key rewritten after save_pretrained: rope_parameters only, num_local_experts, DeepSeek's derived dims."""
    for model in MODELS:
        c = config(model)
        assert "rope_parameters" in c and "rope_theta" not in c and "rope_scaling" not in c, model
    assert config("llama")["rope_parameters"]["rope_type"] == "llama3"
    assert "num_local_experts" in config("qwen3_moe") and "num_experts" not in config("qwen3_moe")
    assert {"head_dim", "qk_head_dim"} <= set(config("deepseek_v3"))


def test_window_fixtures_slide_within_the_test_sequence():
    """Windows shorter than the longer prompt, so prefill and the 32 greedy steps both cross them."""
    lengths = reference("mixtral")["lengths"]
    assert config("mixtral")["sliding_window"] is None
    for model, types in (("mixtral_window", None), ("qwen3", ["full_attention", "sliding_attention"]),
                         ("gpt_oss", ["sliding_attention", "full_attention"])):
        c = config(model)
        assert c["sliding_window"] < lengths.max(), model
        assert c.get("layer_types") == types, model


def test_gpt_oss_tensors():
    """Fused experts (gate/up interleaved in one [E, D, 2I] tensor), biases everywhere, a sink per head."""
    c, weights = config("gpt_oss"), tensors("gpt_oss")
    e, d, i, h = c["num_local_experts"], c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    for l in range(c["num_hidden_layers"]):
        prefix = f"model.layers.{l}"
        assert weights[f"{prefix}.mlp.experts.gate_up_proj"].shape == (e, d, 2 * i)
        assert weights[f"{prefix}.mlp.experts.gate_up_proj_bias"].shape == (e, 2 * i)
        assert weights[f"{prefix}.mlp.experts.down_proj"].shape == (e, i, d)
        assert weights[f"{prefix}.mlp.experts.down_proj_bias"].shape == (e, d)
        assert weights[f"{prefix}.mlp.router.bias"].shape == (e,)
        sinks = weights[f"{prefix}.self_attn.sinks"]
        assert sinks.shape == (h,) and sinks.std() > 0.3  # far from 0, so a sink not applied shows
        biases = [f"{prefix}.self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        biases += [f"{prefix}.mlp.experts.{p}_bias" for p in ("gate_up_proj", "down_proj")]
        for key in biases:  # HF starts them at 0; random, so a bias not loaded shows
            assert np.abs(weights[key]).min() > 0, key


@pytest.mark.parametrize("model", MODELS)
def test_reference_shapes_and_values(model):
    ref, vocab = reference(model), config(model)["vocab_size"]
    assert set(ref) == {"input_ids", "lengths", "logits", "logits_bf16", "greedy", "greedy_margin"}
    lengths = ref["lengths"]
    batch, seq = ref["input_ids"].shape
    assert (batch, ref["input_ids"].dtype, lengths.dtype) == (2, np.int32, np.int32)
    assert lengths.max() == seq and lengths.min() < seq, "two prompts of different lengths"
    assert ref["greedy"].shape == (batch, NEW_TOKENS) and ref["greedy"].dtype == np.int32
    assert ((0 <= ref["greedy"]) & (ref["greedy"] < vocab)).all()
    assert ((0 <= ref["input_ids"]) & (ref["input_ids"] < vocab)).all()
    for key in ("logits", "logits_bf16"):
        assert ref[key].shape == (batch, seq, vocab) and ref[key].dtype == np.float32
        assert np.isfinite(ref[key]).all()
    for b, n in enumerate(lengths):
        assert (ref["input_ids"][b, n:] == PAD_ID).all()
        assert (ref["logits"][b, n:] == 0).all() and (ref["logits_bf16"][b, n:] == 0).all()
        assert (np.abs(ref["logits"][b, :n]).max(-1) > 0).all()
        # generate's first token is the argmax of the batched forward's last prompt position
        assert ref["greedy"][b, 0] == ref["logits"][b, n - 1].argmax()
    assert (ref["greedy_margin"] > 0).all()
    err = np.linalg.norm(ref["logits_bf16"] - ref["logits"]) / np.linalg.norm(ref["logits"])
    assert 0 < err < BF16_RTOL, f"bf16 logits differ from fp32 by {err:.3g}"


def test_fixtures_are_small():
    total = sum(f.stat().st_size for f in HF.rglob("*") if f.is_file())
    assert total < MAX_TOTAL_BYTES, f"{total} bytes of fixtures"


def test_vision_language_fixture():
    """Qwen3-VL-MoE as save_pretrained writes it: fp32, fused experts, the processor config beside it, and a
    reference of two prompts with one image each whose placeholder runs match the images' grids."""
    c, weights, ref = config("qwen3_vl_moe"), tensors("qwen3_vl_moe"), reference("qwen3_vl_moe")
    assert c["transformers_version"] == "5.24.0" and c["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in weights.values())
    assert {k for k in weights if k.endswith("experts.gate_up_proj")} and (HF / "qwen3_vl_moe" /
                                                                           "preprocessor_config.json").is_file()
    merge = c["vision_config"]["spatial_merge_size"] ** 2
    assert ref["pixel_values"].shape[0] == ref["image_grid_thw"].prod(-1).sum()
    for b, n in enumerate(ref["lengths"]):
        ids = ref["input_ids"][b, :n]
        assert (ids == c["image_token_id"]).sum() == ref["image_grid_thw"][b].prod() // merge
        assert ref["greedy"][b, 0] == ref["logits"][b, n - 1].argmax()
