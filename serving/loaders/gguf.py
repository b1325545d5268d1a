"""Read a GGUF file (llama.cpp's format) into exactly what a Hugging Face checkpoint folder holds.

`load_gguf(path)` returns a Hub-style `config.json` dict, float32 tensors under HF names in HF layouts
(linear weights `[out, in]`, embeddings `[vocab, hidden]`) and the checkpoint's `Tokenizer`, so GGUF and
safetensors checkpoints feed the same model code.

Conversions:
* Metadata `{arch}.embedding_length`, `{arch}.attention.head_count_kv`, `{arch}.rope.freq_base`, ... become
  `hidden_size`, `num_key_value_heads`, `rope_theta`, ...; no `output.weight` means tied embeddings.
* Quantized tensors (Q4_1, Q8_0, K-quants, ...) are dequantized with `gguf.quants.dequantize`. GGUF lists
  dimensions innermost first, so a GGUF `[in, out]` tensor is the numpy/HF `[out, in]` array.
* llama.cpp's converter permutes the rows of llama-arch attn_q/attn_k weights from HF's rotate-half rope
  layout to an interleaved one; `unpermute_rope_rows` undoes it.
* MoE experts stored stacked (`ffn_{gate,up,down}_exps`, `[experts, out, in]`) are split into the
  per-expert HF tensors.

Architectures: llama (Llama, SmolLM2; with experts: Mixtral) and qwen3moe (Qwen3-MoE).
"""

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
from gguf.quants import dequantize

from serving.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"
# llama.cpp's default rope base when a GGUF has no `{arch}.rope.freq_base`.
DEFAULT_ROPE_THETA = 10_000.0

# GGUF tensor name inside `blk.{i}.` -> HF module name inside `model.layers.{i}.`; ".weight"/".bias" carry over.
_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# MoE: the router, and the stacked experts whose HF names take the expert index.
_MIXTRAL_MOE = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{}.w1",
    "ffn_down_exps": "block_sparse_moe.experts.{}.w2",
    "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
}
_QWEN3_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
_LAYER_NAMES = {  # by HF model_type
    "llama": _ATTENTION | _DENSE_MLP,
    "mixtral": _ATTENTION | _MIXTRAL_MOE,
    "qwen3_moe": _ATTENTION | _QK_NORM | _DENSE_MLP | _QWEN3_MOE,
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
SUPPORTED_ARCHITECTURES = ("llama", "qwen3moe")


class GGUFCheckpoint(NamedTuple):
    """What `load_gguf` returns: HF `config.json` dict, {HF name: float32 array}, tokenizer."""

    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tokenizer: Tokenizer


def load_gguf(path: str | Path) -> GGUFCheckpoint:
    """Read, dequantize and rename a GGUF checkpoint.

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: not a GGUF file, truncated or corrupt, or metadata/tensors missing or unexpected.
      NotImplementedError: an architecture, tokenizer or rope scaling this loader does not map.
    """
    reader = _open(Path(path))
    metadata = read_metadata(reader)
    tensor_names = [t.name for t in reader.tensors]
    config = hf_config(metadata, tensor_names)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    if tokenizer.vocab_size != config["vocab_size"]:
        raise ValueError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the model "
                         f"{config['vocab_size']}")
    tensors = {}
    for tensor in reader.tensors:
        # GGUF dims are innermost first: reversed, they are the numpy (and HF) shape.
        array = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        if not array.flags.writeable:  # an F32 tensor is a read-only view of the mapped file: own a copy
            array = np.array(array)
        tensors.update(_hf_tensors(tensor.name, array, config, metadata["general.architecture"]))
    missing = sorted(set(expected_tensor_names(config)) - tensors.keys())
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} tensors a {config['model_type']} checkpoint needs, "
                         f"e.g. {missing[:5]}")
    return GGUFCheckpoint(config, tensors, tokenizer)


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value metadata of a GGUF as Python scalars, strings and lists (header fields left out)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is a truncated or corrupt GGUF file ({path.stat().st_size} bytes): "
                         f"{type(e).__name__}: {e}") from e


