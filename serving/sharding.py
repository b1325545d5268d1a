"""Device meshes, and the expert-parallel MoE layer: experts split over devices, tokens dispatched by all-to-all.

Mesh axes (``make_mesh``): ``"data"`` splits the batch, ``"tensor"`` attention heads and hidden dims
(Megatron-style), ``"expert"`` the routed experts (``models/llama.py`` gives every weight's spec).

Expert parallelism (``moe_expert_parallel``, the math of ``layers.moe``), as DeepSeek's EP: the flat token
batch is split over ``("data", "expert")`` and each of the ``ep`` devices along ``"expert"`` holds
``E / ep`` experts (``gate``/``up [E/ep, D, I/tp]``, ``down [E/ep, I/tp, D]``). Per device, inside
``jax.shard_map``: route its own n tokens; send each (token, expert) row to the device holding that expert
(all-to-all); run the local experts (``layers.expert_swiglu`` with ``ragged_dot``) on the received rows; send
the results back (all-to-all); combine them with the routing weights; sum the partial outputs over
``"tensor"`` (each device holds a slice of every local expert's hidden dim).

The exchange is ``jax.lax.all_to_all`` over fixed-capacity buffers ``[ep, C, D]``. ``ragged_all_to_all``
would send only the routed rows, but XLA:CPU does not implement it (jax 0.11.2: "HLO opcode
ragged-all-to-all is not supported by XLA:CPU"), so the 8-device tests could not run it. Capacity policy:
no token is ever dropped. A token's k experts are distinct, so it sends at most ``min(k, E/ep)`` rows to
one device, and ``C = n * min(k, E/ep)`` holds every row a device can send to another, however skewed the
routing. The price is traffic: each device sends ``ep * C`` rows whatever the routing, ``ep * min(k, E/ep)
/ k`` times the n*k rows a ragged exchange would. Padding tokens (``valid`` False) are not sent: their
output is 0 and they are not counted.

Selecting it: the models call ``moe`` below, which runs ``moe_expert_parallel`` over the mesh set with
``jax.set_mesh`` (when it has an ``"expert"`` axis) and ``layers.moe`` otherwise; the mesh is chosen in that
one place, around the jitted call::

    mesh = make_mesh(data=2, expert=4)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), module.param_specs(cfg)))
    with jax.set_mesh(mesh):
        logits, kv, expert_counts = jax.jit(module.forward, static_argnums=1)(params, cfg, tokens, batch, kv)

Serving on a mesh (``Engine(mesh=...)``, ``python -m serving serve --tensor-parallel 2 --expert-parallel 4``):
``check_mesh`` checks the mesh against the model, ``shard_params`` places the weights by the model's
``param_specs``, and ``cache_spec`` splits the paged cache as the attention weights that write it (k/v heads over
``"tensor"``; MLA's latent rows, shared by every head, replicated). The runner's steps run under
``jax.set_mesh``, the step's host buffer replicated: the MoE layers go expert-parallel and XLA partitions the
rest from the weights' shardings. The cache is not split over ``"data"`` or ``"expert"``: every device holds
every block (of its ``"tensor"`` slice of heads) and attends for the whole batch; those axes split the MoE
layers' tokens, not attention's.

Multi-host: call ``jax.distributed.initialize()`` first in every process (coordinator address, process count
and id from its arguments or, on SLURM / Open MPI / Cloud TPU, from the environment). ``jax.devices()`` then
lists every process's devices, and ``make_mesh(...)`` over them builds the same global mesh in each process;
every process runs the same jitted program on global arrays (``jax.make_array_from_process_local_data``), and
XLA carries the all-to-alls across hosts (NCCL on GPUs). ``"expert"`` is the mesh's fastest-varying axis, so
with ``expert`` <= devices per host the all-to-alls stay inside a host.
"""

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from serving import layers
from serving.config import ModelConfig
from serving.quantization import linear, quantized_specs

DATA, TENSOR, EXPERT = "data", "tensor", "expert"
AXES = (DATA, TENSOR, EXPERT)  # make_mesh's axis order: "expert" varies fastest (neighbouring devices)
TOKENS = (DATA, EXPERT)  # the flat token batch is split over both: every device routes its own tokens
# How moe_expert_parallel sees the expert weights (moe.py's layout): experts over "expert", hidden dim over "tensor".
EXPERT_SPECS = {"router": P(), "router_bias": P(), "router_logit_bias": P(), "gate": P(EXPERT, None, TENSOR),
                "up": P(EXPERT, None, TENSOR), "down": P(EXPERT, TENSOR, None), "gate_bias": P(EXPERT, TENSOR),
                "up_bias": P(EXPERT, TENSOR), "down_bias": P()}  # down_bias: added after the tensor psum


