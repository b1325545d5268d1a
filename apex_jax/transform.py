"""ApexW: AdamW with compact moments and one fused update for a whole model.

Two ways to use the same optimizer (same state, same checkpoints):

* ``apexw(...)``: an optax ``GradientTransformationExtraArgs`` for ``optax.chain``, ``inject_hyperparams``
  and ``optax.apply_updates``. It accepts any params pytree, the moments laid out flat: each large leaf's
  updates come from a launch over its own rows, the small leaves' from one launch over them joined (no copy of
  the large leaves into one buffer, nor out of one); FlatParams take one launch per dtype.
* ``ApexW(...).step(params, grads, state) -> (params, state)``: the fused step, for the model's own params
  pytree (each large leaf updated in its own buffer, the moments flat) or for :class:`FlatParams`. Under
  ``jax.jit(..., donate_argnums=(0, 2))`` it updates params and moments in place in one pass, with no
  ``updates`` array; bf16 params are stochastically rounded.

FlatParams laid over a mesh (:class:`apex_jax.RowSharding`) get moments sharded by the same rows, and each
device runs the update on its own rows under ``shard_map``: nothing is gathered but the updated params of ZeRO-1.
The random bits are drawn by global element index, so every mesh computes what one device computes.
"""

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from apex_jax.flat import ROWS_ALIGN, FlatLayout, FlatParams, RowSharding
from pallas_kernels.adamw import (
    CODE_COLUMNS,
    INT4_M_ZERO_BYTE,
    QUANTIZED,
    ROW,
    TUNED_BLOCKS,
    BlockConfig,
    Hyper,
    fused_adamw,
    fused_adamw_reference,
    shard_key_offset,
    stream_keys,
)

# The moment dtypes by their short names: the kernel's codec names (``pallas_kernels.adamw``), the result labels of
# the benchmarks and the spelling a command line may offer (``STATE_DTYPES[args.state_dtype]``).
STATE_DTYPES: dict[str, np.dtype] = {"fp32": jnp.dtype(jnp.float32), "bf16": jnp.dtype(jnp.bfloat16),
                                     "int8": jnp.dtype(jnp.int8), "int4": jnp.dtype(jnp.int4)}
_CODECS = {dtype: name for name, dtype in STATE_DTYPES.items()}
IMPLEMENTATIONS = ("pallas", "pallas_interpret", "xla")  # None picks one per platform: ApexW's docstring


class DenseMoments(NamedTuple):
    """fp32 or bf16 moments of one buffer group, ``[rows, 256]``."""

    mu: jax.Array
    nu: jax.Array


class QuantizedMoments(NamedTuple):
    """8- or 4-bit moments of one buffer group: codes and per-256 scales on every row (unused on the small leaves'
    rows; none at all when the group holds only small leaves), fp32 moments for the small leaves."""

    mu_codes: jax.Array  # int8 [rows, 256] (or [0, 256]); int4: uint8 [rows, 128], two codes a byte
    nu_codes: jax.Array  # uint8 [rows, 256]; int4: [rows, 128]
    mu_scale: jax.Array  # float32 [rows]
    nu_scale: jax.Array  # float32 [rows]
    mu_small: jax.Array  # float32 [small_rows, 256]: replicated over a mesh
    nu_small: jax.Array  # float32 [small_rows, 256]


