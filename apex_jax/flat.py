"""Pytree <-> flat buffers: every parameter of a model in one aligned buffer per dtype.

A :class:`FlatLayout` is computed from shapes and dtypes alone. Leaves are grouped by dtype; inside a
group, small leaves (fewer than ``SMALL_LEAF`` elements: biases, norms) come first, then the large ones,
each starting on a 256-element row and each region padded to ``ROWS_ALIGN`` rows:

    buffer = [small leaves | pad ][ large leaves | pad ]      length = rows * 256

:class:`FlatParams` is a pytree (its children are the buffers, its layout is static), so ``jax.grad``
with respect to it returns flat gradients directly: ``FlatParams.tree()`` views the buffers as the
original pytree through one ``lax.split`` per group, whose transpose is a single concatenate.

The layout also serves params and gradients that stay a pytree: ``FlatLayout.row_ranges`` cuts one into
pieces of the buffers' rows (a large leaf reshaped, no copy; the small leaves joined), which the optimizer
updates against the flat moments at the same rows, and ``FlatLayout.from_row_ranges`` reads the leaves back.

Over a mesh (:class:`RowSharding`), each buffer is split into equal blocks of rows along one mesh axis: FSDP
shards the params too, ZeRO-1 keeps them replicated; the optimizer state is sharded the same way in both, and
:class:`apex_jax.ApexW` updates each shard where it lives. A sharded layout pads each group to a multiple of
``ROWS_ALIGN * lcm(SHARD_ALIGN, shards)`` rows, so one layout serves every mesh whose axis size divides
``SHARD_ALIGN`` (a checkpoint saved on 8 devices restores on 1, 2 or 4).
"""

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels.adamw import ROW

ROWS_ALIGN = 16  # each region is a whole number of kernel tiles for every block_rows ApexW accepts (<= 16)
SMALL_LEAF = 4096  # leaves below this many elements keep fp32 moments under 8- and 4-bit state
SHARD_ALIGN = 8  # a sharded layout splits evenly into 1, 2, 4 or 8 shards (and into its own count)


@dataclasses.dataclass(frozen=True)
class RowSharding:
    """Flat buffers split by rows over mesh axis ``axis``.

    ``shard_params=True`` is FSDP: params, gradients and optimizer state all sharded. ``False`` is ZeRO-1: the
    state is sharded, params stay replicated (gradients are reduce-scattered into the shards and the updated
    shards all-gathered, by XLA around the step).
    """

    mesh: Mesh
    axis: str = "data"
    shard_params: bool = True

    def __post_init__(self):
        if self.axis not in self.mesh.shape:
            raise ValueError(f"mesh axis {self.axis!r} is not in the mesh's axes {tuple(self.mesh.shape)}")

    @property
    def shards(self) -> int:
        return self.mesh.shape[self.axis]

    def spec(self, ndim: int, replicated: bool = False) -> NamedSharding:
        """Rows (dimension 0 of an ``ndim``-dimensional array) over ``axis``, or replicated."""
        parts = () if replicated else (self.axis,) + (None,) * (ndim - 1)
        return NamedSharding(self.mesh, PartitionSpec(*parts))

    def params_spec(self) -> NamedSharding:
        return self.spec(1, replicated=not self.shard_params)


@dataclasses.dataclass(frozen=True)
class Group:
    """One dtype's buffer: ``rows`` rows of 256, the first ``small_rows`` holding the small leaves."""

    dtype: str
    rows: int
    small_rows: int
    leaves: tuple[int, ...]  # leaf indices (tree order) in buffer order
    offsets: tuple[int, ...]  # element offset of each of those leaves

    @property
    def size(self) -> int:
        return self.rows * ROW


