"""Structured output: JSON schema, JSON object, regex and choice constraints applied as token masks.

A request's constraint (`ConstraintSpec`) is compiled once per (spec, tokenizer, vocab size) into a grammar
(`compile_constraint`, cached); each sequence gets its own `ConstraintMatcher`, a cheap copy of the compiled
one that follows the tokens it generates. Before every sampling step (while the device runs the step's forward
pass: `serving.engine.runner`) the host packs the allowed tokens of the batch into bits, ``bitmask [B, W]``
int32 with ``W = ceil(V / 32)`` and token ``t`` at bit ``t % 32`` of word ``t // 32`` (`fill_token_bitmask`;
rows without a constraint allow everything), and the jitted sampler sets the logits of disallowed tokens to
-inf (`apply_token_bitmask`). Bits are 1/32 of a bool mask to send to the device: at V = 49152 and B = 16 that
is 96 KiB instead of 768 KiB per step.

The grammars come from llguidance (an Earley parser over a lazily built lexer; no torch), chosen by
`benchmarks/structured_output.py` against outlines-core with SmolLM2's 49k-token vocabulary on 2 CPU cores
(`benchmarks/results/structured_output_cpu.json`): llguidance compiles each of 10 JSON schemas, a regex and a
choice in 1-10 ms where outlines-core builds its token-level index in 0.03-2.4 s (a new schema per request would
stall it that long). Per token, outlines-core's precomputed masks are faster (median 2-47 us vs 3-280 us, and a
fresh llguidance matcher's first mask takes up to ~10 ms while its lexer warms up), but over a 100-token output
llguidance still costs ~100x less in all. It also supports recursive schemas and `json_object` (a regex index
cannot), follows `additionalProperties`, and rolls tokens back for speculative decoding. Both agreed on every
generated token. xgrammar was not measured: it needs torch and transformers, too heavy for this project.

Vocabulary: the model's logits may have more rows than the tokenizer has ids (embedding padding); those ids
are never allowed. The eos ids are allowed exactly when the grammar accepts the text so far; once the grammar
admits no further text, eos is the only allowed token (`is_finished`).

Speculative decoding (`serving.spec_decode`): a constrained sequence's drafts ``d_1..d_k`` end at the first one
its grammar rejects (`ConstraintMatcher.num_valid`), and verification position j gets the mask after ``d_1..d_j``
(`fill_draft_bitmask`: llguidance advances a matcher over the drafts and rolls it back), so the target's tokens
are checked against exactly the masks sampling without speculation would use.
"""

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import llguidance
import llguidance.numpy
import numpy as np

from serving.tokenizer import Tokenizer

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice"]
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice")
BITS_PER_WORD = 32  # tokens per int32 word of a packed bitmask
ALL_ALLOWED = -1  # an int32 word with every bit set
# JSON output is compact ("," and ":" without spaces): a small model under a flexible-whitespace grammar can
# spend its whole token budget on newlines. A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}
COMPILED_CACHE_SIZE = 256  # compiled constraints kept (clients often repeat one schema)
TOKENIZER_CACHE_SIZE = 8  # llguidance views of (tokenizer, vocab size); building one takes ~0.4 s
ERROR_PREVIEW_CHARS = 200  # how much of a bad constraint's value an error message quotes


class InvalidConstraintError(ValueError):
    """A constraint that cannot be compiled (bad JSON schema, regex or choice list): the client's fault (400)."""


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= ERROR_PREVIEW_CHARS else text[:ERROR_PREVIEW_CHARS] + "..."


