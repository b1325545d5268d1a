"""The engine on 8 CPU devices: on a (data, tensor, expert) mesh the HF fixtures give the one-device engine's greedy
tokens and (fp32) logprobs, with their params and paged cache really split; bad meshes and CLI sizes are refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF
from jax.sharding import AxisType, NamedSharding

from serving import Engine, SamplingParams, quantization, sharding
from serving import __main__ as serving_main
from serving.api import cli
from serving.loaders import load_model
from serving.models import model_module
from serving.spec_decode import BlockDrafter, DraftModelDrafter, SpecConfig, block_model

pytestmark = pytest.mark.needs_devices(8)

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
EXTRA_PROMPT = [5, 6, 7]  # a third, shorter prompt beside the fixture's two: a ragged batch of 3
# fp32 logprobs on a mesh differ from one device's only by the order of partial sums (measured: <= 1.5e-6).
LOGPROB_ATOL = 1e-5
# (fixture, (data, tensor, expert)): tensor x expert, all experts on one axis, all three axes for the MoE fixtures;
# tensor-parallel dense. ~20-25 s each on 2 CPU cores (both engines compile a prefill and a decode step).
# GPT-OSS on tensor x expert: its expert biases split with the experts (gate/up also over tensor), the down bias added
# once after the tensor sum, its attention biases and sinks split with the heads.
MESHES = [("qwen3_moe", (1, 2, 4)), ("gpt_oss", (1, 2, 4)),
          *(pytest.param(name, axes, marks=pytest.mark.slow) for name, axes in
            [("mixtral", (1, 1, 8)), ("deepseek_v3", (2, 2, 2)), ("llama", (1, 2, 1)), ("qwen3", (1, 2, 1)),
             ("mixtral_window", (2, 1, 4))])]


def mesh_of(data: int, tensor: int, expert: int) -> jax.sharding.Mesh:
    return sharding.make_mesh(data, tensor, expert, devices=jax.devices()[:data * tensor * expert])


def engine(name: str, **kwargs) -> Engine:
    options = dict(dtype=jnp.float32, num_blocks=32, block_size=BLOCK, max_running=8, token_budget=64) | kwargs
    return Engine(HF / name, **options)


def prompts(name: str) -> list[list[int]]:
    with np.load(HF / name / "reference.npz") as ref:
        return [ids[:n].tolist() for ids, n in zip(ref["input_ids"], ref["lengths"], strict=True)] + [EXTRA_PROMPT]


@functools.cache
def one_device(name: str) -> tuple[list, np.ndarray]:
    """(the batch's completions, expert load) of the engine without a mesh."""
    eng = engine(name)
    return [r.outputs[0] for r in eng.generate(prompts(name), GREEDY)], eng.runner.expert_load


def assert_split_as(tree, specs, mesh: jax.sharding.Mesh) -> None:
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs), strict=True):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (leaf.sharding, spec)


# --------------------------------------------------------------------------- the same outputs, split