def make_mesh(data: int = 1, tensor: int = 1, expert: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``data x tensor x expert`` mesh of ``AxisType.Auto`` axes over ``devices`` (default: all of them).

    The product must equal the number of devices: pass ``devices=jax.devices()[:n]`` to use fewer. Multi-host:
    after ``jax.distributed.initialize()``, ``jax.devices()`` holds every process's devices (module docstring).
    """
    devices = jax.devices() if devices is None else list(devices)
    sizes = (data, tensor, expert)
    if min(sizes) < 1:
        raise ValueError(f"make_mesh: data={data}, tensor={tensor}, expert={expert}: expected sizes >= 1")
    if math.prod(sizes) != len(devices):
        raise ValueError(f"make_mesh: data={data} x tensor={tensor} x expert={expert} = {math.prod(sizes)} devices: "
                         f"expected the number of devices given, {len(devices)}")
    return jax.make_mesh(sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def check_mesh(mesh: Mesh, cfg: ModelConfig) -> None:
    """ValueError unless ``mesh`` has ``make_mesh``'s axes and ``cfg``'s routed experts split evenly over its
    ``"expert"`` axis (size 1 for a dense model: it has no experts to split)."""
    if set(mesh.axis_names) != set(AXES):
        raise ValueError(f"mesh axes {mesh.axis_names}: expected {AXES} (use make_mesh)")
    ep = mesh.shape[EXPERT]
    if cfg.num_experts == 0 and ep > 1:
        raise ValueError(f"expert={ep} for family {cfg.family!r}, a dense model (no routed experts): expected "
                         "expert=1")
    if cfg.num_experts % ep:
        raise ValueError(f"{cfg.num_experts} experts over an expert axis of size {ep}: expected the number of "
                         "experts to be a multiple of it")


def shard_params(params: dict, specs: dict, mesh: Mesh) -> dict:
    """``params`` (possibly quantized) placed on ``mesh`` by ``specs``, the unquantized weights' ``PartitionSpec``s
    (a model's ``param_specs``). A split dimension that is not a multiple of its mesh axes' size -> ValueError
    naming the weight."""
    specs = quantized_specs(specs, params)

    def check(path, leaf: jax.Array, spec: P) -> None:
        for dim, (size, axes) in enumerate(zip(leaf.shape, spec, strict=False)):  # trailing dims: replicated
            devices = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
            if size % devices:
                name = jax.tree_util.keystr(path, simple=True, separator=".")
                raise ValueError(f"shard_params: {name} {list(leaf.shape)}: dimension {dim} of size {size} split "
                                 f"over mesh axes {axes!r} of {devices} devices: expected a multiple of {devices}")

    jax.tree.map_with_path(check, params, specs)
    return jax.device_put(params, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs))


def mesh_of(array: jax.Array) -> Mesh | None:
    """The mesh of more than one device ``array`` is laid over (e.g. a target model's weight, which a drafter's
    own arrays follow), or None for an array on one device."""
    mesh = getattr(array.sharding, "mesh", None)
    return mesh if mesh is not None and mesh.size > 1 else None


def cache_spec(cfg: ModelConfig) -> P:
    """The ``PartitionSpec`` of every page array of ``cfg``'s paged cache (``kv_cache.py``): ``PagedKV``'s
    ``[num_blocks, block_size, kv_heads, head_dim]`` with the kv heads over ``"tensor"``, as the k/v projections
    that write them; ``PagedLatentKV``'s ``[num_blocks, block_size, R + P]`` replicated (one row serves every
    head)."""
    return P() if cfg.is_mla else P(None, None, TENSOR, None)


def moe(x: jax.Array, params: dict[str, jax.Array], cfg: ModelConfig, valid: jax.Array | None = None,
        kernels: layers.KernelPolicy = layers.DEFAULT) -> tuple[jax.Array, jax.Array]:
    """The MoE layer the models call: ``moe_expert_parallel`` over the ``jax.set_mesh`` mesh when it has an
    ``"expert"`` axis (its local experts run ``ragged_dot``), else ``layers.moe`` with policy ``kernels``. Same
    arguments and results as ``layers.moe``."""
    mesh = jax.sharding.get_abstract_mesh()
    if EXPERT in mesh.axis_names:
        return moe_expert_parallel(x, params, cfg, valid, mesh)
    return layers.moe(x, params, cfg, valid, kernels=kernels)


def moe_expert_parallel(x: jax.Array, params: dict[str, jax.Array], cfg: ModelConfig, valid: jax.Array | None,
                        mesh: Mesh | AbstractMesh) -> tuple[jax.Array, jax.Array]:
    """``layers.moe`` with experts split over the mesh's ``"expert"`` axis and tokens sent to them (module docstring).

    x ``[N, D]``, ``valid [N]`` (None: all real), params as ``layers.moe``; mesh has the axes of ``make_mesh``.
    N is padded to a multiple of data * expert (padding is not sent). Returns y ``[N, D]`` (0 for padding
    tokens) and the number of valid tokens routed to each expert over all devices ``[E]`` int32.
    """
    if set(AXES) - set(mesh.axis_names):
        raise ValueError(f"moe_expert_parallel: mesh axes {mesh.axis_names}: expected {AXES} (use make_mesh)")
    if unknown := set(params) - set(EXPERT_SPECS):
        raise ValueError(f"moe_expert_parallel: unknown MoE weights {sorted(unknown)}: expected {list(EXPERT_SPECS)}")
    num_experts, ep = params["router"].shape[-1], mesh.shape[EXPERT]
    if num_experts % ep:
        raise ValueError(f"moe_expert_parallel: {num_experts} experts over an expert axis of size {ep}: expected "
                         "the number of experts to be a multiple of it")
    num_tokens = x.shape[0]
    shards = mesh.shape[DATA] * ep
    pad = -num_tokens % shards
    valid = jnp.ones(num_tokens, jnp.bool_) if valid is None else valid
    local = jax.shard_map(functools.partial(_local_moe, cfg=cfg, ep=ep), mesh=mesh,
                          in_specs=(P(TOKENS, None), quantized_specs({name: EXPERT_SPECS[name] for name in params},
                                                                     params), P(TOKENS)),
                          out_specs=(P(TOKENS, None), P()))
    y, counts = local(jnp.pad(x, ((0, pad), (0, 0))), params, jnp.pad(valid, (0, pad)))
    return y[:num_tokens], counts


def _local_moe(x: jax.Array, params: dict[str, jax.Array], valid: jax.Array, *, cfg: ModelConfig,
               ep: int) -> tuple[jax.Array, jax.Array]:
    """One device's part: its n tokens ``x [n, D]`` -> (y ``[n, D]``, global counts ``[E]``)."""
    n, k = x.shape[0], cfg.top_k
    num_experts, local_experts = params["router"].shape[-1], params["gate"].shape[0]
    capacity = n * min(k, local_experts)  # rows this device may send to one device: never exceeded (docstring)
    logits_dtype = jnp.float32 if cfg.router == "sigmoid" else x.dtype  # as layers.moe
    logits = layers.router_logits(x, params, logits_dtype)
    weights, experts = layers.route(logits, cfg, params.get("router_bias"))
    # (token, expert) pairs sorted by expert, hence by destination device; padding pairs get expert E and sort
    # last, past every device, so the scatters below drop them.
    flat = jnp.where(jnp.repeat(valid, k), experts.reshape(-1), num_experts)  # [n*k]
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    dest = sorted_experts // local_experts  # [n*k] device along "expert"; ep for padding
    per_dest = jnp.bincount(dest, length=ep)
    first = jnp.cumsum(per_dest) - per_dest  # index of each device's first pair in the sorted order
    slot = dest * capacity + jnp.arange(n * k) - first[jnp.minimum(dest, ep - 1)]  # place in the send buffer
    send_rows = jnp.zeros((ep * capacity, x.shape[1]), x.dtype).at[slot].set(x[order // k], mode="drop")
    # The receiver's local expert of each row; empty slots get local_experts (sorted last, in no group).
    send_ids = jnp.full(ep * capacity, local_experts, jnp.int32).at[slot].set(
        sorted_experts % local_experts, mode="drop")

    # Row r of device s's buffer chunk j goes to device j: received [ep * capacity], chunk s from device s.
    recv_rows = jax.lax.all_to_all(send_rows, EXPERT, 0, 0, tiled=True)
    recv_ids = jax.lax.all_to_all(send_ids, EXPERT, 0, 0, tiled=True)
    recv_order = jnp.argsort(recv_ids, stable=True)
    group_sizes = jnp.bincount(recv_ids, length=local_experts).astype(jnp.int32)
    rows, row_experts = recv_rows[recv_order], recv_ids[recv_order]
    # ragged_dot (quantization.linear), not the Pallas kernel: inside shard_map (check_vma) a pallas_call's out_shape
    # must carry a manual_axis_type, which grouped_matmul does not set (yet).
    out_sorted = layers.expert_swiglu(rows, params, group_sizes, cfg, row_experts=row_experts,
                                      matmul=lambda x, w, g: linear(x, w, group_sizes=g))
    out = jnp.zeros_like(out_sorted).at[recv_order].set(out_sorted)
    back = jax.lax.all_to_all(out, EXPERT, 0, 0, tiled=True)  # each row back in the slot it was sent from

    pair_out = back.at[slot].get(mode="fill", fill_value=0)  # [n*k, D] sorted pairs; padding pairs 0
    pairs = jnp.zeros_like(pair_out).at[order].set(pair_out).reshape(n, k, -1)
    y = jax.lax.psum(jnp.einsum("nkd,nk->nd", pairs.astype(jnp.float32), weights), TENSOR)
    if "down_bias" in params:  # replicated: each token's k biases, once (after the psum)
        y = y + layers.expert_bias_sum(weights, jnp.where(valid[:, None], experts, num_experts), params["down_bias"])
    counts = jax.lax.psum(jnp.bincount(flat, length=num_experts), TOKENS)  # padding (expert E) not counted
    return y.astype(x.dtype), counts.astype(jnp.int32)