class ApexWState(NamedTuple):
    count: jax.Array  # int32: steps taken
    skipped: jax.Array  # int32: steps skipped for non-finite gradients
    moments: tuple  # one DenseMoments | QuantizedMoments per dtype group of the layout
    master: tuple = ()  # master_weights: per dtype group, float32 [rows * 256] params (None for float32 groups)


ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class ApexW:
    """AdamW with fp32, bf16 or 8-bit blockwise moments and a fused single-launch update.

    Per element, with t the step (from 1) and decay = 1 where ``mask`` is True:

        m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2
        p <- p - lr_t ((m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * decay * p)

    Args:
      learning_rate: a float, a scalar array or an optax schedule of the step count.
      b1, b2: moment decay rates in [0, 1). eps: added to sqrt(v_hat), >= 0.
      weight_decay: decoupled weight decay (>= 0), applied where ``mask`` is True.
      mask: pytree of bools matching params (or a callable params -> such a pytree); None = everywhere.
      state_dtype: the moments' dtype, anything ``jnp.dtype`` reads as ``jnp.float32`` (8 B/param),
        ``jnp.bfloat16`` (4 B/param, stochastically rounded), ``jnp.int8`` (int8 m + uint8 v + fp32 scale per
        256, about 2.03 B/param) or ``jnp.int4`` (4-bit m and v, two a byte, + the scales: 1.03 B/param); under
        8 and 4 bits leaves under 4096 elements stay fp32. Stored as that ``np.dtype``.
      quant_map: "power" (default) or "linear" code map for int8 moments (see ``pallas_kernels.adamw``); int4
        has "power" only.
      skip_nonfinite: if any gradient is NaN/Inf, leave params and moments bit-identical and count the skip
        (the optax path returns updates of -0.0, which ``optax.apply_updates`` adds without changing a bit).
      seed: seed of the stochastic-rounding hash (with the step and the element index).
      master_weights: keep a float32 copy of every bf16 (non-fp32) parameter buffer in the state (4 B/param,
        sharded like the moments); the fused step updates the copy and writes the params as its nearest bf16
        value. Without it bf16 params are updated in place with stochastic rounding. Fused step only.
      implementation: how the update runs: "pallas" (the fused kernel, compiled; an NVIDIA GPU),
        "pallas_interpret" (the same kernel in the Pallas interpreter, on any platform; slow, for tests) or
        "xla" (``fused_adamw_reference``, the same math in plain jnp). None picks per platform when the step is
        lowered: "pallas" on an NVIDIA GPU, where one launch per dtype group reads and writes every param and
        moment once, "xla" elsewhere, where Pallas only runs interpreted.
      block: launch geometry of the Pallas kernel (default: tuned per state kind on an H200).
    """

    learning_rate: ScalarOrSchedule
    b1: float | jax.Array = 0.9
    b2: float | jax.Array = 0.999
    eps: float | jax.Array = 1e-8
    weight_decay: float | jax.Array = 1e-4
    mask: Any = None
    state_dtype: jax.typing.DTypeLike = jnp.bfloat16
    quant_map: str = "power"
    skip_nonfinite: bool = False
    seed: int | jax.Array = 0
    implementation: str | None = None
    block: BlockConfig | None = None
    master_weights: bool = False

    def __post_init__(self):
        object.__setattr__(self, "state_dtype", _state_dtype(self.state_dtype))
        if self.implementation is not None and self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {self.implementation!r}; expected None or one of "
                             f"{IMPLEMENTATIONS}")
        if self.quant_map not in ("power", "linear"):
            raise ValueError(f"unknown quant_map {self.quant_map!r}; expected 'power' or 'linear'")
        if self.state_dtype == jnp.int4 and self.quant_map != "power":
            raise ValueError(f"int4 moments have only the 'power' quant_map, got {self.quant_map!r}")
        if self.block is not None and self.block.block_rows > ROWS_ALIGN:
            raise ValueError(f"block.block_rows must be <= {ROWS_ALIGN}, got {self.block.block_rows}")
        if not callable(self.learning_rate):
            _check_range("learning_rate", self.learning_rate, 0.0, None)
        _check_range("b1", self.b1, 0.0, 1.0)
        _check_range("b2", self.b2, 0.0, 1.0)
        _check_range("eps", self.eps, 0.0, None)
        _check_range("weight_decay", self.weight_decay, 0.0, None)

    # ------------------------------------------------------------------ optax interface

    def init(self, params) -> ApexWState:
        """Zero moments for ``params`` (a pytree or FlatParams)."""
        layout = FlatLayout.of(params)
        self._row_masks(layout, params)  # validates the mask early
        moments = tuple(self._zero_moments(group) for group in layout.groups)
        counters = jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32)
        master = ()
        if self.master_weights:
            master = tuple(None if group.dtype == "float32" else buffer.astype(jnp.float32)
                           for group, buffer in zip(layout.groups, layout.flatten(params).buffers, strict=True))
        if (sharding := _sharding_of(params)) is not None:
            moments = tuple(jax.tree.map(jax.device_put, m, _moment_shardings(m, sharding)) for m in moments)
            master = jax.device_put(master, sharding.spec(1))
            counters = jax.device_put(counters, sharding.spec(0, replicated=True))
        return ApexWState(*counters, moments, master)

    def update(self, updates, state: ApexWState, params=None, **extra_args):
        """optax update: gradients -> (updates to add to params, new state)."""
        del extra_args
        if params is None:
            raise ValueError("apexw needs params in update(grads, state, params) (weight decay reads them)")
        if self.master_weights:
            raise ValueError("master_weights=True needs the fused step (ApexW.step): optax's apply_updates would "
                             "add the updates to the bf16 params, not to the float32 copy")
        new, state = self._run(params, updates, state, apply=False)
        return new, state

    # ------------------------------------------------------------------ fused step

    def step(self, params, grads, state: ApexWState):
        """Fused AdamW step: ``(params, grads, state) -> (new params, new state)``, under
        ``jax.jit(opt.step, donate_argnums=(0, 2))`` in place: no copy of params, grads or moments.

        ``params`` may be the model's own pytree (``opt.init(params)`` lays the moments out flat): each piece of
        rows of the layout (``FlatLayout.row_ranges``: a large leaf, reshaped; the small leaves joined) is updated
        in its own buffer by one launch (or XLA's reference over those rows), its moments at their rows of the
        flat state. So the model reads its params as they are: a view of one flat buffer (``FlatParams.tree()``)
        is a slice, which XLA copies wherever a whole array must exist, e.g. as an operand of a scan over layers
        (4 B/param of fp32 params, for the whole step). ``grads`` is then the pytree of the leaves' gradients.
        A launch per large leaf suits a model that stacks its layers (a handful of leaves); for thousands of
        large leaves FlatParams' one launch per group costs less time.

        ``params`` may be FlatParams (one buffer per dtype group, what a mesh needs: ``RowSharding``), updated by
        one launch per group; ``grads`` then FlatParams (``jax.grad`` with respect to the FlatParams, whose
        transpose of the split concatenates the leaves' gradients) or the pytree of the leaves' gradients
        (``jax.grad`` with respect to ``params.tree()``), which on one device without master weights feeds each
        piece's update of its own rows, with no flat gradient made. With master weights, or over a mesh (FlatParams
        with a RowSharding, or a pytree of sharded leaves), params and grads are flattened first.
        """
        return self._run(params, grads, state, apply=True)

    # ------------------------------------------------------------------ internals

    def _run(self, params, grads, state: ApexWState, apply: bool):
        layout = FlatLayout.of(params)
        self._check_state(layout, state)
        align = self._block_rows
        # How params and grads meet the flat moments (the step's docstring): a pytree of params, each piece of
        # rows (a large leaf, or the small leaves joined) updated in its own buffer; a pytree of grads by row
        # ranges of the flat params; else one flat buffer per group.
        tree_params = not isinstance(params, FlatParams) and not state.master and not _on_a_mesh(params)
        if tree_params:
            p_flat, sharding = None, None
            p_buffers = tuple(tuple(rows for _, rows in pieces) for pieces in layout.row_ranges(params, align))
        else:
            p_flat = layout.flatten(params)
            sharding = p_flat.sharding
            p_buffers = tuple((b,) for b in p_flat.buffers)
        by_rows = tree_params or (apply and sharding is None and not state.master
                                  and not isinstance(grads, FlatParams))
        if by_rows:
            g_pieces = layout.row_ranges(grads, align)
            g_buffers = tuple(tuple(rows for _, rows in pieces) for pieces in g_pieces)
        else:
            g_flat = layout.flatten(grads)
            g_pieces = tuple(((0, None),) for _ in layout.groups)  # the whole buffer, flat
            g_buffers = tuple((g,) for g in g_flat.buffers)
        row_masks = self._row_masks(layout, params)
        count = state.count
        t = optax.safe_increment(count)
        lr = self.learning_rate(count) if callable(self.learning_rate) else self.learning_rate
        # optax.adamw's scalar expressions (1 - b rounded from float64); the kernel then multiplies by the
        # bias corrections' reciprocals, which keeps the fp32 kind within a few ulps of optax.
        hp = Hyper(*(jnp.asarray(x, jnp.float32) for x in (
            lr, self.b1, self.b2, 1 - self.b1, 1 - self.b2, self.eps, self.weight_decay,
            1 - self.b1 ** t, 1 - self.b2 ** t)))

        masters = state.master or (None,) * len(layout.groups)

        def update_all(_):
            outs, moments, new_masters = [], [], []
            for k, (group, p_group, pieces, g_group, mom, rows, master) in enumerate(zip(
                    layout.groups, p_buffers, g_pieces, g_buffers, state.moments, row_masks, masters,
                    strict=True)):
                keys = stream_keys(self.seed, t, k)
                rows = jnp.asarray(rows)
                if tree_params:  # one launch per piece, each in its own params buffer
                    out = []
                    for (first_row, _), p, g in zip(pieces, p_group, g_group, strict=True):
                        new_p, mom, _ = self._group_step(p, g, mom, rows, hp, keys, apply, group.small_rows,
                                                         first_row=first_row, range_params=True)
                        out.append(new_p.reshape(p.shape))
                    out = tuple(out)
                elif sharding is None:
                    (p,) = p_group
                    out = p if master is None else master  # the kernel updates the float32 copy when there is one
                    for (first_row, _), g in zip(pieces, g_group, strict=True):  # one launch per row range
                        out, mom, copy = self._group_step(out, g, mom, rows, hp, keys, apply, group.small_rows,
                                                          None if master is None else p.dtype,
                                                          first_row if by_rows else 0)
                    if master is not None:
                        master, out = out, copy
                    out = (out,)
                else:
                    (p,), (g,) = p_group, g_group
                    out, mom, master = self._sharded_group_step(sharding, group, p if master is None else master,
                                                                g, mom, rows, hp, keys, apply,
                                                                None if master is None else p.dtype)
                    out = (out,)
                outs.append(out)
                moments.append(mom)
                new_masters.append(master)
            return tuple(outs), tuple(moments), tuple(new_masters) if state.master else ()

        if self.skip_nonfinite:
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(g_buffers)]))
            # updates of -0.0: p + -0.0 is p bit for bit, signaling NaNs aside (+0.0 would turn -0.0 into +0.0)
            unchanged = p_buffers if apply else jax.tree.map(lambda g: jnp.full_like(g, -0.0), g_buffers)
            outs, moments, master = jax.lax.cond(finite, update_all,
                                                 lambda _: (unchanged, state.moments, state.master), None)
            new_state = ApexWState(jnp.where(finite, t, count), state.skipped + (~finite).astype(jnp.int32),
                                   moments, master)
        else:
            outs, moments, master = update_all(None)
            new_state = ApexWState(t, state.skipped, moments, master)
        if tree_params:
            return layout.from_row_ranges(tuple(tuple(zip((first for first, _ in pieces), out, strict=True))
                                                for pieces, out in zip(g_pieces, outs, strict=True)), align), \
                new_state
        out = FlatParams(tuple(out for (out,) in outs), layout, sharding)
        return (out if isinstance(params, FlatParams) else out.tree()), new_state

    def _group_step(self, p, g, moments, rows, hp, keys, apply, n_plain, copy_dtype=None, first_row=0,
                    range_params=False):
        """One buffer (or one shard of it): p, g ``[rows * 256]`` (or g ``[n, 256]``: its rows from ``first_row``
        on, updated in place; p too with ``range_params``), ``n_plain`` (maybe traced) rows of fp32 plain moments
        first under 8- or 4-bit state -> (new p or updates, new moments, the new p in ``copy_dtype`` or None)."""
        p2, g2 = p.reshape(-1, ROW), g.reshape(-1, ROW)
        call = dict(apply=apply, out_dtype=g.dtype, quant_map=self.quant_map, copy_dtype=copy_dtype,
                    first_row=first_row, range_params=range_params)
        if isinstance(moments, DenseMoments):
            out, new, *copy = self._kernel(p2, g2, tuple(moments), rows, hp, keys, 0,
                                           codec=_CODECS[self.state_dtype], **call)
            new = DenseMoments(*new)
        elif moments.mu_codes.shape[0] == 0:  # only small leaves: plain fp32 moments
            out, new, *copy = self._kernel(p2, g2, tuple(moments[4:]), rows, hp, keys, 0, codec="fp32", **call)
            new = moments._replace(mu_small=new[0], nu_small=new[1])
        else:
            has_plain = moments.mu_small.shape[0] > 0
            arrays = tuple(moments) if has_plain else tuple(moments[:4])
            out, new, *copy = self._kernel(p2, g2, arrays, rows, hp, keys, n_plain if has_plain else 0,
                                           codec=_CODECS[self.state_dtype], **call)
            new = QuantizedMoments(*new) if has_plain else QuantizedMoments(*new, *moments[4:])
        return out.reshape(-1), new, copy[0].reshape(-1) if copy else None

    def _sharded_group_step(self, sharding: RowSharding, group, p, g, moments, rows, hp, keys, apply,
                            params_dtype=None):
        """:meth:`_group_step` on each device's rows under ``shard_map``: moments ``[rows]`` split over
        ``sharding.axis``, params and grads too (FSDP) or replicated and cut to the device's rows (ZeRO-1: the
        updated rows are all-gathered); keys shifted to the shard's first element. Small leaves' fp32 moments
        (replicated) are cut to the shard's rows before and summed back after (one device holds each row).
        With ``params_dtype`` ``p`` is the (always sharded) float32 master copy and the params are its cast.
        Returns (new params or updates, new moments, new master copy or None)."""
        axis, local_rows, zero1 = sharding.axis, group.rows // sharding.shards, not sharding.shard_params
        master = params_dtype is not None
        quantized = isinstance(moments, QuantizedMoments)
        small = moments.mu_small.shape[0] if quantized else 0
        window = min(small, local_rows)  # plain rows a shard can hold

        def shard(p, g, moments, rows, hp, keys):
            first = jax.lax.axis_index(axis) * local_rows
            mine = lambda x, size=ROW: jax.lax.dynamic_slice_in_dim(x, first * size, local_rows * size)
            rows = mine(rows, 1)
            if zero1:
                g = mine(g)
                p = p if master else mine(p)
            n_plain = jnp.clip(small - first, 0, local_rows)
            if window:
                start = jnp.minimum(first, small)
                cut = lambda x: jax.lax.dynamic_slice_in_dim(jnp.pad(x, ((0, window), (0, 0))), start, window)
                moments = moments._replace(mu_small=cut(moments.mu_small), nu_small=cut(moments.nu_small))
            out, moments, copy = self._group_step(p, g, moments, rows, hp, keys + shard_key_offset(first), apply,
                                                  n_plain, params_dtype)
            if window:
                def back(x):
                    held = jnp.where((jnp.arange(window) < n_plain)[:, None], x, 0.0)
                    whole = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((small + window, ROW), x.dtype), held,
                                                                start, 0)
                    return jax.lax.psum(whole[:small], axis)
                moments = moments._replace(mu_small=back(moments.mu_small), nu_small=back(moments.nu_small))
            new_master = None
            if master:
                new_master, out = out, copy
            if zero1:
                out = jax.lax.all_gather(out, axis, tiled=True)
            return out, moments, new_master

        P = jax.sharding.PartitionSpec
        flat_spec = P() if zero1 else P(axis)
        moment_specs = jax.tree.map(lambda s: s.spec, _moment_shardings(moments, sharding))
        return jax.shard_map(
            shard, mesh=sharding.mesh, check_vma=False,
            in_specs=(P(axis) if master else flat_spec, flat_spec, moment_specs, P(), P(), P()),
            out_specs=(flat_spec, moment_specs, P(axis) if master else None))(
                p, g, moments, jnp.asarray(rows), hp, keys)

    @property
    def _block_rows(self) -> int:
        """The rows of the kernel's tile in every launch of this optimizer (its state's codec, and fp32 for a
        group of small leaves alone)."""
        if self.block is not None:
            return self.block.block_rows
        return max(TUNED_BLOCKS[codec].block_rows for codec in (_CODECS[self.state_dtype], "fp32"))

    def _kernel(self, p, g, state, rows, hp, keys, n_plain, **static):
        xla = lambda *a: fused_adamw_reference(*a[:-1], n_plain_rows=a[-1], **static)
        pallas = lambda *a: fused_adamw(*a[:-1], n_plain_rows=a[-1], config=self.block,
                                        interpret=self.implementation == "pallas_interpret", **static)
        args = (p, g, state, rows, hp, keys, n_plain)
        if self.implementation is None:
            return jax.lax.platform_dependent(*args, cuda=pallas, default=xla)
        return (xla if self.implementation == "xla" else pallas)(*args)

    def _check_state(self, layout: FlatLayout, state: ApexWState) -> None:
        """The state must be this optimizer's kind for these params (a restored checkpoint may not be)."""
        expected = jax.eval_shape(lambda: tuple(self._zero_moments(group) for group in layout.groups))
        spec = lambda tree: [(x.shape, jnp.dtype(x.dtype).name) for x in jax.tree.leaves(tree)]
        if jax.tree.structure(state.moments) != jax.tree.structure(expected) or spec(state.moments) != spec(expected):
            raise ValueError(f"optimizer state does not match state_dtype={self.state_dtype.name} for these params: "
                             f"got {jax.tree.map(lambda x: (x.shape, x.dtype.name), state.moments)}")
        if bool(state.master) != self.master_weights:
            raise ValueError(f"optimizer state {'has' if state.master else 'lacks'} a float32 master copy, but "
                             f"master_weights={self.master_weights}")

    def _zero_moments(self, group):
        if _CODECS[self.state_dtype] not in QUANTIZED:
            shape = (group.rows, ROW)
            return DenseMoments(jnp.zeros(shape, self.state_dtype), jnp.zeros(shape, self.state_dtype))
        coded = 0 if group.rows == group.small_rows else group.rows
        columns = CODE_COLUMNS[_CODECS[self.state_dtype]]
        # zeros as the kernel stores them, so rows no launch visits (padding) hold what a visit would leave
        return QuantizedMoments(
            jnp.zeros((coded, columns), jnp.int8) if columns == ROW else jnp.full((coded, columns), INT4_M_ZERO_BYTE,
                                                                                   jnp.uint8),
            jnp.zeros((coded, columns), jnp.uint8),
            jnp.zeros((coded,), jnp.float32), jnp.zeros((coded,), jnp.float32),
            jnp.zeros((group.small_rows, ROW), jnp.float32), jnp.zeros((group.small_rows, ROW), jnp.float32))

    def _row_masks(self, layout: FlatLayout, params):
        if self.mask is None:
            return tuple(np.ones(group.rows, np.float32) for group in layout.groups)
        tree = params.tree() if isinstance(params, FlatParams) else params
        mask = self.mask(tree) if callable(self.mask) else self.mask
        try:
            return layout.row_mask(mask)
        except ValueError as err:
            raise ValueError(f"apexw mask does not match the params: {err}") from None