@dataclasses.dataclass(frozen=True)
class ConstraintSpec:
    """What the output must match (hashable, so compiled grammars are cached per spec).

    Attributes:
      kind: "json_schema" (value: the schema as JSON text), "json_object" (any JSON object; value None),
        "regex" (value: a pattern the whole output must match, Rust `regex` syntax), or "choice" (value: a tuple
        of strings, the output is exactly one of them).
    """

    kind: ConstraintKind
    value: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidConstraintError(f"constraint kind {self.kind!r}: expected one of {CONSTRAINT_KINDS}")
        if self.kind == "json_object" and self.value is not None:
            raise InvalidConstraintError(f"json_object takes no value, got {_preview(self.value)}")
        if self.kind in ("json_schema", "regex") and not (isinstance(self.value, str) and self.value):
            raise InvalidConstraintError(f"{self.kind} needs a non-empty string, got {_preview(self.value)}")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as e:
                raise InvalidConstraintError(f"json_schema {_preview(self.value)} is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise InvalidConstraintError(f"json_schema must be a JSON object, got {_preview(self.value)}")
        if self.kind == "choice" and not (isinstance(self.value, tuple) and self.value
                                          and all(isinstance(c, str) and c for c in self.value)):
            raise InvalidConstraintError(f"choice needs a non-empty tuple of non-empty strings, got "
                                         f"{_preview(self.value)}")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> "ConstraintSpec":
        """Output is JSON valid under `schema` (a dict or its JSON text; stored as compact JSON text, key order
        kept: properties are generated in the schema's order)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidConstraintError(f"json_schema {_preview(schema)} is not valid JSON: {e}") from None
        if not isinstance(schema, Mapping):
            raise InvalidConstraintError(f"json_schema must be a JSON object, got {_preview(schema)}")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> "ConstraintSpec":
        """Output is any JSON object."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "ConstraintSpec":
        """The whole output matches `pattern`."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> "ConstraintSpec":
        """Output is exactly one of `choices`."""
        if isinstance(choices, str):
            raise InvalidConstraintError(f"choice takes a list of strings, got the string {_preview(choices)}")
        return cls("choice", tuple(choices))


def _grammar(spec: ConstraintSpec) -> str:
    """llguidance's serialized grammar for `spec` (not yet checked)."""
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec.value)))
    schema = spec.value if spec.kind == "json_schema" else '{"type":"object"}'
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


@functools.lru_cache(maxsize=TOKENIZER_CACHE_SIZE)
def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids))


class ConstraintMatcher:
    """One sequence's position in a constraint's grammar: the tokens it may sample next, and its history.

    Not thread-safe; one per sequence. Made by `CompiledConstraint.matcher`.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_tokens = 0  # tokens advanced over (and not rolled back), eos included
        # llguidance keeps no history entry for eos, so it is never passed to it: taking eos is recorded here,
        # which lets a rollback undo it like any other token.
        self._ended = False

    @property
    def bitmask_words(self) -> int:
        return -(-self.vocab_size // BITS_PER_WORD)

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into `out` ``[bitmask_words]`` int32 (C-contiguous), one bit per token."""
        if out.dtype != np.int32 or out.shape != (self.bitmask_words,) or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"fill_bitmask: out is {out.dtype}{list(out.shape)}, expected a C-contiguous "
                             f"int32[{self.bitmask_words}]")
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def allowed_tokens(self) -> np.ndarray:
        """``[vocab_size]`` bool: which tokens may come next (eos ids only while the grammar accepts)."""
        words = np.empty(self.bitmask_words, np.int32)
        self.fill_bitmask(words)
        return np.unpackbits(words.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)

    def advance(self, token_id: int) -> None:
        """Consume a sampled token; a token the grammar does not allow raises ValueError (a sampler bug: the
        matcher is unusable afterwards). Nothing may follow eos."""
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"advance: token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self._ended:
            raise ValueError(f"advance: token {token_id} after eos")
        if token_id in self.eos_token_ids:
            if not self._matcher.is_accepting():
                why = f": {self._matcher.get_error().splitlines()[0]}" if self._matcher.is_error() else ""
                raise ValueError(f"advance: eos {token_id} before the output is complete ({self.num_tokens} tokens)"
                                 f"{why}")
            self._ended = True
        elif not self._matcher.consume_token(token_id):
            error = self._matcher.get_error().splitlines()[0]
            raise ValueError(f"advance: token {token_id} is not allowed after {self.num_tokens} tokens: {error}")
        self.num_tokens += 1

    def rollback(self, n: int) -> None:
        """Undo the last `n` advances (rejected speculative tokens), restoring the state before them."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"rollback({n}): expected 0 <= n <= {self.num_tokens} (tokens advanced)")
        grammar_tokens = n - 1 if self._ended and n else n
        if grammar_tokens and not self._matcher.rollback(grammar_tokens):
            raise ValueError(f"rollback({n}) failed: {self._matcher.get_error().splitlines()[0]}")
        self._ended = self._ended and not n
        self.num_tokens -= n

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` `advance` would take one after another from here (eos where the
        output before it is complete, and nothing after eos); the state is unchanged."""
        if self._ended:
            return 0
        ids = [int(t) for t in token_ids]
        end = next((i for i, t in enumerate(ids) if t in self.eos_token_ids), len(ids))
        n = self._matcher.validate_tokens(ids[:end])
        if n < end or end == len(ids):
            return n
        for token in ids[:n]:  # an eos follows n valid tokens: is the output complete after them?
            self.advance(token)
        accepting = self.is_accepting()
        self.rollback(n)
        return n + accepting

    def is_accepting(self) -> bool:
        """The output so far is complete under the grammar (eos may be sampled)."""
        return self._matcher.is_accepting()

    def is_finished(self) -> bool:
        """No token but eos may follow (the grammar is complete and cannot extend), or eos was consumed."""
        return self._ended or self._matcher.is_stopped()


