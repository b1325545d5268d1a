"""One generated sequence: its tokens, cache blocks, streamed text and stop conditions.

A request with ``SamplingParams.n`` samples is ``n`` sequences. ``tokens = prompt_ids + output_ids``; the first
``num_computed`` of them have k/v in the cache blocks of ``block_table``. The model's logits at the last token
give the next one, so a sequence with ``len(tokens) - num_computed == 1`` is decoding and one with more is
(re)filling its prompt. Preemption resets ``num_computed`` to 0: the whole sequence is recomputed later.
"""

import dataclasses

from serving.engine.sampling_params import SamplingParams
from serving.images import RequestImages
from serving.structured import ConstraintMatcher
from serving.tokenizer import Detokenizer

STOP, LENGTH = "stop", "length"  # finish reasons: a stop condition met, or max_tokens / the context length
# finish reason of a sequence whose output constraint failed (its grammar gave up, or admitted no token but an early
# eos): the request fails alone, with ``SequenceState.error``, and the other sequences of its step go on
ERROR = "error"


@dataclasses.dataclass(eq=False)
class SequenceState:
    seq_id: int  # unique, increasing with arrival (larger = newer)
    request_id: str
    index: int  # which of the request's n samples
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    eos_ids: tuple[int, ...]
    max_len: int  # context length: generation stops when tokens reach it
    detokenizer: Detokenizer | None = None
    cache_salt: str | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict] = dataclasses.field(default_factory=list)  # per output token, when params.logprobs
    # per prompt token (the first None: no context), on the sample that scores its prompt (params.prompt_logprobs)
    prompt_logprobs: list[dict | None] | None = None
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied at the last admission
    block_table: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of the registered full blocks
    text: str = ""  # output text so far (a stop string and anything after it cut off)
    emitted: int = 0  # characters of text already returned
    finish_reason: str | None = None
    error: str | None = None  # why the sequence failed (finish_reason ERROR)
    draft_ids: list[int] = dataclasses.field(default_factory=list)  # speculative tokens to verify this step
    matcher: ConstraintMatcher | None = None  # structured-output state (params.constraint), advanced by append
    images: RequestImages | None = None  # the prompt's images (vision-language models), shared by the n samples

    def block_salt(self, block: int, block_size: int) -> str | None:
        """The prefix-cache salt of full block ``block``: ``cache_salt``, and the digests of the images whose
        placeholder tokens it holds (``blocks.hash_block``)."""
        digests = self.images.salt(block * block_size, (block + 1) * block_size) if self.images else ""
        return f"{self.cache_salt or ''}|images:{digests}" if digests else self.cache_salt

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill scores the prompt (``prompt_logprobs``): until its first token, so a recompute after a
        preemption scores it again only if it came before that."""
        return self.prompt_logprobs is not None and not self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> str:
        """Add a sampled token, apply the stop conditions, and return the new text safe to emit.

        An eos or stop token ends the sequence and adds no text. A stop string ends it with the text cut before
        the stop string; while the text ends in a possible start of a stop string, that tail is held back. A token
        the output constraint cannot take (``ConstraintMatcher.advance`` raised) ends it with ``ERROR``.
        """
        self.output_ids.append(token)
        if self.matcher is not None:
            try:
                self.matcher.advance(token)
            except ValueError as e:
                self.finish_reason, self.error = ERROR, f"the output constraint failed: {e}"
                return ""
        p, detokenizer = self.params, self.detokenizer
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            self.finish_reason = STOP
        elif detokenizer is not None:
            start = max(0, len(self.text) - max((len(s) for s in p.stop), default=0)) if p.stop else 0
            self.text += detokenizer.add(token)
            hits = [i for s in p.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text, self.finish_reason = self.text[:min(hits)], STOP
        if self.finish_reason is None and (len(self.output_ids) >= p.max_tokens
                                           or len(self.prompt_ids) + len(self.output_ids) >= self.max_len):
            self.finish_reason = LENGTH
            if detokenizer is not None:
                self.text += detokenizer.finish()
        if detokenizer is None:  # token ids only (the engine core's sequences): no text to emit
            return ""
        end = len(self.text) if self.finish_reason is not None else len(self.text) - self._held_back()
        delta, self.emitted = self.text[self.emitted:end], max(self.emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        if not self.params.stop:  # most samples: nothing to hold back, every token
            return 0
        for n in range(min(len(self.text), max((len(s) for s in self.params.stop), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.params.stop):
                return n
        return 0
