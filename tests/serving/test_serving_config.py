"""ModelConfig: reading HF config.json (the spellings of transformers 4.x and 5.x), validation, layer kinds."""

import dataclasses
import json
import re

import jax
import pytest
from helpers import HF

from serving import __main__ as serving_main
from serving.config import ModelConfig, RopeConfig

FIXTURES = ("llama", "qwen3", "qwen3_moe", "mixtral", "mixtral_window", "deepseek_v3", "gpt_oss")


def hf_config(name: str) -> dict:
    return json.loads((HF / name / "config.json").read_text())


def small(**overrides) -> ModelConfig:
    fields = dict(family="qwen3_moe", vocab=32, hidden=16, layers=4, heads=4, kv_heads=2, head_dim=8,
                  intermediate=24, num_experts=8, top_k=2, moe_intermediate=8)
    return ModelConfig(**{**fields, **overrides})


def test_llama_fixture_config():
    cfg = ModelConfig.from_hf(hf_config("llama"))
    assert (cfg.family, cfg.vocab, cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim) == (
        "llama", 320, 64, 2, 4, 2, 16)
    assert cfg.tie_embeddings and cfg.num_experts == 0 and not cfg.qk_norm and not cfg.is_mla
    assert cfg.rope == RopeConfig(theta=10000.0, kind="llama3", factor=8.0, original_max_position=256,
                                  low_freq_factor=1.0, high_freq_factor=4.0)
    assert not any(cfg.is_moe_layer(l) for l in range(cfg.layers))


def test_qwen3_moe_fixture_config():
    cfg = ModelConfig.from_hf(hf_config("qwen3_moe"))
    assert (cfg.heads, cfg.head_dim, cfg.hidden) == (8, 16, 64)  # heads * head_dim != hidden
    assert cfg.qk_norm and cfg.norm_topk_prob and cfg.router == "softmax"
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate, cfg.intermediate) == (8, 2, 32, 96)
    assert cfg.rope == RopeConfig(theta=1e6)
    assert all(cfg.is_moe_layer(l) for l in range(cfg.layers))


def test_mixtral_fixture_config():
    cfg = ModelConfig.from_hf(hf_config("mixtral"))  # head_dim null: hidden / heads
    assert cfg.head_dim == 64 // 4 and cfg.rope == RopeConfig(theta=1e6)
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate) == (8, 2, 32)
    assert cfg.norm_topk_prob and not cfg.qk_norm and cfg.rms_eps == 1e-5 and not cfg.tie_embeddings
    assert cfg.layer_windows == () and ModelConfig.from_hf(hf_config("mixtral_window")).layer_windows == (8, 8)


def test_qwen3_fixture_config():
    cfg = ModelConfig.from_hf(hf_config("qwen3"))
    assert (cfg.family, cfg.heads, cfg.head_dim, cfg.num_experts) == ("qwen3", 8, 16, 0)
    assert cfg.qk_norm and cfg.tie_embeddings
    assert cfg.layer_windows == (0, 8) and [cfg.window(l) for l in range(2)] == [0, 8]  # max_window_layers = 1


def test_gpt_oss_fixture_config():
    cfg = ModelConfig.from_hf(hf_config("gpt_oss"))
    assert (cfg.family, cfg.num_experts, cfg.top_k, cfg.moe_intermediate) == ("gpt_oss", 8, 2, 32)
    assert cfg.attention_bias and cfg.attention_sinks and cfg.norm_topk_prob and not cfg.qk_norm
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (7.0, 1.702)
    assert cfg.layer_windows == (8, 0)  # sliding, full
    assert cfg.rope == RopeConfig(theta=150000.0, kind="yarn", factor=4.0, original_max_position=64,
                                  beta_fast=32.0, beta_slow=1.0, truncate=False)


def test_deepseek_v3_fixture_config():
    cfg = ModelConfig.from_hf(hf_config("deepseek_v3"))
    assert cfg.is_mla and (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                           cfg.v_head_dim) == (48, 32, 24, 16, 20)
    assert cfg.head_dim == 40 and cfg.rope_dim == 16
    assert (cfg.router, cfg.num_experts, cfg.top_k, cfg.n_group, cfg.topk_group) == ("sigmoid", 16, 3, 4, 2)
    assert (cfg.num_shared_experts, cfg.routed_scaling_factor, cfg.first_k_dense) == (2, 2.5, 1)
    assert [cfg.is_moe_layer(l) for l in range(3)] == [False, True, True]
    assert cfg.rope == RopeConfig(theta=10000.0, kind="yarn", factor=4.0, original_max_position=64, beta_fast=32.0,
                                  beta_slow=1.0, mscale=0.707, mscale_all_dim=1.0, interleaved=True)