@dataclasses.dataclass(frozen=True, eq=False)
class FlatLayout:
    """Where each leaf of a pytree lives in the flat buffers (static: shapes and dtypes only)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    groups: tuple[Group, ...]

    # jit hashes a pytree's static data at every call: hash an 8192-leaf layout once, not per step.
    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, FlatLayout) and self._hash == other._hash
                                 and self.key == other.key)

    @functools.cached_property
    def key(self) -> tuple:
        """Everything that defines the layout (for equality and checkpoint fingerprints)."""
        return self.treedef, self.shapes, self.dtypes, self.groups

    @functools.cached_property
    def _hash(self) -> int:
        return hash(self.key)

    @classmethod
    def of(cls, tree, shards: int = 1) -> "FlatLayout":
        """Layout of a pytree of arrays (or anything with ``.shape`` and ``.dtype``), each group's rows split
        evenly into ``shards`` blocks of whole kernel tiles (padded as the module docstring says when > 1)."""
        if isinstance(tree, FlatParams):
            return tree.layout
        if not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards must be a positive int, got {shards!r}")
        total_align = ROWS_ALIGN * (1 if shards == 1 else math.lcm(SHARD_ALIGN, shards))
        leaves, treedef = jax.tree.flatten(tree)
        if not leaves:
            raise ValueError("cannot lay out an empty pytree: it has no arrays")
        shapes = tuple(tuple(int(d) for d in leaf.shape) for leaf in leaves)
        dtypes = tuple(jnp.dtype(leaf.dtype).name for leaf in leaves)
        for dtype in set(dtypes):
            if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
                raise TypeError(f"parameters must be floating point, got a leaf of dtype {dtype}")
        groups = []
        for dtype in sorted(set(dtypes)):
            members = [i for i, d in enumerate(dtypes) if d == dtype]
            small = [i for i in members if math.prod(shapes[i]) < SMALL_LEAF]
            large = [i for i in members if math.prod(shapes[i]) >= SMALL_LEAF]
            offsets, cursor, region_ends = [], 0, []
            for region in (small, large):
                for i in region:
                    offsets.append(cursor)
                    cursor += _round_up(math.prod(shapes[i]), ROW)
                cursor = _round_up(cursor, ROWS_ALIGN * ROW)
                region_ends.append(cursor // ROW)
            region_ends[1] = _round_up(region_ends[1], total_align)
            groups.append(Group(dtype, region_ends[1], region_ends[0], tuple(small + large), tuple(offsets)))
        return cls(treedef, shapes, dtypes, tuple(groups))

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def flatten(self, tree) -> "FlatParams":
        """Copy a pytree with this layout into flat buffers (padding is zero)."""
        if isinstance(tree, FlatParams):
            self.check(tree)
            return tree
        leaves = self._leaves_of(tree)
        buffers = [_rows_of([(offset, leaves[i]) for i, offset in zip(group.leaves, group.offsets, strict=True)],
                            0, group.rows, group.dtype).reshape(-1) for group in self.groups]
        return FlatParams(tuple(buffers), self)

    def row_ranges(self, tree, align: int) -> tuple[tuple[tuple[int, jax.Array], ...], ...]:
        """Per group, ``(first_row, rows)`` pieces of a pytree with this layout (e.g. gradients), without copying
        the large leaves into one buffer: ``rows [n, 256]`` holds rows ``[first_row, first_row + n)`` of the
        group's flat buffer, ``first_row`` and ``n`` multiples of ``align`` (a power of 2 <= ``ROWS_ALIGN``).
        The small leaves' region is one piece; each large leaf is a piece of its own (a reshape, no copy) where its
        rows start and end on ``align``; leaves that do not are joined with their neighbours up to the next such
        boundary (a concatenate of those only). Rows past the last leaf are left out: they hold zeros."""
        leaves = self._leaves_of(tree)
        return tuple(tuple((first, _rows_of([(offset, leaves[i]) for i, offset in members], first, end, group.dtype))
                           for first, end, members in self._pieces(group, align))
                     for group in self.groups)

    def from_row_ranges(self, pieces, align: int) -> Any:
        """Inverse of :meth:`row_ranges`: the pytree whose leaves are read out of the pieces' rows (those given
        as ``row_ranges(tree, align)`` gave them, any shape of the same size); a piece of one leaf that fills its
        rows is only reshaped back."""
        leaves = [None] * len(self.shapes)
        for group, group_pieces in zip(self.groups, pieces, strict=True):
            for (first, _, members), (_, rows) in zip(self._pieces(group, align), group_pieces, strict=True):
                flat = jnp.ravel(rows)
                for i, offset in members:
                    start, size = offset - first * ROW, math.prod(self.shapes[i])
                    exact = start == 0 and size == flat.size  # the piece is this leaf: a reshape
                    leaves[i] = (flat if exact else jax.lax.slice_in_dim(flat, start, start + size)).reshape(
                        self.shapes[i])
        return jax.tree.unflatten(self.treedef, leaves)

    def _pieces(self, group: "Group", align: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """:meth:`row_ranges`' cut of a group: ``(first_row, end_row, [(leaf index, element offset), ...])``."""
        if align < 1 or align & (align - 1) or align > ROWS_ALIGN:
            raise ValueError(f"align={align}: expected a power of 2 <= {ROWS_ALIGN}")
        pieces, run = [], []  # a piece: the leaves of a run, in buffer order, and the row it ends on
        size = lambda i: math.prod(self.shapes[i])  # noqa: E731
        for i, offset in zip(group.leaves, group.offsets, strict=True):
            large = offset // ROW >= group.small_rows
            if run and large and run[-1][1] // ROW < group.small_rows:
                pieces.append((run, group.small_rows))  # the small leaves' region ends on ROWS_ALIGN rows
                run = []
            run.append((i, offset))
            end_row = -(-(offset + size(i)) // ROW)
            if large and end_row % align == 0:
                pieces.append((run, end_row))
                run = []
        if run:
            last_row = -(-(run[-1][1] + size(run[-1][0])) // ROW)
            pieces.append((run, _round_up(last_row, align) if run[0][1] // ROW >= group.small_rows
                           else group.small_rows))
        return [(run[0][1] // ROW, end, run) for run, end in pieces]

    def unflatten(self, buffers) -> Any:
        """The pytree viewed out of flat buffers (one ``lax.split`` per group)."""
        leaves = [None] * len(self.shapes)
        for group, buffer in zip(self.groups, buffers, strict=True):
            sizes, cursor = [], 0
            for i, offset in zip(group.leaves, group.offsets, strict=True):
                sizes += [offset - cursor, math.prod(self.shapes[i])]
                cursor = offset + sizes[-1]
            sizes.append(group.size - cursor)
            pieces = jax.lax.split(buffer, sizes)
            for k, i in enumerate(group.leaves):
                leaves[i] = pieces[2 * k + 1].reshape(self.shapes[i])
        return jax.tree.unflatten(self.treedef, leaves)

    def row_mask(self, mask) -> tuple[np.ndarray, ...]:
        """Per-group float32 ``[rows]``: 1.0 on rows of leaves where ``mask`` (a pytree of bools) is True."""
        flags = self._leaves_of(mask, what="mask")
        out = []
        for group in self.groups:
            rows = np.zeros(group.rows, np.float32)
            for i, offset in zip(group.leaves, group.offsets, strict=True):
                if not isinstance(flags[i], bool | np.bool_):
                    raise TypeError(f"mask leaves must be bools, got {type(flags[i]).__name__} at leaf {i}")
                if flags[i]:
                    rows[offset // ROW: (offset + math.prod(self.shapes[i]) + ROW - 1) // ROW] = 1.0
            out.append(rows)
        return tuple(out)

    def check(self, flat: "FlatParams") -> None:
        if flat.layout != self:
            raise ValueError("FlatParams were made with a different layout than this one")

    def divides(self, shards: int) -> bool:
        """Whether every group splits into ``shards`` equal blocks of whole ``ROWS_ALIGN``-row tiles."""
        return all(group.rows % (shards * ROWS_ALIGN) == 0 for group in self.groups)

    def _leaves_of(self, tree, what: str = "tree") -> list:
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"{what} structure {treedef} does not match the parameters' {self.treedef}")
        if what == "tree":
            for i, leaf in enumerate(leaves):
                if tuple(leaf.shape) != self.shapes[i] or jnp.dtype(leaf.dtype).name != self.dtypes[i]:
                    raise ValueError(f"leaf {i} is {leaf.dtype}{list(leaf.shape)}, expected "
                                     f"{self.dtypes[i]}{list(self.shapes[i])}")
        return leaves


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class FlatParams:
    """A model's parameters as one 1-D buffer per dtype; ``tree()`` gives the usual pytree view.

    ``sharding`` (static, like the layout) says how the buffers are laid over a mesh; None: one device.
    """

    buffers: tuple[jax.Array, ...]
    layout: FlatLayout
    sharding: RowSharding | None = None

    def tree(self) -> Any:
        return self.layout.unflatten(self.buffers)

    def tree_flatten(self):
        return self.buffers, (self.layout, self.sharding)

    @classmethod
    def tree_unflatten(cls, aux, buffers):
        return cls(tuple(buffers), *aux)


def flatten(tree, sharding: RowSharding | None = None) -> FlatParams:
    """``FlatParams`` holding a copy of ``tree`` (see :class:`FlatLayout`), placed by ``sharding``.

    Example (FSDP over 8 devices; ``shard_params=False`` for ZeRO-1)::

        mesh = jax.make_mesh((8,), ("data",))
        flat = flatten(params, RowSharding(mesh, "data"))   # buffers [rows * 256] sharded by rows
    """
    if sharding is None:
        return FlatLayout.of(tree).flatten(tree)
    if not isinstance(sharding, RowSharding):
        raise TypeError(f"sharding must be an apex_jax.RowSharding, got {type(sharding).__name__}")
    return place(FlatLayout.of(tree, sharding.shards).flatten(tree), sharding)


def place(flat: FlatParams, sharding: RowSharding) -> FlatParams:
    """``flat``'s buffers laid over ``sharding``'s mesh (inside ``jit``: a sharding constraint)."""
    if not flat.layout.divides(sharding.shards):
        raise ValueError(f"a layout of {[g.rows for g in flat.layout.groups]} rows per group does not split into "
                         f"{sharding.shards} shards of whole {ROWS_ALIGN}-row tiles; flatten with that RowSharding")
    spec = sharding.params_spec()
    return FlatParams(tuple(jax.device_put(b, spec) for b in flat.buffers), flat.layout, sharding)


def _rows_of(run: list, first_row: int, end_row: int, dtype: str) -> jax.Array:
    """Rows ``[first_row, end_row)`` of a buffer, ``[n, 256]``: leaves ``run`` (``(offset, leaf)`` in buffer
    order, element offsets in the buffer) in place, zeros between and around them; one leaf that fills the rows
    exactly is only reshaped (no copy)."""
    parts, cursor = [], first_row * ROW
    for offset, leaf in run:
        parts += [jnp.zeros(offset - cursor, dtype), jnp.ravel(leaf)]
        cursor = offset + leaf.size
    parts = [x for x in [*parts, jnp.zeros(end_row * ROW - cursor, dtype)] if x.size]
    return (parts[0] if len(parts) == 1 else jnp.concatenate(parts)).reshape(-1, ROW)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
