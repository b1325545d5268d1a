"""``ModelConfig``: one frozen, self-validating description of a decoder-only LLM, read from a HF config.json.

One dataclass covers every family the engine serves: Llama and Qwen3 (dense), Qwen3-MoE and Mixtral
(softmax-routed experts), DeepSeek-V3 (multi-head latent attention, sigmoid group-limited routing, shared
experts), GPT-OSS (softmax-routed experts with biases and a clamped SwiGLU, attention with biases and learned
sinks), Qwen3-VL-MoE (the Qwen3-MoE decoder with interleaved multimodal RoPE, ``mrope_section``, behind a ViT image
encoder described by ``VisionConfig``). Any of the standard-attention families may have sliding-window layers
(``layer_windows``). Fields a family does not use keep their neutral defaults (``num_experts=0``,
``kv_lora_rank=0``, ``vision=None``, ...). Being frozen and hashable, a config is a static argument to ``jax.jit``.

``from_hf`` reads every spelling transformers 4.x and 5.x write for these families: expert counts as
``num_experts`` or ``num_local_experts``, RoPE as ``rope_parameters`` or ``rope_theta`` + ``rope_scaling``
(``type`` or ``rope_type``), ``head_dim`` absent, null or not hidden / heads, sliding windows as
``layer_types`` or the older ``use_sliding_window`` / ``max_window_layers``; a vision-language config's decoder
from its ``text_config`` and its encoder from ``vision_config``. A key it cannot honour is a ValueError naming the
key.
"""

import dataclasses
from typing import Any

FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_vl_moe")
ROPE_KINDS = ("none", "linear", "llama3", "yarn")
ROUTERS = ("softmax", "sigmoid")