def to_rope_parameters(config: dict) -> dict:
    """The transformers >= 5 spelling of a legacy config: rope_theta and rope_scaling merged into rope_parameters."""
    config = dict(config)
    scaling = dict(config.pop("rope_scaling", None) or {"type": "default"})
    kind = scaling.pop("type", None) or scaling.pop("rope_type")
    config["rope_parameters"] = {"rope_type": kind, "rope_theta": config.pop("rope_theta"), **scaling}
    return config


def to_legacy(config: dict, type_key: str = "rope_type") -> dict:
    """Top-level rope_theta and a rope_scaling dict whose kind is keyed ``type_key`` ("type": older 4.x configs,
    DeepSeek-V3's published one); none for plain rope (as Mixtral's published config)."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    if kind != "default":
        config["rope_scaling"] = {type_key: kind, **rope}
    return config


def to_transformers4(name: str, config: dict) -> dict:
    """The fixture's config as transformers 4.x (before 4.56) wrote it: legacy rope keys, Qwen3-MoE's expert count
    as ``num_experts``, no derived DeepSeek ``head_dim``/``qk_head_dim``, no ``layer_types`` (windows from
    ``use_sliding_window``/``max_window_layers``, GPT-OSS's alternation)."""
    config = to_legacy(config, "type" if name == "deepseek_v3" else "rope_type")
    config.pop("layer_types", None)
    if name == "qwen3_moe":
        config["num_experts"] = config.pop("num_local_experts")
    if name == "deepseek_v3":
        del config["head_dim"], config["qk_head_dim"]
    return config


@pytest.mark.parametrize("name", FIXTURES)
def test_transformers_4_and_5_spellings_read_the_same(name):
    config = hf_config(name)  # as transformers 5 saved it
    assert "rope_parameters" in config and "rope_theta" not in config
    legacy = to_transformers4(name, config)
    assert ModelConfig.from_hf(legacy) == ModelConfig.from_hf(config)
    assert ModelConfig.from_hf(to_rope_parameters(legacy)) == ModelConfig.from_hf(config)


def test_expert_count_in_either_spelling():
    for name, key in (("qwen3_moe", "num_experts"), ("mixtral", "num_experts"), ("gpt_oss", "num_experts")):
        config = hf_config(name)
        config[key] = config.pop("num_local_experts")
        assert ModelConfig.from_hf(config).num_experts == 8, name


def test_qwen3_window_needs_use_sliding_window():
    config = to_transformers4("qwen3", hf_config("qwen3"))
    assert ModelConfig.from_hf(config).layer_windows == (0, 8)
    config.update(use_sliding_window=False, sliding_window=4096)  # as Qwen3's published 4.x configs
    assert ModelConfig.from_hf(config).layer_windows == ()
    moe = hf_config("qwen3_moe") | dict(use_sliding_window=True, sliding_window=8)  # every layer
    assert ModelConfig.from_hf(moe).layer_windows == (8, 8)


def test_a_window_at_least_the_context_is_accepted():
    config = hf_config("mixtral_window") | dict(sliding_window=4096)  # > max_position_embeddings
    assert ModelConfig.from_hf(config).layer_windows == (4096, 4096)


def test_model_type_when_no_architectures():
    config = hf_config("mixtral")
    del config["architectures"]
    assert ModelConfig.from_hf(config).family == "mixtral"


def test_yarn_factor_from_context_ratio_when_missing():
    config = hf_config("deepseek_v3")
    del config["rope_parameters"]["factor"]  # transformers then uses max_position_embeddings / original
    assert ModelConfig.from_hf(config).rope.factor == 256 / 64


def test_config_is_a_static_jit_argument():
    cfg = ModelConfig.from_hf(hf_config("qwen3_moe"))
    assert hash(cfg) == hash(ModelConfig.from_hf(hf_config("qwen3_moe")))
    f = jax.jit(lambda x, c: x * c.heads, static_argnums=1)
    assert int(f(2, cfg)) == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.heads = 2


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(architectures=["GPT2LMHeadModel"]), "architectures"),
    (lambda c: (c.pop("architectures"), c.update(model_type="gpt2")), "model_type"),
    (lambda c: c.pop("hidden_size"), "hidden_size"),
    (lambda c: c.pop("num_local_experts"), "num_local_experts"),
    (lambda c: c.update(num_key_value_heads=3), "kv_heads"),
    (lambda c: c.update(num_experts_per_tok=9), "top_k"),
    (lambda c: c.update(mlp_only_layers=[5]), "mlp_only_layers"),
    (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "rope_type"),
    (lambda c: c.update(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), "factor"),
    (lambda c: c.update(rope_parameters={"rope_type": "default"}), "rope_theta"),
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(use_sliding_window=True, sliding_window=-1), "sliding_window"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(quantization_config={"quant_method": "mxfp4"}), "quant_method"),
    (lambda c: c.update(rms_norm_eps=0.0), "rms_eps"),
    (lambda c: c.update(num_hidden_layers="2"), r"ModelConfig.layers = '2': expected an int"),  # not a TypeError
    (lambda c: c.update(num_hidden_layers=2.0), "layers = 2.0: expected an int"),
    (lambda c: c.update(num_experts=True), "num_experts = True: expected an int"),
    (lambda c: c.update(rms_norm_eps="1e-6"), "rms_eps = '1e-6': expected a number"),
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": "1e6"}), "rope.theta"),
])
def test_bad_hf_config_names_the_field(edit, message):
    config = hf_config("qwen3_moe")
    edit(config)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(n_group=3), "n_group"),  # 16 experts do not form 3 groups
    (lambda c: c.update(topk_group=5), "topk_group"),
    (lambda c: c.update(scoring_func="softmax"), "scoring_func"),
    (lambda c: c.update(qk_rope_head_dim=0), "qk_rope_head_dim"),
    (lambda c: c.update(num_experts_per_tok=9), "top_k"),  # more than the 2 best groups' 8 experts
])
def test_bad_deepseek_config_names_the_field(edit, message):
    config = hf_config("deepseek_v3")
    edit(config)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("overrides, message", [
    (dict(family="gpt2"), "family"),
    (dict(hidden=0), "hidden"),
    (dict(moe_intermediate=0), "moe_intermediate"),
    (dict(router="relu"), "router"),
    (dict(n_group=2), "n_group"),  # group limits need the sigmoid router
    (dict(head_dim=7), "rope dim"),
    (dict(kv_lora_rank=16, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8), "head_dim"),  # 8 != 6 + 4
])
def test_inconsistent_fields_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        small(**overrides)