def apexw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-4, mask: Any = None, *, state_dtype: jax.typing.DTypeLike = jnp.bfloat16,
          quant_map: str = "power", skip_nonfinite: bool = False, seed: int = 0,
          implementation: str | None = None) -> optax.GradientTransformationExtraArgs:
    """ApexW as an optax transformation (see :class:`ApexW` for the update rule and arguments).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from apex_jax import apexw
      >>> params = {"w": jnp.ones((64, 64))}
      >>> tx = optax.chain(optax.clip_by_global_norm(1.0), apexw(1e-3, state_dtype=jnp.int8))
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.full((64, 64), 0.1)}, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> print(f"{float(params['w'][0, 0]):.4f}")
      0.9990

    References:
      Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019;
      Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022.
    """
    opt = ApexW(learning_rate, b1, b2, eps, weight_decay, mask, state_dtype, quant_map, skip_nonfinite, seed,
                implementation)
    return optax.GradientTransformationExtraArgs(opt.init, opt.update)


def _on_a_mesh(tree) -> bool:
    """Whether a leaf's type names mesh axes (sharded over devices): its pieces cannot meet the one-device flat
    moments row by row, so such a pytree is flattened (FlatParams with a RowSharding are the sharded form)."""
    return any(axis is not None for leaf in jax.tree.leaves(tree) for axis in jax.typeof(leaf).sharding.spec)


