"""Adaptive speculation: per step, how many tokens to draft for each decoding sequence (0: none), from each
sequence's measured acceptance and what a verification pass costs against a plain decode step at this batch size.

Model. Sequence s accepts each draft token with probability ``a_s`` independently until its first rejection, so
d drafts emit ``1 + a_s + .. + a_s^d`` tokens in expectation: draft j adds ``a_s^j``. A verification pass over
N tokens costs ``verify(N)`` seconds; a plain decode step of B sequences costs ``decode(B)`` seconds per token of
each (a multi-step decode shares its dispatch over its steps). With B decoding sequences, the m drafts of highest
``a_s^j`` (which takes a prefix of each sequence's j = 1, 2, ..) give

    rate(m) = (B + sum of their a_s^j) / verify(B + m)       tokens per second, against   B / decode(B)

so the plan drafts the best m, or nothing unless ``rate(m) >= min_speedup * B / decode(B)``. Under load ``verify``
grows with m while ``decode`` does not, and the plan drafts less, then nothing: speculation does not slow a loaded
server down by more than the model's error.

Measurement. ``a_s`` is an exponential moving average over verification steps of accepted / tried draft tokens
(tried: those accepted plus the rejected one). A new sequence starts from the pooled estimate, the same average
over every sequence's steps (the server's recent acceptance), which starts at ``prior``. While a sequence is not
drafted its estimate relaxes towards the pooled one, and while no sequence is, the pooled one relaxes towards
``prior`` (``recovery`` per step), so drafting is tried again where text turned repetitive.

``CostModel`` gives ``verify`` and ``decode`` from a linear prior (``step_seconds + token_seconds * N``, plus
``dispatch_seconds`` per device call) until the engine's measured step times replace it, per power-of-two size
bucket (``observe``). The engine measures only steps that traced nothing (``traces``: a step that compiled is not
a step's cost); a faster sample replaces the estimate at once, a slower one moves it by ``EMA_WEIGHT`` and one
``OUTLIER`` times the estimate (a hiccup) is ignored, so an estimate too high, which would stop the very steps
that measure it, does not last. A bucket not measured yet is read off the measured ones of its kind, never
cheaper than a smaller one (``CostModel.estimate``): the prior's slope is a GPU's, and on a CPU, which pays per
token, the scaled prior can make a larger unmeasured pass look cheaper than a smaller measured one, so plans would
draft for passes that ``worth`` then turns down.

Exploration. Estimates that say "not worth it" stop the very verifications that would correct them: a run of
rejections, or a costly first verification, would end drafting for good wherever the prior sits below the
break-even (SmolLM2 on a CPU, code editing: it drafted nothing after its first pass, where drafting every step was
faster; the README's speculative figures). So plain decode steps earn a probing credit, ``explore`` of their
measured time (``AdaptivePolicy.observe``), and once the credit covers what the best plan's verification costs
beyond a plain step, ``plan`` proposes that plan anyway (a probe, paid for whether or not the drafter finds drafts):
while nothing is drafted, probing costs at most ``explore`` of the time, and a probe that is accepted lifts the
estimates back over the bar.
"""

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np

EMA_WEIGHT = 0.3  # of the newest step in the acceptance and cost averages (about the last 3 steps)
PRIOR_ACCEPTANCE = 0.5  # a new sequence's acceptance estimate
RECOVERY = 0.02  # per undrafted step: the fraction of the way an estimate relaxes back to the prior
MIN_SPEEDUP = 1.05  # a plan must promise this over a plain step (the model's error margin)
EXPLORE = 0.03  # the most of the plain steps' time that probes spend while nothing is drafted
OUTLIER = 4.0  # a measured step this many times its bucket's estimate is a hiccup: not averaged in
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"  # every jit cache miss traces (then compiles or loads)
_traced = [0]  # trace events in this process


def _count_trace(name: str, _: float, **__: object) -> None:
    if name == TRACE_EVENT:
        _traced[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_trace)


def traces() -> int:
    """Trace events so far in this process: a step during which it changed compiled (or loaded) something."""
    return _traced[0]