@dataclasses.dataclass(frozen=True)
class CompiledConstraint:
    """A checked grammar for one spec and vocabulary; `matcher()` starts a sequence on it."""

    spec: ConstraintSpec
    vocab_size: int
    eos_token_ids: frozenset[int]
    _initial: llguidance.LLMatcher

    def matcher(self) -> ConstraintMatcher:
        """A fresh matcher at the start of the output (a copy: the compiled lexer and grammar are shared)."""
        return ConstraintMatcher(self._initial.deep_copy(), self.vocab_size, self.eos_token_ids)


@functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)
def compile_constraint(spec: ConstraintSpec, tokenizer: Tokenizer, vocab_size: int | None = None
                       ) -> CompiledConstraint:
    """Compile `spec` for `tokenizer` and a model with `vocab_size` logits (default: the tokenizer's size).

    Cached per (spec, tokenizer, vocab_size) (`compile_constraint.cache_clear()` empties it). Raises
    InvalidConstraintError for a schema, regex or choice list the grammar library rejects, ValueError if
    `vocab_size` is smaller than the tokenizer's vocabulary.
    """
    if not isinstance(spec, ConstraintSpec):
        raise TypeError(f"compile_constraint takes a ConstraintSpec, got {type(spec).__name__}")
    vocab_size = tokenizer.vocab_size if vocab_size is None else int(vocab_size)
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} ids")
    matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer, vocab_size), _grammar(spec), log_level=0)
    if matcher.is_error():
        raise InvalidConstraintError(f"invalid {spec.kind} constraint {_preview(spec.value)}: {matcher.get_error()}")
    probe = matcher.deep_copy()  # the first mask: a grammar that cannot start (an empty character class, a
    probe.compute_bitmask()  # schema that only refers to itself) fails here, before any step samples under it
    if probe.is_error():
        raise InvalidConstraintError(f"{spec.kind} constraint {_preview(spec.value)} admits no output: "
                                     f"{probe.get_error().splitlines()[0]}")
    return CompiledConstraint(spec, vocab_size, frozenset(tokenizer.eos_token_ids), matcher)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def fill_token_bitmask(matchers: Sequence[ConstraintMatcher | None], vocab_size: int,
                       num_rows: int | None = None) -> np.ndarray:
    """``[num_rows, ceil(vocab_size / 32)]`` int32 packed allowed tokens of each row, computed in parallel.

    Row i follows ``matchers[i]``; rows whose matcher is None, and padding rows up to `num_rows` (default
    ``len(matchers)``), allow every token.
    """
    num_rows = len(matchers) if num_rows is None else num_rows
    _check_matchers("fill_token_bitmask", matchers, vocab_size, num_rows)
    bitmask = np.full((num_rows, -(-vocab_size // BITS_PER_WORD)), ALL_ALLOWED, np.int32)
    rows = [(m._matcher, i) for i, m in enumerate(matchers) if m is not None]
    if rows:
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), rows, bitmask)
    return bitmask


def fill_draft_bitmask(matchers: Sequence[ConstraintMatcher | None], drafts: Sequence[Sequence[int]], vocab_size: int,
                       positions: int, num_rows: int | None = None) -> np.ndarray:
    """``[num_rows * positions, ceil(vocab_size / 32)]`` int32 packed masks of speculative verification, computed in
    parallel: row ``i * positions + j`` allows the tokens that may follow ``matchers[i]``'s output and then
    ``drafts[i][:j]`` (fewer than `positions` drafts per row).

    A row's masks stop at its first draft the grammar rejects (the last mask is the one rejecting it) or at an
    eos: verification goes no further, so the rows after allow every token, as do the rows of a matcher that is
    None and of the padding up to `num_rows` (default ``len(matchers)``) sequences. The matchers are unchanged.
    """
    num_rows = len(matchers) if num_rows is None else num_rows
    _check_matchers("fill_draft_bitmask", matchers, vocab_size, num_rows)
    if len(drafts) != len(matchers):
        raise ValueError(f"fill_draft_bitmask: {len(drafts)} draft lists for {len(matchers)} matchers")
    for i, d in enumerate(drafts):
        if len(d) >= positions:
            raise ValueError(f"fill_draft_bitmask: row {i} has {len(d)} drafts, expected at most positions - 1 = "
                             f"{positions - 1}")
    bitmask = np.full((num_rows * positions, -(-vocab_size // BITS_PER_WORD)), ALL_ALLOWED, np.int32)
    rows = [(m._matcher, i * positions, [int(t) for t in d])
            for i, (m, d) in enumerate(zip(matchers, drafts, strict=True)) if m is not None]
    drafted = [row for row in rows if row[2]]
    undrafted = [(m, first) for m, first, d in rows if not d]  # (llguidance's draft variant takes no empty list)
    if drafted:  # llguidance advances each matcher over its drafts, one mask per position, then rolls them back
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(_executor(), drafted, bitmask)
    if undrafted:
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), undrafted, bitmask)
    return bitmask


def _check_matchers(caller: str, matchers: Sequence[ConstraintMatcher | None], vocab_size: int,
                    num_rows: int) -> None:
    if num_rows < len(matchers):
        raise ValueError(f"{caller}: num_rows={num_rows} < {len(matchers)} matchers")
    for m in matchers:
        if m is not None and m.vocab_size != vocab_size:
            raise ValueError(f"{caller}: a matcher has vocab_size={m.vocab_size}, expected {vocab_size}")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """``logits [B, V]`` with every token whose bit in ``bitmask [B, W]`` int32 (W >= V / 32) is 0 set to -inf.

    Token t is bit ``t % 32`` of word ``t // 32``; an all-ones row (`ALL_ALLOWED`) passes its logits through.
    """
    batch, vocab = logits.shape
    if bitmask.ndim != 2 or bitmask.shape[0] != batch or bitmask.shape[1] * BITS_PER_WORD < vocab:
        raise ValueError(f"apply_token_bitmask: bitmask shape {tuple(bitmask.shape)} does not cover logits "
                         f"{tuple(logits.shape)}: expected ({batch}, >= {-(-vocab // BITS_PER_WORD)})")
    bits = jnp.right_shift(bitmask[:, :, None], jnp.arange(BITS_PER_WORD, dtype=bitmask.dtype)) & 1  # [B, W, 32]
    allowed = bits.reshape(batch, -1)[:, :vocab].astype(bool)  # elementwise and a reshape: no gather on device
    return jnp.where(allowed, logits, -jnp.inf)
