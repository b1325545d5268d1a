"""``SpecConfig``: which drafter and how many draft tokens per step; ``SpecStats``: how many were accepted."""

import dataclasses
import functools
from pathlib import Path

from serving.config import ModelConfig
from serving.spec_decode import block_model
from serving.spec_decode.adaptive import AdaptivePolicy, CostModel
from serving.spec_decode.block_drafter import BlockDrafter
from serving.spec_decode.ngram import NgramDrafter
from serving.spec_decode.protocol import Drafter, DrafterFactory
from serving.spec_decode.suffix import SuffixDrafter

SPECULATIVE_METHODS = ("ngram", "suffix", "block")  # SpecConfig.from_method (the command line's --speculative)
OFF = "off"  # SamplingParams.speculative: no drafts for this request
SUFFIX_K = 8  # suffix drafting's default k: long verbatim matches are its strength
MODEL_FREE = {"ngram": NgramDrafter, "suffix": SuffixDrafter}  # drafters every speculative engine offers per request


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """``Engine(..., speculative=SpecConfig(drafter, k))``: draft up to k tokens per sequence and step.

    ``drafter`` is a ``Drafter`` or a factory called with the target's config and params (for drafters built
    from the target, e.g. ``functools.partial(DraftModelDrafter.from_target, num_layers=8)``); ``name`` is what
    a request's ``SamplingParams.speculative`` calls it. Besides it the engine offers the model-free drafters of
    ``MODEL_FREE`` ("ngram", "suffix") per request. ``adaptive``: the engine chooses each step's draft lengths,
    or none (``AdaptivePolicy``), from measured acceptance and step times, starting from ``cost`` (a prior whose
    measurements each engine keeps in its own copy); else every decoding sequence gets up to k drafts.
    """

    drafter: Drafter | DrafterFactory
    k: int = 4
    name: str = "default"
    adaptive: bool = False
    cost: CostModel = dataclasses.field(default_factory=CostModel)

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"SpecConfig.k = {self.k!r}: expected an int >= 1 (draft tokens per step)")
        if not isinstance(self.name, str) or not self.name or self.name == OFF:
            raise ValueError(f"SpecConfig.name = {self.name!r}: expected a non-empty name other than {OFF!r}")
        if not (isinstance(self.drafter, Drafter) or callable(self.drafter)):
            raise ValueError(f"SpecConfig.drafter = {self.drafter!r}: expected a Drafter or a factory "
                             "(ModelConfig, params) -> Drafter")

    @classmethod
    def from_method(cls, method: str, drafter: str | Path | None = None, k: int | None = None,
                    adaptive: bool = False) -> "SpecConfig":
        """The config a command line names: ``"ngram"`` (prompt lookup, k = 4 unless given), ``"suffix"``
        (``SuffixDrafter``, k = SUFFIX_K unless given) or ``"block"`` (the ``BlockDrafter`` checkpoint folder
        ``drafter``, k = its trained block unless given; sampled requests get drafts sampled from the drafter's
        distribution, which it was trained to match to the target's)."""
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {method!r}: expected one of {SPECULATIVE_METHODS}")
        if method in MODEL_FREE:
            if drafter is not None:
                raise ValueError(f"speculative method {method!r} takes no drafter checkpoint (got {str(drafter)!r})")
            default_k = SUFFIX_K if method == "suffix" else cls.k
            return cls(MODEL_FREE[method](), k=k or default_k, name=method, adaptive=adaptive)
        if drafter is None:
            raise ValueError("speculative method 'block' needs a drafter checkpoint folder (python -m "
                             "examples.train_drafter --out DIR)")
        trained = block_model.load_config(drafter)  # a bad folder fails here, before the target loads
        return cls(functools.partial(BlockDrafter.load, drafter, sample=True), k=k or trained.block, name=method,
                   adaptive=adaptive)

    def policy(self) -> AdaptivePolicy | None:
        """A fresh ``AdaptivePolicy`` for one engine (its own copy of ``cost``), or None unless ``adaptive``."""
        if not self.adaptive:
            return None
        cost = dataclasses.replace(self.cost, measured=dict(self.cost.measured), samples=dict(self.cost.samples))
        return AdaptivePolicy(self.k, cost)

    def build_all(self, cfg: ModelConfig, params: dict) -> dict[str, Drafter]:
        """Every drafter a request may name: ``name``'s (``build``) and the model-free ones."""
        drafters = {self.name: self.build(cfg, params)}
        for name, make in MODEL_FREE.items():
            drafters.setdefault(name, make())
        return drafters

    def build(self, cfg: ModelConfig, params: dict) -> Drafter:
        drafter = self.drafter if isinstance(self.drafter, Drafter) else self.drafter(cfg, params)
        vocab = getattr(drafter, "vocab", cfg.vocab)
        if vocab != cfg.vocab:
            raise ValueError(f"the draft model's vocabulary has {vocab} tokens, the target's {cfg.vocab}: they must "
                             "be the same")
        return drafter


@dataclasses.dataclass
class SpecStats:
    """Acceptance counters over the sequence-steps that had at least one draft token."""

    num_steps: int = 0  # sequence-steps verified with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per drafted sequence-step: accepted drafts + the target's own token."""
        return (self.num_accepted_tokens + self.num_steps) / max(self.num_steps, 1)