def _float(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def hf_config(metadata: Mapping[str, Any], tensor_names: Collection[str]) -> dict[str, Any]:
    """The Hugging Face `config.json` dict of a GGUF checkpoint.

    Args:
      metadata: GGUF key/value metadata (`read_metadata`).
      tensor_names: GGUF tensor names (tie detection, MoE layers, attention biases).
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported: supported are {list(SUPPORTED_ARCHITECTURES)}")

    def get(key: str, default: Any = ...) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is ...:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}, which a {arch} checkpoint needs")
        if isinstance(value, list):
            raise NotImplementedError(f"GGUF {arch}.{key} varies per layer ({value[:4]}...): not supported")
        return value

    if "rope_freqs.weight" in tensor_names:
        raise NotImplementedError("GGUF tensor rope_freqs.weight (llama3-style rope scaling) is not supported")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim or get("rope.dimension_count", head_dim) != head_dim:
        raise NotImplementedError(
            f"GGUF {arch}: value_length {get('attention.value_length', head_dim)} and rope.dimension_count "
            f"{get('rope.dimension_count', head_dim)} must equal the head dim {head_dim}")
    n_layers = get("block_count")
    vocab_size = get("vocab_size", len(metadata.get("tokenizer.ggml.tokens", [])))
    if not vocab_size:
        raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "intermediate_size": get("feed_forward_length"),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": _float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float(get("rope.freq_base", DEFAULT_ROPE_THETA)),
        "rope_scaling": _rope_scaling(get("rope.scaling.type", "none"), lambda: get("rope.scaling.factor")),
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if key in metadata:
            config[name] = metadata[key]

    n_experts = get("expert_count", 0)
    if n_experts:
        n_used = get("expert_used_count")
        if arch == "llama":
            config.update(model_type="mixtral", num_local_experts=n_experts, num_experts_per_tok=n_used)
        else:
            dense_layers = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
            config.update(model_type="qwen3_moe", num_experts=n_experts, num_experts_per_tok=n_used,
                          moe_intermediate_size=get("expert_feed_forward_length"),
                          # llama.cpp's qwen3moe always renormalizes the top-k router weights.
                          norm_topk_prob=bool(get("expert_weights_norm", True)),
                          decoder_sparse_step=1, mlp_only_layers=dense_layers)
    elif arch == "qwen3moe":
        raise ValueError("GGUF qwen3moe checkpoint lacks qwen3moe.expert_count")
    else:
        config["model_type"] = "llama"
    config["architectures"] = [_HF_ARCHITECTURES[config["model_type"]]]
    return config


def _rope_scaling(kind: str, factor) -> dict[str, Any] | None:
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float(factor())}
    raise NotImplementedError(f"GGUF rope.scaling.type {kind!r} is not supported (only 'none' and 'linear')")


def expected_tensor_names(config: Mapping[str, Any]) -> list[str]:
    """The HF tensor names a checkpoint with this config must hold (biases aside)."""
    model_type = config["model_type"]
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        names.append("lm_head.weight")
    layer_names = list(_ATTENTION.values())
    if model_type == "qwen3_moe":
        layer_names += _QK_NORM.values()
    moe_names = {"mixtral": _MIXTRAL_MOE, "qwen3_moe": _QWEN3_MOE}.get(model_type, {})
    n_experts = config.get("num_local_experts", config.get("num_experts", 0))
    for i in range(config["num_hidden_layers"]):
        mlp = list(_DENSE_MLP.values())
        if moe_names and i not in config.get("mlp_only_layers", []):
            mlp = [name.format(e) for name in moe_names.values() for e in range(n_experts if "{}" in name else 1)]
        names += [f"model.layers.{i}.{name}.weight" for name in layer_names + mlp]
    return names


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, back to HF's rotate-half rope layout.

    HF orders each head's `head_dim` rows as [first halves of the rotation pairs | second halves]; llama.cpp
    interleaves them: rows of one head are viewed as `[2, head_dim/2]` and transposed to `[head_dim/2, 2]`.
    Here each head's rows are viewed as `[head_dim/2, 2]` and transposed back.

    Args:
      weight: `[n_heads * head_dim, in]` weight or `[n_heads * head_dim]` bias, as stored in the GGUF.
      n_heads: query heads for attn_q, key/value heads for attn_k.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of an even head_dim")
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape))


def _hf_tensors(name: str, array: np.ndarray, config: Mapping[str, Any], arch: str) -> dict[str, np.ndarray]:
    """The HF tensor(s) of one GGUF tensor: renamed, q/k un-permuted (llama arch), experts split."""
    base, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        raise ValueError(f"unexpected GGUF tensor {name!r}: expected a name ending in .weight or .bias")
    if base in _GLOBAL_NAMES:
        return {f"{_GLOBAL_NAMES[base]}.{kind}": array}
    parts = base.split(".")
    layer_names = _LAYER_NAMES[config["model_type"]]
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in layer_names:
        raise ValueError(f"unexpected GGUF tensor {name!r} in a {config['model_type']} checkpoint: expected "
                         f"{sorted(_GLOBAL_NAMES)} or blk.N.{{{', '.join(sorted(layer_names))}}}")
    layer, gguf_name = int(parts[1]), parts[2]
    if not 0 <= layer < config["num_hidden_layers"]:
        raise ValueError(f"GGUF tensor {name!r}: layer {layer} is outside the {config['num_hidden_layers']} "
                         "layers of the metadata")
    prefix = f"model.layers.{layer}."
    hf_name = layer_names[gguf_name]
    if "{}" in hf_name:  # stacked experts [experts, out, in]
        return {f"{prefix}{hf_name.format(e)}.{kind}": np.ascontiguousarray(array[e]) for e in range(len(array))}
    if arch == "llama" and gguf_name in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"] if gguf_name == "attn_q" else config["num_key_value_heads"]
        array = unpermute_rope_rows(array, heads)
    return {f"{prefix}{hf_name}.{kind}": array}
