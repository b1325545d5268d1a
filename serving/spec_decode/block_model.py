"""Block drafter (in the spirit of DFlash): k draft tokens in ONE forward pass, conditioned on the target's
hidden states.

A decoding sequence is ``x_0 .. x_a``: ``x_a`` is its newest token (the target's last output) and the target's
hidden states are known for the positions ``t < a``. The drafter is the target's top L layers (copied, then
fine-tuned) run on k new "slots" at positions ``a .. a + k - 1``, slot j standing for the unknown token at
``a + j - 1`` so that its output predicts ``x_{a+j}`` (the target's own convention):

    slots    z_j = h^{T-L}_{a-1} + fc([rms_norm(h^{T-L}_{a-1}) ; ... ; rms_norm(h^T_{a-1}) ; E[x_a]]) + m_j  [k, D]
    layer l  z += attention(z over [h^{T-L+l-1}_{a-W} .. h^{T-L+l-1}_{a-1} ; z]) ; z += swiglu(z)     l = 1 .. L
    logits_j = rms_norm(z_j) @ head                                                                    [k, V]

``h^i_t`` is the target's hidden state at position t after its layer i (``T``: its last; the final norm's
input). Drafter layer l starts as a copy of target layer ``T - L + l`` and its context is that layer's own input,
``h^{T-L+l-1}``, at the W positions before ``a``: at initialization its keys and values there are exactly the
target's (DFlash injects target features into every drafter layer's keys and values; here each layer gets the
target state it was trained on). Attention is pre-norm with RoPE, every slot sees every valid context entry and
every slot (no causal mask inside the block); context entries before the sequence start are masked. The slots
start from the last position's state at the depth the first copied layer reads, plus a learned mix of its
states and the newest token's embedding ``E``, plus a learned vector ``m_j`` per slot. ``E``, the head and (for
training) the target's final norm are the target's, frozen and shared. The drafter reads ``target_layers =
(T - L, .., T)``; ``draft_logits`` is the whole forward, ``spec_decode.block_drafter.BlockDrafter`` serves it and
``examples.train_drafter`` trains it. A checkpoint is a folder: ``drafter.safetensors`` (the drafter's own
weights) and ``drafter_config.json``.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from serving.config import ModelConfig
from serving.layers import apply_rope, rms_norm, swiglu
from serving.models import llama
from serving.models.llama import WeightSpec

CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "drafter.safetensors"
KIND = "block_drafter"  # the config's "kind": refuses other JSON files named like ours
MASKED = -1e30  # attention score of an invalid context entry (finite: a row never becomes NaN)


@dataclasses.dataclass(frozen=True)
class BlockDrafterConfig:
    """A block drafter for a target of hidden size ``hidden``, vocabulary ``vocab`` and ``target_depth`` layers.

    block: k, the tokens proposed per pass. window: W, the positions whose hidden states it reads. layers: L,
    copies of the target's top L layers.
    """

    hidden: int
    vocab: int
    target_depth: int
    block: int = 8
    window: int = 64
    layers: int = 2

    def __post_init__(self):
        for name in ("hidden", "vocab", "target_depth", "block", "window", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockDrafterConfig.{name} = {value!r}: expected an int >= 1")
        if self.layers >= self.target_depth:
            raise ValueError(f"BlockDrafterConfig.layers = {self.layers}: expected fewer than the target's "
                             f"{self.target_depth}")

    @classmethod
    def for_target(cls, target: ModelConfig, **kwargs: Any) -> "BlockDrafterConfig":
        return cls(hidden=target.hidden, vocab=target.vocab, target_depth=target.layers, **kwargs)

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target layers (1-based) after which the drafter reads hidden states: ``T - L .. T``, F = L + 1."""
        return tuple(range(self.target_depth - self.layers, self.target_depth + 1))

    def check_target(self, target: ModelConfig) -> None:
        """The drafter shares the target's embedding and head and reads its layers: sizes must match."""
        mine, theirs = (self.hidden, self.vocab, self.target_depth), (target.hidden, target.vocab, target.layers)
        if mine != theirs:
            raise ValueError(f"block drafter for (hidden, vocab, layers) = {mine}: the target has {theirs}")

    def layer_config(self, target: ModelConfig) -> ModelConfig:
        """The target's config with the drafter's depth: the geometry of each drafter layer."""
        self.check_target(target)
        return dataclasses.replace(target, layers=self.layers)