@pytest.mark.parametrize("fields, message", [
    (dict(kind="ntk"), "rope.kind"),
    (dict(theta=0.0), "rope.theta"),
    (dict(kind="yarn", factor=4.0), "original_max_position"),
    (dict(kind="yarn", factor=4.0, original_max_position=64, beta_fast=1.0), "beta_fast"),
    (dict(kind="llama3", factor=8.0, original_max_position=64, low_freq_factor=4.0), "high_freq_factor"),
])
def test_bad_rope_raises(fields, message):
    with pytest.raises(ValueError, match=message):
        RopeConfig(**fields)


def test_moe_layer_selection():
    assert [small(decoder_sparse_step=2).is_moe_layer(l) for l in range(4)] == [False, True, False, True]
    assert [small(mlp_only_layers=(0, 2)).is_moe_layer(l) for l in range(4)] == [False, True, False, True]
    assert [small(first_k_dense=3).is_moe_layer(l) for l in range(4)] == [False, False, False, True]
    assert not any(small(num_experts=0, top_k=0).is_moe_layer(l) for l in range(4))


@pytest.mark.parametrize("name, edit, message", [
    ("gpt_oss", lambda c: c.update(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    ("gpt_oss", lambda c: c.update(layer_types=["full_attention"]), "layer_types"),  # 2 layers
    ("llama", lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ("llama", lambda c: c.update(mlp_bias=True), "mlp_bias"),
    ("gpt_oss", lambda c: c.update(quantization_config={"quant_method": "gptq"}), "quant_method"),
    ("llama", lambda c: c.update(quantization_config={"quant_method": "mxfp4"}), "quant_method"),  # GPT-OSS's only
    ("gpt_oss", lambda c: c.pop("num_local_experts"), "num_local_experts"),
])
def test_bad_family_config_names_the_key(name, edit, message):
    config = hf_config(name)
    edit(config)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_windows=(8,)), "layer_windows"),  # 4 layers
    (dict(layer_windows=(8, 8, -1, 0)), "layer_windows"),
    (dict(swiglu_limit=7.0), "swiglu_limit"),  # without swiglu_alpha
])
def test_bad_attention_fields_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        small(**overrides)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(quantization_config={"quant_method": "awq"}), "quantization_config.quant_method = 'awq'"),
    (lambda c: c.update(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (lambda c: c.update(architectures=["Gemma3ForCausalLM"]), "architectures"),
])
def test_serve_refuses_an_unsupported_config_naming_the_key(tmp_path, edit, message):
    """``python -m serving serve --model PATH`` stops before reading any weight, naming the folder and the key."""
    config = hf_config("gpt_oss")
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for flags in ([], ["--random-weights"]):
        with pytest.raises(SystemExit, match=f"serve refuses to start: --model '{tmp_path}': config.json .*"
                                             f"{re.escape(message)}"):
            serving_main.main(["serve", "--model", str(tmp_path), *flags])


def test_gpt_oss_mxfp4_checkpoints_are_read():
    """GPT-OSS's published checkpoints: MXFP4 experts (dequantized at load, serving.loaders.mxfp4)."""
    config = hf_config("gpt_oss") | {"quantization_config": {"quant_method": "mxfp4"}}
    assert ModelConfig.from_hf(config) == ModelConfig.from_hf(hf_config("gpt_oss"))