def size_bucket(n: int) -> int:
    """The power of two >= n: step sizes whose times the cost model shares."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@dataclasses.dataclass
class CostModel:
    """Seconds of a verification pass over N tokens and of a plain decode step of B sequences (per token of each).

    Prior: a device call costs ``dispatch_seconds`` (host work, shared by the ``decode_steps`` steps of a multi-step
    decode) plus ``step_seconds + token_seconds * N`` on the device. ``observe`` replaces the prior per size bucket
    with an average of measured times (``online``; False: the prior stays, e.g. for a reproducible plan); a bucket
    not measured yet is read off the measured ones of its kind (``estimate``) or, with none, takes the prior times
    ``scale``, the average ratio of measured to prior times, so that a measured verification is weighed against a
    decode step on the same machine's scale.
    """

    dispatch_seconds: float = 2e-4
    step_seconds: float = 1e-3
    token_seconds: float = 2e-6
    online: bool = True
    measured: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    samples: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    scale: float = 1.0

    def __post_init__(self):
        for name in ("dispatch_seconds", "step_seconds", "token_seconds"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CostModel.{name} = {getattr(self, name)!r}: expected >= 0 seconds")

    def prior(self, kind: str, size: int, decode_steps: int = 1) -> float:
        """The prior's seconds of a step of ``kind`` (``verify``'s or ``decode``'s) and ``size``, unscaled."""
        dispatch = self.dispatch_seconds / (decode_steps if kind == "decode" else 1)
        return dispatch + self.step_seconds + self.token_seconds * size

    def verify(self, num_tokens: int) -> float:
        """Seconds of a verification pass (one device call) over ``num_tokens`` tokens."""
        return self.estimate("verify", num_tokens)

    def decode(self, batch: int, decode_steps: int = 1) -> float:
        """Seconds per token of each of ``batch`` sequences in a plain decode of ``decode_steps`` steps per call."""
        return self.estimate("decode", batch, decode_steps)

    def estimate(self, kind: str, size: int, decode_steps: int = 1) -> float:
        """Seconds of a step of ``kind`` and ``size``: its bucket's measured time, else one read off the measured
        buckets of that kind (x: the bucket's size, the padded size a step runs at), else the scaled prior.

        Steps cost more the larger they are, and the prior's slope can be far off (a CPU pays per token what a GPU
        pays per call), so between two measured buckets the time is interpolated linearly, below the smallest it is
        at most that one's, and above the largest it grows at least at the slope of the two largest, from the
        largest: an unmeasured bucket never looks cheaper than a smaller measured one.
        """
        bucket = size_bucket(size)
        if (kind, bucket) in self.measured:
            return self.measured[kind, bucket]
        guess = self.scale * self.prior(kind, size, decode_steps)
        points = sorted((b, t) for (k, b), t in self.measured.items() if k == kind)
        below, above = [p for p in points if p[0] < bucket], [p for p in points if p[0] > bucket]
        if below and above:
            (b0, t0), (b1, t1) = below[-1], above[0]
            return t0 + (t1 - t0) * (bucket - b0) / (b1 - b0)
        if above:
            return min(guess, above[0][1])
        if below:
            (b1, t1), slope = below[-1], 0.0
            if len(below) > 1:
                b0, t0 = below[-2]
                slope = max(0.0, (t1 - t0) / (b1 - b0))
            return max(guess, t1 + slope * (bucket - b1))
        return guess

    def observe(self, kind: str, size: int, seconds: float) -> None:
        """A measured step (one that compiled nothing): ``kind`` "verify" (size: tokens, seconds: the pass) or
        "decode" (size: sequences, seconds: per token of each), folded into its size bucket's estimate (module
        docstring)."""
        if kind not in ("verify", "decode"):
            raise ValueError(f"CostModel.observe: kind={kind!r}: expected 'verify' or 'decode'")
        if not self.online:
            return
        key = kind, size_bucket(size)
        estimate = self.measured.get(key)
        if estimate is not None and seconds >= OUTLIER * estimate:  # a hiccup
            return
        ratio = seconds / max(self.prior(kind, size), 1e-12)
        self.scale = ratio if not self.samples else self.scale + EMA_WEIGHT * (ratio - self.scale)
        self.samples[key] = self.samples.get(key, 0) + 1
        if estimate is None or seconds <= estimate:
            self.measured[key] = seconds
        else:
            self.measured[key] = estimate + EMA_WEIGHT * (seconds - estimate)