@pytest.mark.parametrize(("name", "axes"), MESHES, ids=lambda a: "-".join(map(str, a)) if isinstance(a, tuple) else a)
def test_engine_on_a_mesh_gives_the_one_device_tokens_and_logprobs(name, axes):
    mesh = mesh_of(*axes)
    eng = engine(name, mesh=mesh)
    got = [r.outputs[0] for r in eng.generate(prompts(name), GREEDY)]
    want, want_load = one_device(name)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose([e["logprob"] for e in g.logprobs], [e["logprob"] for e in w.logprobs],
                                   atol=LOGPROB_ATOL)
        assert [[i for i, _ in e["top"]] for e in g.logprobs] == [[i for i, _ in e["top"]] for e in w.logprobs]
        np.testing.assert_allclose([[lp for _, lp in e["top"]] for e in g.logprobs],
                                   [[lp for _, lp in e["top"]] for e in w.logprobs], atol=LOGPROB_ATOL)
    np.testing.assert_array_equal(eng.runner.expert_load, want_load)

    cfg, params, kv = eng.cfg, eng.runner.params, eng.runner.kv  # the cache after the steps wrote it
    assert_split_as(params, model_module(cfg.family).param_specs(cfg), mesh)
    assert_split_as(kv, jax.tree.map(lambda _: sharding.cache_spec(cfg), kv), mesh)
    _, tp, ep = axes
    page = kv.latent[0] if cfg.is_mla else kv.k[0]
    local = page.shape if cfg.is_mla else (*page.shape[:2], cfg.kv_heads // tp, cfg.head_dim)  # MLA's: whole
    assert page.addressable_shards[0].data.shape == local
    assert params["layers"][0]["attn"]["o"].addressable_shards[0].data.shape[0] == cfg.heads // tp
    if cfg.num_experts:
        first_moe = next(l for l in range(cfg.layers) if cfg.is_moe_layer(l))
        gate = params["layers"][first_moe]["mlp"]["gate"]
        assert gate.addressable_shards[0].data.shape == (cfg.num_experts // ep, cfg.hidden, cfg.moe_intermediate // tp)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_speculation_on_a_mesh_gives_the_one_device_tokens(method):
    """n-gram and suffix drafts verified on a tensor x expert mesh: the greedy tokens of the one-device engine
    without speculation, with drafts really verified (prompts that repeat themselves give the drafters matches)."""
    name = "qwen3_moe"
    repeating = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [r.outputs[0].token_ids for r in engine(name).generate(repeating, params)]
    eng = engine(name, mesh=mesh_of(1, 2, 4), speculative=SpecConfig.from_method(method, k=3))
    assert [r.outputs[0].token_ids for r in eng.generate(repeating, params)] == want
    assert eng.spec_stats.num_steps > 0 and eng.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("draft", ["from_target", "own_params"])
def test_draft_model_on_a_mesh_gives_the_one_device_tokens(draft):
    """A draft model from the target's first layer (its weights split with the target's, its cache split too) or
    with weights of its own on one device: the one-device engine's greedy tokens, drafts verified."""
    if draft == "from_target":
        make = functools.partial(DraftModelDrafter.from_target, num_layers=1)
    else:
        cfg, params = load_model(HF / "llama", jnp.float32)[:2]
        make = DraftModelDrafter(cfg, params)  # the target's weights, unsplit: a separate model's place
    repeating = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [r.outputs[0].token_ids for r in engine("llama").generate(repeating, greedy)]
    eng = engine("llama", mesh=mesh_of(1, 2, 1), speculative=SpecConfig(make, k=3))
    assert [r.outputs[0].token_ids for r in eng.generate(repeating, greedy)] == want
    assert eng.spec_stats.num_draft_tokens > 0


def test_block_drafter_on_a_mesh_gives_the_one_device_tokens():
    """The block drafter (random weights: few drafts kept) reads the target's hidden states and head on a
    tensor-parallel mesh, its own arrays replicated there: the one-device engine's greedy tokens, drafts verified."""
    cfg, params = load_model(HF / "llama", jnp.float32)[:2]
    dcfg = block_model.BlockDrafterConfig.for_target(cfg, layers=1)
    dparams = block_model.init_params(dcfg, cfg, jax.random.key(1))
    spec = SpecConfig(lambda target_cfg, target_params: BlockDrafter(dcfg, dparams, target_cfg, target_params,
                                                                     max_seqs=8), k=3)
    repeating = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [r.outputs[0].token_ids for r in engine("llama").generate(repeating, greedy)]
    eng = engine("llama", mesh=mesh_of(1, 2, 1), speculative=spec)
    assert [r.outputs[0].token_ids for r in eng.generate(repeating, greedy)] == want
    assert eng.spec_stats.num_draft_tokens > 0
    mesh = eng.runner.mesh
    assert all(leaf.sharding.mesh == mesh for leaf in jax.tree.leaves(eng.drafter.params))


def test_quantized_params_are_split_as_their_weights():
    """int8 experts: q as the weight, its per-channel scales too but for the contracted (size-1) dimension."""
    cfg, params = load_model(HF / "qwen3_moe", jnp.float32)[:2]
    quantized = quantization.quantize_params(params, "int8", cfg)
    mesh = mesh_of(1, 2, 4)
    gate = sharding.shard_params(quantized, model_module(cfg.family).param_specs(cfg), mesh)["layers"][0]["mlp"]["gate"]
    assert gate.q.addressable_shards[0].data.shape == (cfg.num_experts // 4, cfg.hidden, cfg.moe_intermediate // 2)
    assert gate.scale.addressable_shards[0].data.shape == (cfg.num_experts // 4, 1, cfg.moe_intermediate // 2)


# --------------------------------------------------------------------------- refusals


def test_bad_meshes_are_refused_with_the_sizes():
    with pytest.raises(ValueError, match="8 experts over an expert axis of size 3: expected the number of experts"):
        engine("qwen3_moe", mesh=mesh_of(1, 1, 3))
    with pytest.raises(ValueError, match="expert=2 for family 'llama', a dense model .*: expected expert=1"):
        engine("llama", mesh=mesh_of(1, 1, 2))
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.k \[64, 2, 16\]: dimension 1 of size 2 split over mesh "
                                         r"axes 'tensor' of 4 devices: expected a multiple of 4"):
        engine("llama", mesh=mesh_of(1, 4, 1))  # 2 kv heads
    other = jax.make_mesh((2,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"mesh axes \('expert',\): expected \('data', 'tensor', 'expert'\)"):
        engine("qwen3_moe", mesh=other)
    with pytest.raises(ValueError, match="with batch_invariant=True: expected one device"):
        engine("llama", mesh=mesh_of(1, 2, 1), batch_invariant=True)


# --------------------------------------------------------------------------- the CLI


def cli_engine(*flags: str) -> Engine:
    args = serving_main.parser().parse_args(["serve", "--model", str(HF / "qwen3_moe"), "--dtype", "float32",
                                             "--num-blocks", "16", "--block-size", str(BLOCK), *flags])
    return cli._engine(args)[0]


def test_cli_parallel_flags_build_the_mesh_and_refuse_bad_sizes():
    assert cli_engine().runner.mesh is None  # all 1: one device, as before
    eng = cli_engine("--tensor-parallel", "2", "--expert-parallel", "4")
    assert dict(eng.runner.mesh.shape) == {"data": 1, "tensor": 2, "expert": 4}
    gate = eng.runner.params["layers"][0]["mlp"]["gate"]
    assert gate.addressable_shards[0].data.shape == (2, eng.cfg.hidden, eng.cfg.moe_intermediate // 2)
    eng._reset_cache()  # a rebuilt cache is split as the first
    assert_split_as(eng.runner.kv, jax.tree.map(lambda _: sharding.cache_spec(eng.cfg), eng.runner.kv),
                    eng.runner.mesh)
    with pytest.raises(ValueError, match="--data-parallel 1 x --tensor-parallel 3 x --expert-parallel 1 = 3 devices: "
                                         "expected their product to be the 8 cpu devices"):
        cli_engine("--tensor-parallel", "3")
    with pytest.raises(ValueError, match="--expert-parallel 0: expected sizes >= 1"):
        cli_engine("--expert-parallel", "0")
