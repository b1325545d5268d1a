"""Suffix drafting: drafts copied from what followed the longest matching suffix, in the sequence's own context and
in the server's recent outputs, scored by how often each continuation occurred.

A ``SuffixIndex`` holds a token buffer and, for every ``key_len``-gram in it, the positions right after its
occurrences. For a query context ``x_1 .. x_n`` the candidates are the occurrences of its last ``key_len`` tokens;
each is extended backwards to its match length ``l`` (the longest ``l <= max_depth`` with ``buffer[p - l:p] ==
x[n - l + 1:]``). The occurrences of the suffix of length L are the candidates with ``l >= L``: the occurrence set
of a suffix-tree node. From each such set the draft is a greedy walk of the continuation tree: at depth d the
most frequent next token among the occurrences still on the path, with

    P(draft_1..d) = prod_{i <= d} count(draft_1..i) / count(draft_1..i-1)        (frequency estimate)

extended while ``P >= min_token_prob`` and for at most ``floor(factor * L) + offset`` tokens (a longer match earns a
longer draft: ArcticInference's adaptive draft length). Its score ``sum_d P(draft_1..d)`` is the expected number
of accepted tokens under those frequencies; the draft of the best-scoring suffix length wins (lengths walked
longest first, skipping those whose set is less than twice the last one walked), over the sequence's
own context (prompt + output, indexed incrementally) and the global store of finished outputs (a bounded buffer:
the oldest half is dropped when full). Drafts are deterministic (q one-hot), so verification is lossless as for
n-gram lookup. Costs are numpy gathers over at most ``max_candidates`` occurrences per source and step.
"""

import collections
from collections.abc import Sequence

import numpy as np

from serving.spec_decode.protocol import DraftRequest, Proposal

KEY_LEN = 2  # shortest suffix matched: the key of the occurrence index (1-token matches draft noise)
MAX_DEPTH = 32  # longest suffix matched (longer matches predict no better and cost more comparisons)
MAX_CANDIDATES = 256  # most recent occurrences of a key examined per source and step
MIN_TOKEN_PROB = 0.1  # a draft stops where its frequency estimate falls below this (ArcticInference's default)
GLOBAL_TOKENS = 1 << 18  # finished outputs kept in the global store (about 40 MB of index in CPython)
MAX_SEQUENCES = 4096  # per-sequence indexes kept (the least recently used dropped: aborted ones are never released)
SEPARATOR = -1  # ends each document in a buffer: no match or continuation crosses it


class SuffixIndex:
    """A token buffer with the positions after every ``key_len``-gram (SEPARATOR-free) in it."""

    def __init__(self, key_len: int = KEY_LEN):
        self.key_len = key_len
        self.tokens = np.full(64, SEPARATOR, np.int64)
        self.size = 0
        self.after: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (SEPARATOR ends a document) and index the keys that end in them."""
        new = len(tokens)
        if self.size + new > len(self.tokens):
            grown = np.full(max(2 * len(self.tokens), self.size + new), SEPARATOR, np.int64)
            grown[:self.size] = self.tokens[:self.size]
            self.tokens = grown
        self.tokens[self.size:self.size + new] = tokens
        start, self.size = self.size, self.size + new
        window = self.tokens[max(0, start - self.key_len + 1):self.size].tolist()
        first = max(0, start - self.key_len + 1)
        for i in range(len(window) - self.key_len + 1):
            key = tuple(window[i:i + self.key_len])
            if SEPARATOR not in key:
                self.after[key].append(first + i + self.key_len)

    def candidates(self, context: np.ndarray, max_candidates: int, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions ``[C]`` right after the latest occurrences of ``context``'s last ``key_len`` tokens, each
        with a continuation in the buffer; their match lengths ``[C]`` with ``context``, at most ``max_depth``)."""
        if len(context) < self.key_len:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        found = self.after.get(tuple(context[-self.key_len:].tolist()), [])
        positions = np.asarray(found[-max_candidates - 1:], np.int64)
        positions = positions[positions < self.size][-max_candidates:]  # an occurrence at the end has no future
        depth = min(max_depth, len(context))
        back = positions[:, None] - 1 - np.arange(depth)[None]  # [C, depth], newest token first
        seen = np.where(back >= 0, self.tokens[np.maximum(back, 0)], SEPARATOR - 1)
        same = seen == context[::-1][None, :depth]
        return positions, np.cumprod(same, axis=1).sum(axis=1)

    def continuations(self, positions: np.ndarray, length: int) -> np.ndarray:
        """``[C, length]`` the tokens from each position on, SEPARATOR from a document's end on."""
        at = positions[:, None] + np.arange(length)[None]
        tokens = np.where(at < self.size, self.tokens[np.minimum(at, len(self.tokens) - 1)], SEPARATOR)
        ended = np.maximum.accumulate(tokens == SEPARATOR, axis=1)
        return np.where(ended, SEPARATOR, tokens)


