"""``SamplingParams``: how one request is sampled and when it stops (validated on construction)."""

import dataclasses

from serving.structured import ConstraintSpec

MAX_LOGPROBS = 20  # top-n logprobs a request may ask for (the sampler computes this many when any request asks)
MAX_LOGIT_BIAS = 100.0  # |bias| a token may get: +-100 bans or forces it (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's limit on logit_bias entries per request


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping.

    temperature 0 is greedy. Filters apply in order top-k, top-p, min-p to ``softmax(penalized logits / T)``;
    0 (top_k, min_p) or 1 (top_p) switch a filter off, and a top_k of the vocabulary or more keeps every token (it
    must fit the sampler's int32). Penalties: ``repetition_penalty`` r divides positive (multiplies negative)
    logits of tokens seen in the prompt or output; ``presence_penalty`` subtracts a constant from tokens seen in
    the output, ``frequency_penalty`` that times their count. ``seed`` makes sampling
    reproducible (sample i of ``n`` uses seed + i). ``logprobs`` = n returns the chosen token's logprob and the
    top n (from the model's raw distribution, before penalties and temperature). ``prompt_logprobs`` = k scores the
    prompt as the prefill computes it: each prompt token i >= 1 gets ``log_softmax(logits at i - 1)[token i]`` and
    the top k of that distribution (raw, as ``logprobs``'); sample 0 of the request carries them
    (``RequestResult.prompt_logprobs``), and it prefills its whole prompt (no cached prefix). ``constraint``
    restricts the output to a JSON schema, regex or choice (``serving.structured``): disallowed tokens are masked out.
    ``logit_bias`` ``((token_id, bias), ...)`` adds each bias (in [-100, 100]) to its token's logit before the
    penalties, as OpenAI's ``logit_bias`` does. ``speculative`` names the drafter of an engine with speculative
    decoding for this request ("off": none; None: the engine's own; ``Engine.add_request`` checks the name).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    constraint: ConstraintSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    speculative: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        checks = (("n", self.n >= 1, ">= 1"), ("max_tokens", self.max_tokens >= 1, ">= 1"),
                  ("temperature", self.temperature >= 0, ">= 0"),
                  ("top_k", 0 <= self.top_k < 2**31, "in [0, 2**31) (0: off)"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"), ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
                  ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
                  ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
                  ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
                  ("seed", self.seed is None or 0 <= self.seed < 2**32, "None or in [0, 2**32)"),
                  ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                   f"None or in [0, {MAX_LOGPROBS}]"),
                  ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                   f"None or in [0, {MAX_LOGPROBS}]"),
                  ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
                  ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS and all(
                      t >= 0 and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias),
                   f"at most {MAX_LOGIT_BIAS_TOKENS} token ids >= 0 with biases in [-{MAX_LOGIT_BIAS:g}, "
                   f"{MAX_LOGIT_BIAS:g}]"),
                  ("speculative", self.speculative is None or (isinstance(self.speculative, str) and self.speculative),
                   "None or a drafter name"))
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} = {getattr(self, name)!r}: expected {expected}")

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