def _sharding_of(params) -> RowSharding | None:
    return params.sharding if isinstance(params, FlatParams) else None


def _moment_shardings(moments: DenseMoments | QuantizedMoments, sharding: RowSharding):
    """NamedShardings of one group's moments: row-sharded, but small leaves' fp32 moments replicated."""
    specs = [sharding.spec(x.ndim) for x in moments]
    if isinstance(moments, QuantizedMoments):
        specs[4:] = [sharding.spec(2, replicated=True)] * 2
    return type(moments)(*specs)


def state_nbytes(state: ApexWState) -> int:
    """Bytes held by the optimizer's state: the moments and the float32 master copy, if any."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves((state.moments, state.master)))


def _state_dtype(value: jax.typing.DTypeLike) -> np.dtype:
    """``value`` as the ``np.dtype`` it names, which must be one of :data:`STATE_DTYPES`."""
    expected = "jnp.float32, jnp.bfloat16, jnp.int8 or jnp.int4 (or a name or dtype jnp.dtype() reads as one of them)"
    try:
        dtype = jnp.dtype(value)
    except (TypeError, ValueError):  # not a dtype at all (numpy raises either)
        short = (f" (the short name {value!r} means apex_jax.STATE_DTYPES[{value!r}])"
                 if isinstance(value, str) and value in STATE_DTYPES else "")
        raise ValueError(f"state_dtype {value!r} is not a dtype{short}; expected {expected}") from None
    if dtype not in _CODECS:
        raise ValueError(f"state_dtype {value!r} is {dtype.name}; expected {expected}")
    return dtype


def _check_range(name: str, value, low: float, high: float | None) -> None:
    """Reject concrete out-of-range hyperparameters (traced ones, as under inject_hyperparams, pass)."""
    if isinstance(value, jax.core.Tracer):
        return
    if not isinstance(value, numbers.Real | np.ndarray | jax.Array):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(np.asarray(value))
    if not np.isfinite(v) or v < low or (high is not None and v >= high):
        expected = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {expected}, got {v}")
