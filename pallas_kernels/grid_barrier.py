"""A grid barrier for cooperative Pallas (Triton) kernels: the programs of one slot wait for each other.

An int32 arrival counter per slot lives in a zeroed global buffer (the kernel's input aliased to an output). A CTA
barrier orders the stores of all the program's threads before one thread's ``atomic_add`` (acq_rel, GPU scope)
releases them; the program then spins until the count reaches G x (barriers passed), and a second CTA barrier
holds its threads until then: the grid-sync pattern of CUDA cooperative groups. The count only grows, so it is
never reset. ``spin`` picks how a program waits:

  "atomic"   re-reads the counter with an atomic add of 0 (an acquiring read through L2's atomic unit, which
             serializes the G spinners' reads of one address);
  "load"     a volatile load followed by a ``fence.acq_rel.gpu`` (plain L2 reads);
  "relaxed"  volatile loads alone and one ``fence.acq_rel.gpu`` after the count showed every arrival (what
             cooperative groups' grid sync does: a strong read that sees the releasing atomics, then an acquire
             fence, synchronizes with them in PTX's memory model; no fence per read).

A program waits for the other G - 1 of its slot, so all of them must be resident at once (the kernel's launch
checks that). Should one still not be (another kernel holding SMs), a barrier gives up after BARRIER_SPINS reads
(about a second) instead of hanging the GPU and adds BARRIER_BROKEN to the slot's counter: every later barrier of
the slot opens at once, and :func:`broken` tells the programs to write NaN results. Interpret mode runs programs
one after another, where a barrier of G > 1 programs would never open: there G must be 1, and a barrier only
counts.

Data exchanged between programs must be read with :data:`exchange_load` (volatile: served by L2, never by L1,
which is not coherent across SMs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SPINS = ("atomic", "load", "relaxed")
# Every exchange-buffer read is volatile (ld.volatile, a relaxed system-scope load on sm_70+): served from L2,
# never from L1. (The ".cg" cache modifier would do too, but jax 0.11.2's Triton lowering cannot emit it: it looks
# ".cg" up among the names "cg", ... and raises KeyError.)
exchange_load = functools.partial(plgpu.load, volatile=True)
BARRIER_SPINS = 1 << 20  # reads before giving up: about a second; co-resident programs arrive within microseconds
BARRIER_BROKEN = 1 << 30  # far above any count a kernel reaches (G x barriers per launch)
# spin="load": after each volatile read of the counter, an acquire-release fence at GPU scope, so that no exchange
# read after the barrier is served before the counter showed every arrival (spin="relaxed": once, after the read
# that showed it). The value passes through the asm, which keeps the fence after that read.
ACQUIRE_FENCE = "fence.acq_rel.gpu;\n\tmov.b32 $0, $1;"


def _spin_atomic(counter_ref, slot):
    return plgpu.atomic_add(counter_ref, slot, np.int32(0))  # an acquiring read (acq_rel RMW of 0)


def _acquire(seen):
    """The counter value ``seen`` (int32 ``[1]``) passed through ACQUIRE_FENCE: the fence follows its read."""
    (seen,) = plgpu.elementwise_inline_asm(ACQUIRE_FENCE, args=[seen], constraints="=r,r", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    return seen


def _spin_relaxed(counter_ref, slot):
    return exchange_load(counter_ref.at[pl.ds(slot, 1)])[0]


def _spin_load(counter_ref, slot):
    return _acquire(exchange_load(counter_ref.at[pl.ds(slot, 1)]))[0]


_SPIN_READS = {"atomic": _spin_atomic, "load": _spin_load, "relaxed": _spin_relaxed}


def barrier(counter_ref, slot, passed: jax.Array, *, groups: int, spin: str, interpret: bool) -> jax.Array:
    """Wait until the ``groups`` programs of slot ``slot`` have all arrived; returns ``passed + 1``.

    ``counter_ref``: the int32 ``[slots]`` arrival counters; ``passed``: the number of barriers the slot has
    passed, so the counter reaches ``groups * (passed + 1)``.
    """
    if not interpret:
        plgpu.debug_barrier()  # a CTA barrier: every thread's exchange stores come before the release below
    seen = plgpu.atomic_add(counter_ref, slot, np.int32(1)) + 1  # one thread; acq_rel at GPU scope
    if groups > 1:  # spin until everyone arrived; a lone program waits for no one
        target = groups * (passed + 1)
        read = _SPIN_READS[spin]
        seen, _ = jax.lax.while_loop(lambda c: (c[0] < target) & (c[1] < BARRIER_SPINS),
                                     lambda c: (read(counter_ref, slot), c[1] + 1), (seen, np.int32(0)))
        if spin == "relaxed":  # the acquire, once the count showed every arrival
            seen = _acquire(jnp.broadcast_to(seen, (1,)))[0]

        @pl.when(seen < target)
        def _give_up():  # a program of the slot never came (not resident): open the slot's barriers for good
            plgpu.atomic_add(counter_ref, slot, np.int32(BARRIER_BROKEN))

    if not interpret:
        plgpu.debug_barrier()  # no thread reads the exchange before the acquire above
    return passed + 1


def broken(counter_ref, slot) -> jax.Array:
    """Whether a barrier of slot ``slot`` gave up (bool scalar): then the slot's results are not to be trusted."""
    return plgpu.atomic_add(counter_ref, slot, np.int32(0)) >= BARRIER_BROKEN