def layout(cfg: BlockDrafterConfig, target: ModelConfig) -> dict:
    """The drafter's own weights: ``fc [(F + 1) D, D]``, ``slots [k, D]``, ``ctx_norm [F, D]``, ``norm [D]`` and
    L layers shaped like the target's."""
    lcfg = cfg.layer_config(target)
    d, f = lcfg.hidden, len(cfg.target_layers)
    layers = [{"attn_norm": llama.norm(lcfg), "attn": llama.attention_layout(lcfg), "mlp_norm": llama.norm(lcfg),
               "mlp": llama.mlp_layout(lcfg)} for _ in range(cfg.layers)]
    return {"fc": WeightSpec(((f + 1) * d, d), P()), "slots": WeightSpec((cfg.block, d), P()),
            "ctx_norm": WeightSpec((f, d), P(), "ones"), "norm": llama.norm(lcfg), "layers": layers}


def init_params(cfg: BlockDrafterConfig, target: ModelConfig, key: jax.Array, target_params: dict | None = None,
                dtype: jnp.dtype = jnp.float32) -> dict:
    """Drafter weights: with ``target_params``, the layers and final norm copied from the target's top ones and
    the rest random (N(0, 0.02^2), norms at 1); without, all random (tests)."""
    params = llama.init_from_layout(layout(cfg, target), key, dtype)
    if target_params is not None:
        copy = lambda tree: jax.tree.map(lambda w: jnp.array(w, dtype), tree)  # own buffers (training donates them)
        params |= {"norm": copy(target_params["norm"]), "layers": copy(target_params["layers"][-cfg.layers:])}
    return params


def target_head(target_params: dict) -> dict:
    """The frozen pieces of the target: ``embed``, ``norm`` (the target's final one, for its own logits in
    training) and ``lm_head`` when untied."""
    return {name: target_params[name] for name in ("embed", "norm", "lm_head") if name in target_params}