# HF `architectures[0]` (or `model_type` when a config has no architectures) -> our family.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
}
HF_MODEL_TYPES = {family: family for family in FAMILIES}
# HF layer_types entries -> whether the layer attends through a sliding window.
HF_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}
# quantization_config.quant_method of the checkpoints `python -m serving quantize` writes (loaders/quantized.py).
QUANT_METHOD = "apex_jax"
FP8_BLOCKS_METHOD = "fp8"  # the published block-scaled fp8 checkpoints' quant_method (loaders/fp8_blocks.py)
# GPT-OSS's SwiGLU constants when a config does not name them (transformers' GptOssConfig defaults).
GPT_OSS_SWIGLU_ALPHA = 1.702
GPT_OSS_SWIGLU_LIMIT = 7.0

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
        _check_numbers(self, "rope.")
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
class VisionConfig:
    """A Qwen3-VL ViT image encoder and the token ids that place its output in a prompt.

    Pixels come as patches of ``in_channels x temporal_patch_size x patch_size x patch_size`` values (a still image
    repeats its frame over the temporal patch); ``depth`` pre-LayerNorm blocks of width ``hidden`` (``heads`` heads,
    2D RoPE over each patch's (row, column), a GELU MLP of width ``intermediate``) plus a learned position table
    of ``num_position_embeddings`` (a square grid, bilinearly resampled to each image's grid); the merger maps each
    ``spatial_merge_size``^2 block of patches to one decoder token of width ``out_hidden``, and one more merger per
    ``deepstack_layers`` entry maps that block's output to features added to decoder layer i's output (DeepStack).
    """

    depth: int
    hidden: int
    intermediate: int
    heads: int
    out_hidden: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    deepstack_layers: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6  # the LayerNorms' (HF fixes it at 1e-6)
    image_token_id: int = 0
    vision_start_token_id: int = 0
    vision_end_token_id: int = 0

    def __post_init__(self):
        _check_numbers(self, "vision.")
        for name in ("depth", "hidden", "intermediate", "heads", "out_hidden", "patch_size", "temporal_patch_size",
                     "spatial_merge_size", "in_channels", "num_position_embeddings"):
            _check(getattr(self, name) > 0, f"vision.{name}", getattr(self, name), "> 0")
        _check(self.hidden % self.heads == 0 and (self.hidden // self.heads) % 4 == 0, "vision.heads", self.heads,
               f"a divisor of hidden={self.hidden} leaving a head dim divisible by 4 (2D RoPE over row and column)")
        side = round(self.num_position_embeddings ** 0.5)
        _check(side * side == self.num_position_embeddings, "vision.num_position_embeddings",
               self.num_position_embeddings, "a square (the learned position grid)")
        _check(isinstance(self.deepstack_layers, tuple) and all(0 <= l < self.depth for l in self.deepstack_layers),
               "vision.deepstack_layers", self.deepstack_layers, f"a tuple of block indices in [0, {self.depth})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: ``in_channels * temporal_patch_size * patch_size^2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per decoder token: ``spatial_merge_size^2``."""
        return self.spatial_merge_size ** 2


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
    # Per-layer sliding window W (a query at position p sees keys at positions > p - W); 0: full causal attention.
    # () : every layer full.
    layer_windows: tuple[int, ...] = ()
    attention_bias: bool = False  # q/k/v/o projections with biases (GPT-OSS)
    attention_sinks: bool = False  # a learned logit per head joins each softmax's denominator (GPT-OSS)
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
    # Clamped SwiGLU of the experts (GPT-OSS; 0: plain SwiGLU): gate <= L, |up| <= L,
    # out = (up + 1) * gate * sigmoid(alpha * gate).
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    # Multi-head latent attention (kv_lora_rank == 0: standard attention).
    q_lora_rank: int = 0  # 0: q projected directly from the hidden state
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Multimodal RoPE (Qwen3-VL; () : plain RoPE): rotary frequency i turns with a token's temporal, height or width
    # position, interleaved t, h, w, t, h, w, ... with sections[1] and sections[2] frequencies for h and w
    # (``layers.mrope_axes``). Text tokens have equal positions on the three axes (plain RoPE).
    mrope_section: tuple[int, ...] = ()
    vision: VisionConfig | None = None  # the image encoder of a vision-language model

    def __post_init__(self):
        _check_numbers(self, "")
        _check(self.family in FAMILIES, "family", self.family, f"one of {FAMILIES}")
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "max_position"):
            _check(getattr(self, name) > 0, name, getattr(self, name), "> 0")
        _check(self.heads % self.kv_heads == 0, "kv_heads", self.kv_heads, f"a divisor of heads={self.heads}")
        _check(self.rms_eps > 0, "rms_eps", self.rms_eps, "> 0")
        _check(isinstance(self.rope, RopeConfig), "rope", self.rope, "a RopeConfig")
        _check(isinstance(self.mlp_only_layers, tuple), "mlp_only_layers", self.mlp_only_layers, "a tuple")
        _check(isinstance(self.layer_windows, tuple) and len(self.layer_windows) in (0, self.layers)
               and all(isinstance(w, int) and w >= 0 for w in self.layer_windows), "layer_windows",
               self.layer_windows, f"() or {self.layers} ints >= 0 (0: full attention)")
        if self.is_mla:
            _check(not self.layer_windows and not self.attention_sinks and not self.attention_bias,
                   "layer_windows/attention_sinks/attention_bias",
                   (self.layer_windows, self.attention_sinks, self.attention_bias),
                   "unset with latent attention (kv_lora_rank > 0)")
        _check(self.swiglu_limit >= 0 and (self.swiglu_limit == 0 or self.swiglu_alpha > 0), "swiglu_limit",
               (self.swiglu_limit, self.swiglu_alpha), "0 (plain SwiGLU) or > 0 with swiglu_alpha > 0")
        if self.is_mla:
            _check(self.qk_nope_head_dim > 0 and self.qk_rope_head_dim > 0 and self.v_head_dim > 0,
                   "qk_nope_head_dim/qk_rope_head_dim/v_head_dim",
                   (self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim), "all > 0 with kv_lora_rank > 0")
            _check(self.head_dim == self.qk_nope_head_dim + self.qk_rope_head_dim, "head_dim", self.head_dim,
                   f"qk_nope_head_dim + qk_rope_head_dim = {self.qk_nope_head_dim + self.qk_rope_head_dim}")
        _check(self.q_lora_rank >= 0, "q_lora_rank", self.q_lora_rank, ">= 0")
        _check(self.rope_dim % 2 == 0, "rope dim", self.rope_dim, "even")
        if self.mrope_section:
            _check(len(self.mrope_section) == 3 and sum(self.mrope_section) == self.rope_dim // 2, "mrope_section",
                   self.mrope_section, f"3 frequency counts (t, h, w) summing to rope dim / 2 = {self.rope_dim // 2}")
        _check(self.vision is None or isinstance(self.vision, VisionConfig), "vision", self.vision,
               "None or a VisionConfig")
        if self.vision is not None:
            _check(self.vision.out_hidden == self.hidden, "vision.out_hidden", self.vision.out_hidden,
                   f"the decoder's hidden={self.hidden}")
            _check(len(self.vision.deepstack_layers) <= self.layers, "vision.deepstack_layers",
                   self.vision.deepstack_layers, f"at most layers={self.layers} entries (one per decoder layer)")
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

    def window(self, layer: int) -> int:
        """Sliding window of decoder layer ``layer`` (0: full causal attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a routed-expert MLP (else a dense SwiGLU of size ``intermediate``)."""
        return (self.num_experts > 0 and layer >= self.first_k_dense and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "ModelConfig":
        """Read a HF ``config.json`` dict (the models of ``HF_ARCHITECTURES``, as transformers 4.x or 5.x writes
        them; module docstring)."""
        family = _hf_family(config)
        vision = None
        if family == "qwen3_vl_moe":
            vision = _hf_vision(config)
            # The decoder's keys are the text_config's; the output head is tied as the top level says.
            config = {**_require(config, "text_config"), "architectures": config.get("architectures"),
                      "model_type": family, "tie_word_embeddings": config.get("tie_word_embeddings", False)}
        heads = _require(config, "num_attention_heads")
        hidden = _require(config, "hidden_size")
        layers = _require(config, "num_hidden_layers")
        _reject_unsupported(config, family)
        fields = dict(
            family=family,
            vocab=_require(config, "vocab_size"),
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate=_require(config, "intermediate_size"),
            rms_eps=_require(config, "rms_norm_eps"),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position=config.get("max_position_embeddings", cls.max_position),
            rope=_hf_rope(config, family),
            layer_windows=_hf_windows(config, family, layers),
        )
        if family == "qwen3":
            fields.update(qk_norm=True)
        elif family in ("qwen3_moe", "qwen3_vl_moe"):
            fields.update(
                qk_norm=True,
                num_experts=_require_any(config, "num_experts", "num_local_experts"),
                top_k=_require(config, "num_experts_per_tok"),
                moe_intermediate=_require(config, "moe_intermediate_size"),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                decoder_sparse_step=config.get("decoder_sparse_step") or 1,
                mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            )
            if family == "qwen3_vl_moe":
                # Its router always renormalizes the top-k weights (no norm_topk_prob key).
                fields.update(vision=vision, mrope_section=_hf_mrope(config), norm_topk_prob=True)
        elif family == "mixtral":
            fields.update(
                num_experts=_require_any(config, "num_local_experts", "num_experts"),
                top_k=_require(config, "num_experts_per_tok"),
                moe_intermediate=fields["intermediate"],
                norm_topk_prob=True,  # Mixtral always renormalizes its top-k softmax weights
            )
        elif family == "gpt_oss":
            fields.update(
                attention_bias=bool(config.get("attention_bias", True)),
                attention_sinks=True,
                num_experts=_require_any(config, "num_local_experts", "num_experts"),
                top_k=_require(config, "num_experts_per_tok"),
                moe_intermediate=fields["intermediate"],
                norm_topk_prob=True,  # softmax over the k chosen (biased) router logits
                swiglu_limit=float(config.get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT)),
                swiglu_alpha=float(config.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)),
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


def _number(value: Any) -> Any:
    """A config.json number as a float; anything else as it is, for the config's checks to refuse by name (a
    string such as "1e6" is not read as a number)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


_NUMBER_TYPES = {int: (int,), float: (int, float), float | None: (int, float, type(None))}  # annotation: accepted


def _check_numbers(config: Any, prefix: str) -> None:
    """Each ``int`` field of the dataclass ``config`` holds an int and each ``float`` field a number (bools are
    neither), before any comparison: a config.json with ``"num_hidden_layers": "2"`` gets a ValueError naming the
    field, not a TypeError from inside the checks."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        kinds = _NUMBER_TYPES.get(field.type)
        if kinds is not None:
            _check(isinstance(value, kinds) and not isinstance(value, bool), prefix + field.name, value,
                   "an int" if kinds == (int,) else "a number")


def _require(config: dict[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ValueError(f"config.json has no {key!r} (needed for {_hf_family(config)})")
    return config[key]


def _require_any(config: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` the config sets (transformers versions spell some keys differently)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise ValueError(f"config.json has none of {list(keys)} (needed for {_hf_family(config)})")


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
        if config.get(key) and not (family == "gpt_oss" and key == "attention_bias"):
            raise ValueError(f"config.json {key} = {config[key]!r}: biases are not supported for {family} "
                             "(expected false)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act = {act!r}: only 'silu' (SwiGLU) is supported")
    quant = config.get("quantization_config")
    # mxfp4 and block-scaled fp8: dequantized at load
    readable = (QUANT_METHOD, FP8_BLOCKS_METHOD, "mxfp4") if family == "gpt_oss" else (QUANT_METHOD, FP8_BLOCKS_METHOD)
    if quant is not None and quant.get("quant_method") not in readable:
        raise ValueError(f"config.json quantization_config.quant_method = {quant.get('quant_method')!r}: only "
                         f"unquantized checkpoints and quant_method in {list(readable)} load for {family}; "
                         "expected no quantization_config (dequantize the checkpoint first)")
    if family == "deepseek_v3":
        for key, expected in (("moe_layer_freq", 1), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if config.get(key, expected) != expected:
                raise ValueError(f"config.json {key} = {config[key]!r}: expected {expected!r}")


def _hf_vision(config: dict[str, Any]) -> VisionConfig:
    """A Qwen3-VL ``vision_config`` (and the top-level image token ids) -> ``VisionConfig``."""
    vision = _require(config, "vision_config")

    def need(key: str) -> Any:
        if vision.get(key) is None:
            raise ValueError(f"config.json vision_config has no {key!r} (needed for qwen3_vl_moe)")
        return vision[key]

    act = vision.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"config.json vision_config hidden_act = {act!r}: only 'gelu_pytorch_tanh' is supported")
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"config.json vision_config rope_parameters rope_type = {rope['rope_type']!r}: expected "
                         "'axial'")
    sizes = {key: need(key) for key in ("patch_size", "temporal_patch_size")}
    for key, size in sizes.items():
        if not isinstance(size, int):
            raise ValueError(f"config.json vision_config {key} = {size!r}: expected one int (square patches)")
    return VisionConfig(
        depth=need("depth"), hidden=need("hidden_size"), intermediate=need("intermediate_size"),
        heads=need("num_heads"), out_hidden=need("out_hidden_size"), **sizes,
        spatial_merge_size=need("spatial_merge_size"), in_channels=vision.get("in_channels", 3),
        num_position_embeddings=need("num_position_embeddings"),
        deepstack_layers=tuple(vision.get("deepstack_visual_indexes") or ()),
        rope_theta=float(rope.get("rope_theta", 10000.0)), image_token_id=_require(config, "image_token_id"),
        vision_start_token_id=_require(config, "vision_start_token_id"),
        vision_end_token_id=_require(config, "vision_end_token_id"))


def _hf_mrope(config: dict[str, Any]) -> tuple[int, ...]:
    """Qwen3-VL's ``rope_parameters.mrope_section`` (interleaved; transformers' default [24, 20, 20])."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if params.get("mrope_interleaved") is False:
        raise ValueError("config.json rope_parameters mrope_interleaved = false: only Qwen3-VL's interleaved "
                         "multimodal RoPE is supported (expected true)")
    return tuple(params.get("mrope_section") or (24, 20, 20))


def _hf_windows(config: dict[str, Any], family: str, layers: int) -> tuple[int, ...]:
    """Per-layer sliding windows (0: full attention) as transformers applies them.

    ``layer_types`` (transformers >= 4.56: "sliding_attention" / "full_attention" per layer) where the family
    reads it (Qwen3, GPT-OSS), else: Mixtral slides every layer when ``sliding_window`` is set, Qwen3-MoE when
    ``use_sliding_window`` is also true, Qwen3 the layers >= ``max_window_layers`` when ``use_sliding_window``,
    GPT-OSS the even layers. A window at least the context changes nothing and is kept as it is.
    """
    window = config.get("sliding_window") or 0
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"config.json sliding_window = {window!r}: expected null or an int >= 0")
    if family in ("qwen3", "qwen3_moe", "qwen3_vl_moe") and not config.get("use_sliding_window"):
        window = 0  # transformers drops the window of a Qwen3 config without use_sliding_window
    types = config.get("layer_types")
    if family in ("llama", "deepseek_v3"):
        if types and any(t != "full_attention" for t in types):
            raise ValueError(f"config.json layer_types = {types!r}: {family} layers are all 'full_attention'")
        return ()
    if family in ("mixtral", "qwen3_moe", "qwen3_vl_moe"):
        return (window,) * layers if window else ()
    if types is not None:
        if len(types) != layers or any(t not in HF_LAYER_TYPES for t in types):
            raise ValueError(f"config.json layer_types = {types!r}: expected {layers} (num_hidden_layers) entries "
                             f"from {list(HF_LAYER_TYPES)}")
        sliding = [HF_LAYER_TYPES[t] for t in types]
    elif family == "qwen3":
        first = config.get("max_window_layers") or 0
        sliding = [l >= first for l in range(layers)]
    else:  # gpt_oss
        sliding = [l % 2 == 0 for l in range(layers)]
    windows = tuple(window if s else 0 for s in sliding)
    return windows if any(windows) else ()


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
    fields: dict[str, Any] = dict(theta=_number(theta), kind=kind,
                                  interleaved=family == "deepseek_v3" and config.get("rope_interleave", True))
    original = params.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None and kind == "yarn" and params.get("original_max_position_embeddings"):
        factor = config.get("max_position_embeddings", 0) / original  # as transformers does for DeepSeek-V3
    if kind != "none":
        if factor is None:
            raise ValueError(f"config.json {source} has no 'factor' (needed for {hf_kind} scaling)")
        fields["factor"] = _number(factor)
    if kind == "llama3":
        fields.update(original_max_position=original, low_freq_factor=_number(params.get("low_freq_factor", 1.0)),
                      high_freq_factor=_number(params.get("high_freq_factor", 4.0)))
    elif kind == "yarn":
        # As in transformers: a missing or 0 beta takes its default (`x or default`); mscale 0 means unset.
        fields.update(original_max_position=original, beta_fast=_number(params.get("beta_fast") or 32.0),
                      beta_slow=_number(params.get("beta_slow") or 1.0), mscale=_number(params.get("mscale") or 0.0),
                      mscale_all_dim=_number(params.get("mscale_all_dim") or 0.0),
                      attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))
    return RopeConfig(**fields)
