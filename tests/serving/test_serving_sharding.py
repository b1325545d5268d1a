"""Expert-parallel MoE (serving/sharding.py) against ``layers.moe`` on 8 CPU devices, and the HF fixture models on
a (data=2, expert=4) mesh against one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF
from jax.sharding import AxisType, NamedSharding

from pallas_kernels.testing import RTOL, assert_close
from serving import layers, sharding
from serving.config import ModelConfig
from serving.kv_cache import PagedKV, PagedLatentKV, SeqChunk, make_batch
from serving.loaders import read_checkpoint
from serving.models import model_module

pytestmark = pytest.mark.needs_devices(8)

NUM_TOKENS, NUM_VALID = 13, 10  # not a multiple of any token split > 1 (exercises the padding), 3 padding tokens
EXPERTS, HIDDEN, MOE_HIDDEN = 8, 32, 16
# (data, tensor, expert): every expert-axis size, and data/tensor axes beside it.
MESHES = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 1, 8), (2, 1, 4), (2, 2, 2), (1, 2, 4)]
SKEW = 100.0  # router logit boost (logits are ~N(0, 32) without it): every token picks the boosted experts
BLOCK, NUM_BLOCKS, MAX_BLOCKS, BUCKET = 4, 16, 4, 24  # the fixture prompts (19 tokens) in one padded batch


def config(**overrides) -> ModelConfig:
    fields = dict(family="qwen3_moe", vocab=64, hidden=HIDDEN, layers=1, heads=4, kv_heads=2, head_dim=8,
                  intermediate=48, num_experts=EXPERTS, top_k=2, moe_intermediate=MOE_HIDDEN, norm_topk_prob=True)
    return ModelConfig(**{**fields, **overrides})


def random_moe(seed: int, dtype=jnp.float32, experts: int = EXPERTS) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x ``[NUM_TOKENS, D]`` and MoE weights whose SwiGLU outputs are O(1) (numpy draws: nothing to compile)."""
    rng = np.random.default_rng(seed)
    params = {"router": rng.standard_normal((HIDDEN, experts)),
              "gate": rng.standard_normal((experts, HIDDEN, MOE_HIDDEN)) / HIDDEN**0.5,
              "up": rng.standard_normal((experts, HIDDEN, MOE_HIDDEN)) / HIDDEN**0.5,
              "down": rng.standard_normal((experts, MOE_HIDDEN, HIDDEN)) / MOE_HIDDEN**0.5}
    x = rng.standard_normal((NUM_TOKENS, HIDDEN))
    return jnp.asarray(x, dtype), {k: jnp.asarray(v, dtype) for k, v in params.items()}


reference_moe = jax.jit(layers.moe, static_argnums=2)


def mesh_of(data: int, tensor: int, expert: int) -> jax.sharding.Mesh:
    return sharding.make_mesh(data, tensor, expert, devices=jax.devices()[:data * tensor * expert])


def check_against_layers_moe(x, params, cfg, mesh, rtol: float | None = None) -> np.ndarray:
    """Expert-parallel y on the valid tokens close to ``layers.moe``'s, 0 on padding, same counts; returns counts."""
    valid = jnp.arange(NUM_TOKENS) < NUM_VALID
    want_y, want_counts = reference_moe(x, params, cfg, valid)
    y, counts = jax.jit(functools.partial(sharding.moe_expert_parallel, cfg=cfg, mesh=mesh))(x, params, valid=valid)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y[:NUM_VALID], want_y[:NUM_VALID], rtol=rtol, name=f"y on mesh {dict(mesh.shape)}")
    np.testing.assert_array_equal(np.asarray(y[NUM_VALID:], np.float32), 0.0)
    np.testing.assert_array_equal(counts, want_counts)
    assert int(counts.sum()) == NUM_VALID * cfg.top_k
    return np.asarray(counts)


# --------------------------------------------------------------------------- against layers.moe


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "data{}-tensor{}-expert{}".format(*a))
def test_matches_layers_moe_on_every_mesh(axes):
    x, params = random_moe(0)
    check_against_layers_moe(x, params, config(), mesh_of(*axes))


@pytest.mark.parametrize("axes", [(1, 1, 8), (2, 1, 4)])
def test_skewed_routing_drops_no_token(axes):
    """Every token picks experts 0 and 1: one device receives every row of every device (a full buffer)."""
    x, params = random_moe(1)
    x = x.at[:, 0].set(1.0)  # a constant feature: router row 0 adds the same logits to every token
    params["router"] = params["router"].at[0, :2].add(SKEW)
    counts = check_against_layers_moe(x, params, config(), mesh_of(*axes))
    np.testing.assert_array_equal(counts, [NUM_VALID, NUM_VALID] + [0] * (EXPERTS - 2))


def test_sigmoid_router_with_bias_and_groups():
    """DeepSeek-V3 routing: the replicated router_bias and group-limited top-k take the same path."""
    cfg = config(router="sigmoid", n_group=4, topk_group=2, top_k=3, routed_scaling_factor=2.5)
    x, params = random_moe(2)
    params["router_bias"] = jnp.asarray(np.random.default_rng(3).standard_normal(EXPERTS), jnp.float32)
    check_against_layers_moe(x, params, cfg, mesh_of(2, 1, 4))


def test_bf16_on_a_tensor_split_mesh():
    x, params = random_moe(4, jnp.bfloat16)
    check_against_layers_moe(x, params, config(), mesh_of(2, 2, 2), rtol=RTOL[jnp.dtype(jnp.bfloat16)])