def greedy_walk(continuations: np.ndarray, max_len: int, min_token_prob: float) -> tuple[list[int], float]:
    """(the draft, its score ``sum_d P(draft_1..d)``) of the continuation tree of ``continuations [C, >= max_len]``
    (module docstring; ties go to the smaller token id)."""
    head = continuations[0, :max_len]
    if (continuations[:, :max_len] == head).all():  # one continuation (a verbatim copy): every token certain
        draft = head[:np.argmax(head == SEPARATOR) if (head == SEPARATOR).any() else max_len].tolist()
        return draft, float(len(draft))
    alive = np.ones(len(continuations), bool)
    draft, prob, score = [], 1.0, 0.0
    for d in range(max_len):
        column = continuations[alive, d]
        values, counts = np.unique(column[column != SEPARATOR], return_counts=True)
        if not len(values):
            break
        best = int(np.argmax(counts))
        prob *= counts[best] / len(column)
        if prob < min_token_prob:
            break
        draft.append(int(values[best]))
        score += prob
        alive &= continuations[:, d] == values[best]
    return draft, score


class SuffixDrafter:
    """Suffix drafting (module docstring) over each sequence's context and a global store of finished outputs.

    factor, offset: a match of L tokens drafts at most ``floor(factor * L) + offset`` tokens. min_token_prob: the
    frequency estimate a draft must keep. global_tokens: the global store's size (0: the sequence's own context
    only). Stateful per sequence (its index grows with its tokens) until ``release``.
    """

    def __init__(self, factor: float = 1.0, offset: int = 0, min_token_prob: float = MIN_TOKEN_PROB,
                 global_tokens: int = GLOBAL_TOKENS, key_len: int = KEY_LEN, max_depth: int = MAX_DEPTH,
                 max_candidates: int = MAX_CANDIDATES):
        checks = (("factor", factor > 0, "> 0"), ("offset", offset >= 0, ">= 0"),
                  ("min_token_prob", 0 < min_token_prob <= 1, "in (0, 1]"),
                  ("global_tokens", global_tokens >= 0, ">= 0 (0: no global store)"),
                  ("key_len", key_len >= 1, ">= 1"), ("max_depth", max_depth >= key_len, f">= key_len={key_len}"),
                  ("max_candidates", max_candidates >= 1, ">= 1"))
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"SuffixDrafter: {name}={locals()[name]!r}: expected {expected}")
        self.factor, self.offset, self.min_token_prob = factor, offset, min_token_prob
        self.key_len, self.max_depth, self.max_candidates = key_len, max_depth, max_candidates
        self.global_tokens = global_tokens
        self.local: collections.OrderedDict[int, SuffixIndex] = collections.OrderedDict()
        self.documents: collections.deque[list[int]] = collections.deque()  # the global store's, oldest first
        self.store = SuffixIndex(key_len)

    def draft(self, index: SuffixIndex, context: np.ndarray, k: int) -> tuple[list[int], float]:
        """(draft, score) of the best suffix length of ``context`` in ``index``, at most k tokens."""
        positions, lengths = index.candidates(context, self.max_candidates, self.max_depth)
        best: tuple[list[int], float] = ([], 0.0)
        if not len(positions):
            return best
        follow, walked = index.continuations(positions, k), 0
        for length in sorted(set(lengths.tolist()), reverse=True):  # each suffix length's occurrence set
            rows = follow[lengths >= length]
            if length < self.key_len or len(rows) < 2 * walked:  # a set less than twice the last one walked:
                continue  # its walk differs little (bounds the walks per step by log2(max_candidates) + 1)
            max_len, walked = min(k, int(self.factor * length) + self.offset), len(rows)
            draft, score = greedy_walk(rows, max_len, self.min_token_prob)
            if score > best[1]:
                best = draft, score
            if score == k:  # k certain tokens: no set scores more
                break
        return best

    def lookup(self, seq_id: int, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens continuing ``token_ids`` (sequence ``seq_id``'s, indexed incrementally)."""
        index = self.local.pop(seq_id, None) or SuffixIndex(self.key_len)
        self.local[seq_id] = index
        if len(self.local) > MAX_SEQUENCES:
            self.local.popitem(last=False)
        if index.size > len(token_ids):  # not this sequence's history: start over
            index = self.local[seq_id] = SuffixIndex(self.key_len)
        index.extend(token_ids[index.size:])
        context = index.tokens[max(0, index.size - self.max_depth):index.size]
        own = self.draft(index, context, k)
        shared = self.draft(self.store, context, k) if self.store.size else ([], 0.0)
        return (shared if shared[1] > own[1] else own)[0]

    def propose(self, requests: Sequence[DraftRequest], k: int) -> Proposal:
        return Proposal([self.lookup(r.seq_id, r.token_ids, min(k, r.max_draft)) if r.max_draft > 0 else []
                         for r in requests])

    def learn(self, output_ids: Sequence[int]) -> None:
        """Add a finished sequence's output to the global store (dropping the oldest half when it is full)."""
        if not self.global_tokens or len(output_ids) <= self.key_len:
            return
        output = list(output_ids[-self.global_tokens + 1:])
        if self.store.size + len(output) + 1 > self.global_tokens:
            kept, total = collections.deque(), 0
            while self.documents and total + len(self.documents[-1]) + 1 <= self.global_tokens // 2:
                total += len(self.documents[-1]) + 1
                kept.appendleft(self.documents.pop())
            self.documents, self.store = kept, SuffixIndex(self.key_len)
            for document in kept:
                self.store.extend([*document, SEPARATOR])
        self.documents.append(output)
        self.store.extend([*output, SEPARATOR])

    def release(self, seq_id: int) -> None:
        self.local.pop(seq_id, None)

    def clear(self) -> None:
        """Forget every finished output (the global store) and every sequence's index."""
        self.local.clear()
        self.documents.clear()
        self.store = SuffixIndex(self.key_len)