@dataclasses.dataclass
class AdaptivePolicy:
    """Chooses each step's draft lengths (module docstring); ``max_k``: the most drafts per sequence."""

    max_k: int
    cost: CostModel = dataclasses.field(default_factory=CostModel)
    prior: float = PRIOR_ACCEPTANCE
    ema: float = EMA_WEIGHT
    recovery: float = RECOVERY
    min_speedup: float = MIN_SPEEDUP
    explore: float = EXPLORE
    credit: float = 0.0  # seconds of probing earned by plain decode steps, spent by probes
    probing: bool = False  # the last plan is a probe: ``worth`` lets its drafts be verified
    accepted: dict[int, float] = dataclasses.field(default_factory=dict)  # seq_id -> EMA of accepted drafts
    tried: dict[int, float] = dataclasses.field(default_factory=dict)  # seq_id -> EMA of tried drafts
    pooled: list[float] = dataclasses.field(default_factory=list)  # [accepted, tried] EMAs over every sequence

    def __post_init__(self):
        checks = (("max_k", self.max_k >= 1, ">= 1"), ("prior", 0 <= self.prior < 1, "in [0, 1)"),
                  ("ema", 0 < self.ema <= 1, "in (0, 1]"), ("recovery", 0 <= self.recovery <= 1, "in [0, 1]"),
                  ("min_speedup", self.min_speedup > 0, "> 0"), ("explore", 0 <= self.explore < 1, "in [0, 1)"))
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"AdaptivePolicy.{name} = {getattr(self, name)!r}: expected {expected}")
        self.pooled = self.pooled or [self.prior, 1.0]

    def pooled_acceptance(self) -> float:
        """The estimate a new sequence starts from: acceptance over every sequence's recent steps."""
        return min(self.pooled[0] / self.pooled[1], 1 - 1e-6)

    def acceptance(self, seq_id: int) -> float:
        """The estimate of ``a_s``: the chance that each draft token is accepted."""
        if seq_id not in self.tried:
            return self.pooled_acceptance()
        return min(self.accepted[seq_id] / self.tried[seq_id], 1 - 1e-6)

    def rate(self, seq_ids: Sequence[int], drafts: Sequence[int]) -> float:
        """Expected tokens per second of a verification pass with ``drafts[i]`` tokens for ``seq_ids[i]``."""
        emitted = sum(sum(self.acceptance(s) ** j for j in range(d + 1)) for s, d in zip(seq_ids, drafts, strict=True))
        return emitted / self.cost.verify(len(seq_ids) + sum(drafts))

    def plain_rate(self, batch: int, decode_steps: int = 1) -> float:
        """Tokens per second of plain decode steps of ``batch`` sequences."""
        return batch / self.cost.decode(batch, decode_steps)

    def observe(self, kind: str, size: int, seconds: float, steps: int = 1) -> None:
        """A measured step that compiled nothing (``CostModel.observe``: ``seconds`` per step); a plain decode call of
        ``steps`` steps also earns ``explore`` of its time as probing credit."""
        self.cost.observe(kind, size, seconds)
        if kind == "decode":
            self.credit += self.explore * seconds * steps

    def choose(self, seq_ids: Sequence[int], limits: Sequence[int] | None = None,
               decode_steps: int = 1) -> tuple[list[int], float | None]:
        """What ``plan`` would draft now, changing nothing: (drafts per sequence, the probe's cost beyond a plain step
        where the drafts are a probe, else None)."""
        limits = [self.max_k] * len(seq_ids) if limits is None else [min(n, self.max_k) for n in limits]
        gains = sorted(((self.acceptance(s) ** j, i, j) for i, s in enumerate(seq_ids)
                        for j in range(1, limits[i] + 1)), key=lambda g: (-g[0], g[1], g[2]))
        batch = len(seq_ids)
        drafts = [0] * batch
        if not gains:
            return drafts, None
        emitted = batch + np.cumsum([0.0] + [g[0] for g in gains])
        rates = emitted / np.array([self.cost.verify(batch + m) for m in range(len(gains) + 1)])
        best, probe = int(np.argmax(rates)), None  # the first of equal rates: fewer drafts
        if not (best > 0 and rates[best] >= self.min_speedup * self.plain_rate(batch, decode_steps)):
            best = 1 + int(np.argmax(rates[1:]))  # the best plan that drafts, as a probe if the credit pays for it
            probe = max(0.0, self.cost.verify(batch + best) - self.cost.decode(batch, decode_steps))
            if probe > self.credit:
                return drafts, None
        for _, i, _ in gains[:best]:
            drafts[i] += 1
        return drafts, probe

    def plan(self, seq_ids: Sequence[int], limits: Sequence[int] | None = None, decode_steps: int = 1) -> list[int]:
        """Drafts per sequence for this step (all 0: a plain step), each at most ``limits[i]`` (default max_k): the
        best plan if it clears the bar, else a probe the credit pays for (charged now), else none; the sequences
        left at 0 relax towards the pooled estimate, which relaxes towards the prior if all are."""
        drafts, probe = self.choose(seq_ids, limits, decode_steps)
        self.probing = probe is not None
        if self.probing:
            self.credit -= probe
        for s, d in zip(seq_ids, drafts, strict=True):
            if d == 0 and s in self.tried:
                self.accepted[s] += self.recovery * (self.pooled_acceptance() * self.tried[s] - self.accepted[s])
        if not any(drafts):
            self.pooled[0] += self.recovery * (self.prior * self.pooled[1] - self.pooled[0])
        return drafts

    def worth(self, seq_ids: Sequence[int], drafts: Sequence[int], decode_steps: int = 1) -> bool:
        """Whether a verification pass with these (proposed) drafts beats plain decode steps, or they are the
        drafts of the probe the last ``plan`` paid for."""
        return any(drafts) and (self.probing or self.rate(seq_ids, drafts)
                                >= self.min_speedup * self.plain_rate(len(seq_ids), decode_steps))

    def update(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """A verification step of ``seq_id`` kept ``num_accepted`` of its ``num_drafts`` drafts."""
        if num_drafts == 0:
            return
        tried = num_accepted + (num_accepted < num_drafts)
        if seq_id not in self.tried:
            self.accepted[seq_id], self.tried[seq_id] = self.pooled_acceptance(), 1.0
        self.accepted[seq_id] += self.ema * (num_accepted - self.accepted[seq_id])
        self.tried[seq_id] += self.ema * (tried - self.tried[seq_id])
        self.pooled[0] += self.ema * (num_accepted - self.pooled[0])
        self.pooled[1] += self.ema * (tried - self.pooled[1])

    def release(self, seq_id: int) -> None:
        self.accepted.pop(seq_id, None)
        self.tried.pop(seq_id, None)