def test_all_tokens_valid_by_default():
    x, params = random_moe(5)
    cfg, mesh = config(), mesh_of(1, 1, 4)
    y, counts = jax.jit(lambda x, p: sharding.moe_expert_parallel(x, p, cfg, None, mesh))(x, params)
    want_y, want_counts = reference_moe(x, params, cfg)
    assert_close(y, want_y, name="y")
    np.testing.assert_array_equal(counts, want_counts)


# --------------------------------------------------------------------------- errors and the mesh


def test_experts_must_split_evenly_over_the_expert_axis():
    x, params = random_moe(6, experts=6)
    with pytest.raises(ValueError, match="6 experts over an expert axis of size 4"):
        sharding.moe_expert_parallel(x, params, config(num_experts=6), None, mesh_of(1, 1, 4))


def test_rejects_meshes_and_weights_it_does_not_know():
    x, params = random_moe(7)
    other = jax.make_mesh((2,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"mesh axes \('expert',\): expected \('data', 'tensor', 'expert'\)"):
        sharding.moe_expert_parallel(x, params, config(), None, other)
    with pytest.raises(ValueError, match=r"unknown MoE weights \['shared'\]"):
        sharding.moe_expert_parallel(x, {**params, "shared": params["up"]}, config(), None, mesh_of(1, 1, 2))


def test_make_mesh_axes_and_device_count():
    mesh = sharding.make_mesh(data=2, tensor=2, expert=2)
    assert mesh.axis_names == ("data", "tensor", "expert") and dict(mesh.shape) == {"data": 2, "tensor": 2, "expert": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 3 and mesh.devices.size == jax.device_count()
    assert sharding.make_mesh(devices=jax.devices()[:1]).devices.size == 1
    with pytest.raises(ValueError, match=r"data=1 x tensor=1 x expert=4 = 4 devices: expected .* devices given, 8"):
        sharding.make_mesh(expert=4)
    with pytest.raises(ValueError, match="expert=0: expected sizes >= 1"):
        sharding.make_mesh(expert=0, devices=[])


def test_moe_switch_follows_the_context_mesh():
    """``sharding.moe`` dispatches tokens (all-to-all) only under a ``jax.set_mesh`` mesh with an expert axis."""
    x, params = random_moe(8)
    cfg = config()

    def program() -> str:
        return str(jax.make_jaxpr(lambda x, p: sharding.moe(x, p, cfg))(x, params))

    assert "all_to_all" not in program()
    with jax.set_mesh(mesh_of(1, 1, 4)):
        assert "all_to_all" in program()
        y, counts = jax.jit(lambda x, p: sharding.moe(x, p, cfg))(x, params)
    want_y, want_counts = reference_moe(x, params, cfg)
    assert_close(y, want_y, name="y")
    np.testing.assert_array_equal(counts, want_counts)


# --------------------------------------------------------------------------- the HF fixture models


@functools.partial(jax.jit, static_argnums=1)
def forward(params, cfg, tokens, batch, kv):
    return model_module(cfg.family).forward(params, cfg, tokens, batch, kv)


@pytest.mark.slow  # ~20 s each on 2 CPU cores (compiling two forward passes on 8 devices)
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_fixture_models_on_an_expert_parallel_mesh_give_the_one_device_logits(name):
    """Both prompts prefilled as one padded batch, then one decode step (1 token: padded to the 8 token shards)."""
    cfg, tensors = read_checkpoint(HF / name)
    module = model_module(cfg.family)
    params = module.params_from_hf(cfg, tensors, jnp.float32)
    with np.load(HF / name / "reference.npz") as ref:
        prompts = [ids[:n] for ids, n in zip(ref["input_ids"], ref["lengths"], strict=True)]
    tables = [list(range(s * MAX_BLOCKS, (s + 1) * MAX_BLOCKS)) for s in range(2)]
    prefill = make_batch([SeqChunk(t, 0, len(p)) for t, p in zip(tables, prompts, strict=True)], BLOCK,
                         num_tokens=BUCKET, num_seqs=2, max_blocks=MAX_BLOCKS)
    tokens = np.zeros(BUCKET, np.int32)
    tokens[:sum(map(len, prompts))] = np.concatenate(prompts)
    decode = make_batch([SeqChunk(tables[0], len(prompts[0]), 1)], BLOCK, num_seqs=2, max_blocks=MAX_BLOCKS)
    real = sum(map(len, prompts))

    def run(params):
        kv = (PagedLatentKV if cfg.is_mla else PagedKV).create(cfg, NUM_BLOCKS, BLOCK, jnp.float32)
        logits, kv, counts = forward(params, cfg, tokens, prefill, kv)
        step_logits, _, step_counts = forward(params, cfg, np.array([7], np.int32), decode, kv)
        return np.asarray(logits[:real]), np.asarray(counts), np.asarray(step_logits), np.asarray(step_counts)

    one_device = run(params)
    mesh = sharding.make_mesh(data=2, expert=4)
    on_mesh = jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), params,
                           module.param_specs(cfg))
    with jax.set_mesh(mesh):
        expert_parallel = run(on_mesh)
    first_moe = next(l for l in range(cfg.layers) if cfg.is_moe_layer(l))  # DeepSeek's layer 0 is dense
    assert len(on_mesh["layers"][first_moe]["mlp"]["gate"].addressable_shards[0].data) == cfg.num_experts // 4
    assert_close(expert_parallel[0], one_device[0], rtol=1e-5, name=f"{name} prefill logits")
    assert_close(expert_parallel[2], one_device[2], rtol=1e-5, name=f"{name} decode logits")
    np.testing.assert_array_equal(expert_parallel[1], one_device[1])
    np.testing.assert_array_equal(expert_parallel[3], one_device[3])
    assert expert_parallel[1].sum() == real * cfg.top_k * sum(map(cfg.is_moe_layer, range(cfg.layers)))
