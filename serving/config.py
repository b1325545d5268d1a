"""``ModelConfig``: one frozen, self-validating description of a decoder-only LLM, read from a HF config.json.

One dataclass covers every family the engine serves: Llama (dense), Qwen3-MoE and Mixtral (softmax-routed
experts), DeepSeek-V3 (multi-head latent attention, sigmoid group-limited routing, shared experts). Fields a
family does not use keep their neutral defaults (``num_experts=0``, ``kv_lora_rank=0``, ...). Being frozen
and hashable, a config is a static argument to ``jax.jit``.
"""

import dataclasses
from typing import Any

FAMILIES = ("llama", "qwen3_moe", "mixtral", "deepseek_v3")
ROPE_KINDS = ("none", "linear", "llama3", "yarn")
ROUTERS = ("softmax", "sigmoid")

# HF `architectures[0]` (or `model_type` when a config has no architectures) -> our family.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
HF_MODEL_TYPES = {"llama": "llama", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "deepseek_v3": "deepseek_v3"}

# HF rope_type names -> ours ("default" is plain RoPE).
HF_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base ``theta`` and an optional frequency scaling.

    kind: ``none`` (plain RoPE), ``linear`` (position interpolation: every frequency / factor), ``llama3``
    (low frequencies / factor, high ones kept, a smooth ramp between), ``yarn`` (per-dimension blend of
    interpolation and extrapolation, plus an attention temperature ``mscale``). See ``layers.rope_frequencies``.
    ``interleaved``: rotate pairs (x[2i], x[2i+1]) instead of halves (x[i], x[i + d/2]) (DeepSeek-V3).
    """

    theta: float = 10000.0
    kind: str = "none"
    factor: float = 1.0
    original_max_position: int = 0  # context length the model was trained at (llama3, yarn)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: rotations per context above which a dimension is extrapolated
    beta_slow: float = 1.0  # yarn: rotations per context below which a dimension is interpolated
    mscale: float = 0.0  # yarn: cos/sin temperature coefficient, used only with mscale_all_dim (0: unset)
    mscale_all_dim: float = 0.0  # yarn (DeepSeek): coefficient divided out of cos/sin, squared into the softmax scale
    attention_factor: float | None = None  # yarn: explicit cos/sin factor, overriding mscale / mscale_all_dim
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    interleaved: bool = False

    def __post_init__(self):
        _check(self.kind in ROPE_KINDS, "rope.kind", self.kind, f"one of {ROPE_KINDS}")
        _check(self.theta > 0, "rope.theta", self.theta, "> 0")
        _check(self.factor > 0, "rope.factor", self.factor, "> 0")
        if self.kind in ("llama3", "yarn"):
            _check(self.original_max_position > 0, "rope.original_max_position", self.original_max_position,
                   f"> 0 for {self.kind} scaling")
        if self.kind == "llama3":
            _check(self.high_freq_factor > self.low_freq_factor, "rope.high_freq_factor", self.high_freq_factor,
                   f"> low_freq_factor={self.low_freq_factor}")
        if self.kind == "yarn":
            _check(self.attention_factor is None or self.attention_factor > 0, "rope.attention_factor",
                   self.attention_factor, "None or > 0")
            _check(self.beta_fast > self.beta_slow > 0, "rope.beta_fast", self.beta_fast,
                   f"> beta_slow={self.beta_slow} > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyperparameters of one model. Dims: ``hidden`` = D, ``heads`` = H, ``kv_heads`` = K."""

    family: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int  # q/k per-head dim (MLA: qk_nope_head_dim + qk_rope_head_dim)
    intermediate: int  # dense SwiGLU hidden size
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    max_position: int = 4096
    rope: RopeConfig = dataclasses.field(default_factory=lambda: RopeConfig())
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    # Mixture of experts (num_experts == 0: every layer dense).
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0  # per-expert SwiGLU hidden size
    norm_topk_prob: bool = False  # renormalize the top-k gate weights to sum to 1
    num_shared_experts: int = 0  # always-on experts of size moe_intermediate each, run as one dense MLP
    router: str = "softmax"  # softmax over all experts, or sigmoid scores (DeepSeek-V3)
    n_group: int = 1  # sigmoid router: experts form n_group groups ...
    topk_group: int = 1  # ... and only the topk_group best groups may be picked
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' gate weights
    first_k_dense: int = 0  # the first k layers are dense (DeepSeek)
    decoder_sparse_step: int = 1  # layer l is MoE when (l + 1) % step == 0 (Qwen3-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # layers forced dense (Qwen3-MoE)
    # Multi-head latent attention (kv_lora_rank == 0: standard attention).
    q_lora_rank: int = 0  # 0: q projected directly from the hidden state
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        _check(self.family in FAMILIES, "family", self.family, f"one of {FAMILIES}")
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "max_position"):
            _check(getattr(self, name) > 0, name, getattr(self, name), "> 0")
        _check(self.heads % self.kv_heads == 0, "kv_heads", self.kv_heads, f"a divisor of heads={self.heads}")
        _check(self.rms_eps > 0, "rms_eps", self.rms_eps, "> 0")
        _check(isinstance(self.rope, RopeConfig), "rope", self.rope, "a RopeConfig")
        _check(isinstance(self.mlp_only_layers, tuple), "mlp_only_layers", self.mlp_only_layers, "a tuple")
        if self.is_mla:
            _check(self.qk_nope_head_dim > 0 and self.qk_rope_head_dim > 0 and self.v_head_dim > 0,
                   "qk_nope_head_dim/qk_rope_head_dim/v_head_dim",
                   (self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim), "all > 0 with kv_lora_rank > 0")
            _check(self.head_dim == self.qk_nope_head_dim + self.qk_rope_head_dim, "head_dim", self.head_dim,
                   f"qk_nope_head_dim + qk_rope_head_dim = {self.qk_nope_head_dim + self.qk_rope_head_dim}")
        _check(self.q_lora_rank >= 0, "q_lora_rank", self.q_lora_rank, ">= 0")
        _check(self.rope_dim % 2 == 0, "rope dim", self.rope_dim, "even")
        if self.num_experts == 0:
            return
        _check(self.num_experts > 0, "num_experts", self.num_experts, ">= 0")
        _check(0 < self.top_k <= self.num_experts, "top_k", self.top_k, f"in [1, num_experts={self.num_experts}]")
        _check(self.moe_intermediate > 0, "moe_intermediate", self.moe_intermediate, "> 0 when num_experts > 0")
        _check(self.router in ROUTERS, "router", self.router, f"one of {ROUTERS}")
        _check(self.n_group > 0 and self.num_experts % self.n_group == 0, "n_group", self.n_group,
               f"a divisor of num_experts={self.num_experts}")
        _check(0 < self.topk_group <= self.n_group, "topk_group", self.topk_group, f"in [1, n_group={self.n_group}]")
        if self.router == "softmax":
            _check(self.n_group == 1, "n_group", self.n_group, "1 with the softmax router (group limits: sigmoid)")
        experts_in_groups = self.topk_group * self.num_experts // self.n_group
        _check(self.top_k <= experts_in_groups, "top_k", self.top_k,
               f"<= the {experts_in_groups} experts in topk_group={self.topk_group} groups")
        _check(self.decoder_sparse_step > 0, "decoder_sparse_step", self.decoder_sparse_step, "> 0")
        _check(self.first_k_dense >= 0, "first_k_dense", self.first_k_dense, ">= 0")
        bad = [l for l in self.mlp_only_layers if not 0 <= l < self.layers]
        _check(not bad, "mlp_only_layers", self.mlp_only_layers, f"layer indices in [0, {self.layers})")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek)."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Dims of each q/k head that RoPE rotates: all of them, or MLA's qk_rope_head_dim."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a routed-expert MLP (else a dense SwiGLU of size ``intermediate``)."""
        return (self.num_experts > 0 and layer >= self.first_k_dense and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "ModelConfig":
        """Read a HF Hub ``config.json`` dict (Llama, Qwen3-MoE, Mixtral or DeepSeek-V3 causal LMs)."""
        family = _hf_family(config)
        heads = _require(config, "num_attention_heads")
        hidden = _require(config, "hidden_size")
        _reject_unsupported(config, family)
        fields = dict(
            family=family,
            vocab=_require(config, "vocab_size"),
            hidden=hidden,
            layers=_require(config, "num_hidden_layers"),
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate=_require(config, "intermediate_size"),
            rms_eps=_require(config, "rms_norm_eps"),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position=config.get("max_position_embeddings", cls.max_position),
            rope=_hf_rope(config, family),
        )
        if family == "qwen3_moe":
            fields.update(
                qk_norm=True,
                num_experts=_require(config, "num_experts"),
                top_k=_require(config, "num_experts_per_tok"),
                moe_intermediate=_require(config, "moe_intermediate_size"),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                decoder_sparse_step=config.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            )
        elif family == "mixtral":
            fields.update(
                num_experts=_require(config, "num_local_experts"),
                top_k=_require(config, "num_experts_per_tok"),
                moe_intermediate=fields["intermediate"],
                norm_topk_prob=True,  # Mixtral always renormalizes its top-k softmax weights
            )
        elif family == "deepseek_v3":
            qk_nope, qk_rope = _require(config, "qk_nope_head_dim"), _require(config, "qk_rope_head_dim")
            fields.update(
                head_dim=qk_nope + qk_rope,
                num_experts=_require(config, "n_routed_experts"),
                top_k=_require(config, "num_experts_per_tok"),
                moe_intermediate=_require(config, "moe_intermediate_size"),
                norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                num_shared_experts=config.get("n_shared_experts") or 0,
                router="sigmoid",
                n_group=config.get("n_group") or 1,
                topk_group=config.get("topk_group") or 1,
                routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                first_k_dense=config.get("first_k_dense_replace", 0),
                q_lora_rank=config.get("q_lora_rank") or 0,
                kv_lora_rank=_require(config, "kv_lora_rank"),
                qk_nope_head_dim=qk_nope,
                qk_rope_head_dim=qk_rope,
                v_head_dim=_require(config, "v_head_dim"),
            )
        return cls(**fields)


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"ModelConfig.{name} = {value!r}: expected {expected}")


def _require(config: dict[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ValueError(f"config.json has no {key!r} (needed for {_hf_family(config)})")
    return config[key]


def _hf_family(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    if archs:
        if archs[0] not in HF_ARCHITECTURES:
            raise ValueError(f"config.json architectures = {archs!r}: expected one of {list(HF_ARCHITECTURES)}")
        return HF_ARCHITECTURES[archs[0]]
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"config.json has no architectures and model_type = {model_type!r}: expected one of "
                         f"{list(HF_MODEL_TYPES)}")
    return HF_MODEL_TYPES[model_type]


def _reject_unsupported(config: dict[str, Any], family: str) -> None:
    """Features these families can have that the engine does not implement: refuse rather than run them wrong."""
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"config.json {key} = {config[key]!r}: biases are not supported (expected false)")
    window = config.get("sliding_window")
    if window is not None and (family == "mixtral" or config.get("use_sliding_window")):
        raise ValueError(f"config.json sliding_window = {window!r}: sliding-window attention is not supported "
                         "(expected null)")
    if family == "deepseek_v3":
        for key, expected in (("moe_layer_freq", 1), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if config.get(key, expected) != expected:
                raise ValueError(f"config.json {key} = {config[key]!r}: expected {expected!r}")


def _hf_rope(config: dict[str, Any], family: str) -> RopeConfig:
    """RoPE from ``rope_parameters`` (transformers >= 4.57) or ``rope_theta`` + ``rope_scaling`` (older)."""
    params = config.get("rope_parameters")
    if params is not None:
        source = "rope_parameters"
        theta = params.get("rope_theta", config.get("rope_theta"))
    else:
        source = "rope_scaling"
        params = config.get("rope_scaling") or {}
        theta = config.get("rope_theta")
    if theta is None:
        raise ValueError(f"config.json has no rope_theta (neither top-level nor in {source})")
    hf_kind = params.get("rope_type", params.get("type", "default"))
    if hf_kind not in HF_ROPE_TYPES:
        raise ValueError(f"config.json {source} rope_type = {hf_kind!r}: expected one of {list(HF_ROPE_TYPES)}")
    kind = HF_ROPE_TYPES[hf_kind]
    fields: dict[str, Any] = dict(theta=float(theta), kind=kind,
                                  interleaved=family == "deepseek_v3" and config.get("rope_interleave", True))
    original = params.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None and kind == "yarn" and params.get("original_max_position_embeddings"):
        factor = config.get("max_position_embeddings", 0) / original  # as transformers does for DeepSeek-V3
    if kind != "none":
        if factor is None:
            raise ValueError(f"config.json {source} has no 'factor' (needed for {hf_kind} scaling)")
        fields["factor"] = float(factor)
    if kind == "llama3":
        fields.update(original_max_position=original, low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                      high_freq_factor=float(params.get("high_freq_factor", 4.0)))
    elif kind == "yarn":
        # As in transformers: a missing or 0 beta takes its default (`x or default`); mscale 0 means unset.
        fields.update(original_max_position=original, beta_fast=float(params.get("beta_fast") or 32.0),
                      beta_slow=float(params.get("beta_slow") or 1.0), mscale=float(params.get("mscale") or 0.0),
                      mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                      attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))
    return RopeConfig(**fields)
