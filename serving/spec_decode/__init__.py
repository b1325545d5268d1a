"""Lossless speculative decoding: drafters propose tokens, the target scores them in one pass and keeps a prefix.

``protocol.py`` says what a drafter is; ``verify.py`` the acceptance rule that keeps the target's output
distribution; the drafters are ``ngram.py`` (prompt lookup in the sequence's own history), ``suffix.py`` (the
longest matching suffix in the sequence's context and the server's recent outputs, frequency-scored),
``draft_model.py`` (a smaller model on its own paged cache) and ``block_drafter.py`` (all k tokens in one pass
from the target's hidden states, the network in ``block_model.py``); ``adaptive.py`` chooses each step's draft
lengths from measured acceptance and step costs; ``config.py`` holds ``SpecConfig``, what an ``Engine`` is given;
``step.py`` the verification pass over the target's runner, which ``serving.llm_engine.Engine`` runs. Imports run
one way: ``serving.llm_engine`` -> this package -> the engine's parts (``serving.engine``: allocator, runner,
sampler), which import nothing of it.
"""

from serving.spec_decode.adaptive import AdaptivePolicy, CostModel
from serving.spec_decode.block_drafter import BlockDrafter
from serving.spec_decode.config import MODEL_FREE, OFF, SPECULATIVE_METHODS, SpecConfig, SpecStats
from serving.spec_decode.draft_model import DraftModelDrafter
from serving.spec_decode.ngram import NgramDrafter
from serving.spec_decode.protocol import (
    NO_DRAFT,
    Drafter,
    DraftRequest,
    HiddenSpan,
    HiddenStateDrafter,
    Proposal,
    merge_proposals,
)
from serving.spec_decode.suffix import SuffixDrafter
from serving.spec_decode.verify import VerifyResult, grammar_drafts, verify

__all__ = ["MODEL_FREE", "NO_DRAFT", "OFF", "SPECULATIVE_METHODS", "AdaptivePolicy", "BlockDrafter", "CostModel",
           "DraftModelDrafter", "DraftRequest", "Drafter", "HiddenSpan", "HiddenStateDrafter", "NgramDrafter",
           "Proposal", "SpecConfig", "SpecStats", "SuffixDrafter", "VerifyResult", "grammar_drafts",
           "merge_proposals", "verify"]