def _attention(p: dict, cfg: ModelConfig, z: jax.Array, ctx: jax.Array, keys_valid: jax.Array,
               positions: jax.Array) -> jax.Array:
    """Slots ``z [B, k, D]`` attend over ``[ctx ; z]`` (``[B, W + k, D]``, ``keys_valid [B, W + k]``); returns
    ``[B, k, D]``. ``positions [B, W + k]`` rotate keys, their last k the queries."""
    b, k, _ = z.shape
    inputs = jnp.concatenate([ctx, z], axis=1)
    q = jnp.einsum("bkd,dhe->bkhe", z, p["q"])
    keys = jnp.einsum("bnd,dhe->bnhe", inputs, p["k"])
    values = jnp.einsum("bnd,dhe->bnhe", inputs, p["v"])
    inv_freq, scale = llama.rope_table(cfg)

    def rotate(x: jax.Array, pos: jax.Array) -> jax.Array:
        flat = apply_rope(x.reshape(-1, *x.shape[2:]), pos.reshape(-1), inv_freq, scale, cfg.rope.interleaved)
        return flat.reshape(x.shape)

    q, keys = rotate(q, positions[:, -k:]), rotate(keys, positions)
    kv_heads = cfg.kv_heads
    qg = q.reshape(b, k, kv_heads, cfg.heads // kv_heads, cfg.head_dim)  # [B, k, K, G, hd]
    scores = jnp.einsum("bqkgd,bnkd->bkgqn", qg, keys, preferred_element_type=jnp.float32) * cfg.head_dim**-0.5
    scores = jnp.where(keys_valid[:, None, None, None, :], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgqn,bnkd->bqkgd", probs, values).reshape(b, k, cfg.heads, cfg.head_dim)
    return jnp.einsum("bqhe,hed->bqd", out, p["o"])


def draft_logits(params: dict, head: dict, cfg: BlockDrafterConfig, target: ModelConfig, ctx_hidden: jax.Array,
                 newest: jax.Array, ctx_positions: jax.Array, ctx_valid: jax.Array) -> jax.Array:
    """The drafter's logits for the k tokens after each of B anchors (module docstring).

    Args:
      params: the drafter's weights (``init_params``); head: ``target_head(target params)``, whose dtype is the
        compute dtype.
      ctx_hidden: ``[B, W, F, D]`` the target's states after ``cfg.target_layers`` at W positions t < a, the last
        one at ``a - 1``; newest: ``[B]`` int32 ``x_a``; ctx_positions: ``[B, W]`` int32 ``t - a`` (in
        ``[-W, -1]``); ctx_valid: ``[B, W]`` bool (False: no such state, e.g. before the sequence start).
    Returns:
      ``[B, k, V]`` float32: row j predicts ``x_{a+1+j}``.
    """
    lcfg = cfg.layer_config(target)
    dtype = head["embed"].dtype
    params = jax.tree.map(lambda w: w.astype(dtype), params)
    ctx_hidden = ctx_hidden.astype(dtype)
    b, k = newest.shape[0], cfg.block
    last = ctx_hidden[:, -1]  # [B, F, D] at a - 1
    mixed = jnp.concatenate([rms_norm(last, params["ctx_norm"], lcfg.rms_eps).reshape(b, -1), head["embed"][newest]],
                            axis=-1) @ params["fc"]
    z = (last[:, 0] + mixed)[:, None] + params["slots"][None]  # [B, k, D]
    positions = jnp.concatenate([ctx_positions, jnp.broadcast_to(jnp.arange(k), (b, k))], axis=1)
    keys_valid = jnp.concatenate([ctx_valid, jnp.ones((b, k), bool)], axis=1)
    for l, lp in enumerate(params["layers"]):
        z = z + _attention(lp["attn"], lcfg, rms_norm(z, lp["attn_norm"], lcfg.rms_eps),
                           rms_norm(ctx_hidden[:, :, l], lp["attn_norm"], lcfg.rms_eps), keys_valid, positions)
        z = z + swiglu(rms_norm(z, lp["mlp_norm"], lcfg.rms_eps), **lp["mlp"])
    return llama.logits({**head, "norm": params["norm"]}, lcfg, z)


# --------------------------------------------------------------------------- checkpoint


def _named_leaves(tree, is_leaf=None) -> dict[str, object]:
    """``{"layers.0.attn.q": leaf, ...}`` of a params pytree, in leaf order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    name = lambda path: ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return {name(path): leaf for path, leaf in leaves}


def save(path: str | Path, cfg: BlockDrafterConfig, params: dict) -> Path:
    """Write the checkpoint folder ``path`` (created): weights (float32) and config. Returns the folder."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: np.asarray(w, np.float32) for name, w in _named_leaves(params).items()},
              str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps({"kind": KIND, **dataclasses.asdict(cfg)}, indent=2) + "\n")
    return folder


def load_config(path: str | Path) -> BlockDrafterConfig:
    """The ``BlockDrafterConfig`` of the checkpoint folder ``path``."""
    config_file = Path(path) / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"block drafter checkpoint {str(path)!r}: no {CONFIG_FILE} (expected a folder "
                                "written by examples.train_drafter)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.pop("kind", None) != KIND:
        raise ValueError(f"{config_file}: expected a JSON object with \"kind\": {KIND!r}")
    fields = {f.name for f in dataclasses.fields(BlockDrafterConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise ValueError(f"{config_file}: unknown keys {unknown}; expected keys among {sorted(fields)}")
    try:
        return BlockDrafterConfig(**raw)
    except TypeError as e:
        raise ValueError(f"{config_file}: {e} (expected keys {sorted(fields)})") from None


def load(path: str | Path, target: ModelConfig, dtype: jnp.dtype = jnp.float32) -> tuple[BlockDrafterConfig, dict]:
    """(config, params in ``dtype``) of the checkpoint folder ``path``, checked against the ``target`` config."""
    cfg = load_config(path)
    cfg.check_target(target)
    weights_file = Path(path) / WEIGHTS_FILE
    if not weights_file.is_file():
        raise FileNotFoundError(f"block drafter checkpoint {str(path)!r}: no {WEIGHTS_FILE}")
    tensors = load_file(str(weights_file))
    expected = _named_leaves(layout(cfg, target), is_leaf=llama.is_weight_spec)
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"{weights_file}: unexpected tensors {unexpected[:4]} for {cfg}")
    for name, w in expected.items():
        if name not in tensors or tensors[name].shape != w.shape:
            found = f"shape {list(tensors[name].shape)}" if name in tensors else "no tensor"
            raise ValueError(f"{weights_file}: {found} {name!r}, expected shape {list(w.shape)} for {cfg}")
    arrays = [jnp.asarray(tensors[name], dtype) for name in expected]
    return cfg, jax.tree.unflatten(jax.tree.structure(layout(cfg, target), is_leaf=llama.is_weight_spec), arrays)
