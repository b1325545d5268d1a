"""Continuous batching: which sequences run this step, and how many of their tokens.

Each step has a token budget. Running sequences that are decoding (one token each) are scheduled first,
oldest first; then running sequences still filling their prompt, then waiting ones in arrival order (while
fewer than ``max_running`` run), each taking ``min(budget left, tokens left)`` tokens: a long prompt is
prefilled in chunks over several steps, mixed with other sequences' decodes. A waiting sequence first takes
the longest cached prefix of its full blocks from the allocator (unless it scores its prompt: it then computes
every prompt position, and its blocks are cached for others as usual).

Admission is fair: while a sequence waits that could be admitted (fewer than ``max_running`` run), the running
prefills together take at most ``prefill_chunk`` tokens of the step, and an admitted sequence with others waiting
behind it at most ``prefill_chunk`` too. So the queue's head gets at least ``token_budget - prefill_chunk`` minus
the decodes' tokens every step (a short prompt behind a long one is not held until the long one is prefilled),
and a prompt alone still prefills at the whole budget.

When a sequence needs a block and none is free, the newest running sequence is preempted: its blocks are
freed (they stay in the prefix cache) and it goes back to the front of the queue, to be recomputed later.
The cache never runs out: ``add`` caps a sequence's length at what the whole cache holds (it ends there with
"length"), so a sequence running alone always fits and the queue's head is always admitted once the running
ones finish; a prompt that leaves no room to generate is refused up front. ``abort`` takes a sequence out
wherever it is and frees its blocks at once.

A multi-step decode (``reserve_ahead``) runs n tokens of every decoding sequence in one step: n stops short of
every sequence's max_len (a sequence whose max_tokens comes first stops within them, its later tokens dropped as
after a stop token), and its blocks come from free ones only (fewer steps when they are short; never a
preemption). So do those of a step scheduled while the one before it is on the device, before its
tokens are known: a decode step or multi-step decode of the sequences that step samples (``reserve_next``), or
a step that also continues prompts and admits waiting sequences by the rules above (``schedule_after``); ``update``
keeps the blocks of such a step in flight (``ahead``).
"""

from collections.abc import Mapping
from typing import NamedTuple

from serving.engine.blocks import BlockAllocator, hash_block, hash_blocks
from serving.engine.request import SequenceState


class ScheduledChunk(NamedTuple):
    """``count`` tokens of ``seq`` starting at ``start`` (= its ``num_computed``) run this step; ``samples``: the
    chunk reaches the sequence's last token, whose logits give its next token. A decoding chunk may carry the
    sequence's speculative ``draft_ids`` after its last token (``count = 1 + drafts``), or in a multi-step decode
    the n - 1 tokens it samples on the device (``count = n``)."""

    seq: SequenceState
    start: int
    count: int
    samples: bool


def _chunk(seq: SequenceState, count: int) -> ScheduledChunk:
    return ScheduledChunk(seq, seq.num_computed, count, seq.num_computed + count >= seq.num_tokens)


class Scheduler:
    """Args: the block ``allocator``; ``max_running`` sequences and ``token_budget`` new tokens per step;
    ``prefill_chunk``: the prefill tokens running sequences take per step while others wait (module docstring;
    default ``token_budget // 2``, at least 1), in [1, token_budget]."""

    def __init__(self, allocator: BlockAllocator, max_running: int, token_budget: int,
                 prefill_chunk: int | None = None):
        if max_running < 1 or token_budget < 1:
            raise ValueError(f"Scheduler: max_running={max_running}, token_budget={token_budget}: expected >= 1")
        prefill_chunk = max(1, token_budget // 2) if prefill_chunk is None else prefill_chunk
        if not 1 <= prefill_chunk <= token_budget:
            raise ValueError(f"Scheduler: prefill_chunk={prefill_chunk}: expected 1 <= prefill_chunk <= "
                             f"token_budget={token_budget}")
        self.allocator, self.max_running, self.token_budget = allocator, max_running, token_budget
        self.prefill_chunk = prefill_chunk
        self.block_size = allocator.block_size
        self.waiting: list[SequenceState] = []
        self.running: list[SequenceState] = []  # in admission order: the last is the newest
        self.num_preemptions = 0

    @property
    def capacity(self) -> int:
        """Tokens the whole cache holds."""
        return self.allocator.num_blocks * self.block_size

    def add(self, seq: SequenceState) -> None:
        """Queue ``seq`` with its ``max_len`` capped at ``capacity``; ValueError if its prompt reaches that length."""
        max_len = min(self.capacity, seq.max_len)
        if seq.num_tokens >= max_len:
            raise ValueError(f"request {seq.request_id!r}: its {seq.num_tokens}-token prompt does not fit: the cache "
                             f"holds {self.capacity} tokens ({self.allocator.num_blocks} blocks of {self.block_size})"
                             f" and the context is {seq.max_len} tokens (at most {max_len - 1} for the prompt)")
        seq.max_len = max_len
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: SequenceState) -> None:
        """Take ``seq`` out of the waiting or running set and free its blocks (a no-op once it has left both)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return
        self._release(seq)

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks (allocating their blocks); see the module docstring for the order."""
        chunks: list[ScheduledChunk] = []
        budget = self.token_budget
        step_preemptions = self.num_preemptions
        # while a sequence could be admitted, the running prefills leave it all but prefill_chunk of the budget
        prefill_left = self.prefill_chunk if self._admissible(0) else self.token_budget
        for decoding in (True, False):
            for seq in list(self.running):
                left = seq.num_tokens - seq.num_computed
                if budget == 0 or (left == 1) != decoding or (self.num_preemptions > step_preemptions
                                                                 and seq not in self.running):
                    continue
                if not decoding and prefill_left == 0:
                    continue
                count = min(budget, left + len(seq.draft_ids)) if decoding else min(budget, left, prefill_left)
                del seq.draft_ids[max(count - left, 0):]  # drafts past the budget (or stale ones) are dropped
                preemptions = self.num_preemptions
                if self._reserve(seq, count, chunks):
                    chunks.append(_chunk(seq, count))
                if self.num_preemptions > preemptions:  # preempted chunks (this one's too) give theirs back
                    budget = self.token_budget - sum(c.count for c in chunks)
                else:
                    budget -= count
                    prefill_left -= 0 if decoding else count
        self._admit(chunks, budget)
        return chunks

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> None:
        """Admit waiting sequences in order while ``budget`` tokens are left and their blocks are free (never a
        preemption for a newcomer), each a chunk of its prompt appended to ``chunks``."""
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            self._take_cached_prefix(seq)
            count = min(budget, seq.num_tokens - seq.num_computed)
            if self._admissible(1):  # others wait behind it: leave them room
                count = min(count, self.prefill_chunk)
            if self._blocks_needed(seq, count) > self.allocator.num_free:
                self._release(seq)  # wait for running sequences to finish
                break
            self.waiting.pop(0)
            self.running.append(seq)
            self._grow(seq, count)
            chunks.append(_chunk(seq, count))
            budget -= count

    def schedule_after(self, decoding: list[tuple[SequenceState, int]],
                       prefilling: list[tuple[SequenceState, int]]) -> list[ScheduledChunk] | None:
        """The chunks of a step scheduled while the one before it is on the device, whose tokens are not known yet:
        one token of each of ``decoding`` (sequence, position: the one past those the step in flight computes),
        then the rest of each of ``prefilling``'s prompts (sequence, position) and waiting sequences admitted, by
        ``schedule``'s rules for the budget and ``prefill_chunk``. Their blocks come from free ones only: None,
        allocating nothing, when those of ``decoding`` and ``prefilling`` are not (or the budget does not hold the
        decodes); an admission stops where they are not."""
        budget = self.token_budget - len(decoding)
        prefill_left = self.prefill_chunk if self._admissible(0) else self.token_budget
        counts = []
        for seq, position in prefilling:
            counts.append(max(0, min(budget, seq.num_tokens - position, prefill_left)))
            budget, prefill_left = budget - counts[-1], prefill_left - counts[-1]
        reserved = [(seq, position, 1) for seq, position in decoding] + [
            (seq, position, count) for (seq, position), count in zip(prefilling, counts, strict=True) if count]
        if budget < 0 or sum(max(0, self._blocks_needed(s, p + c - s.num_computed)) for s, p, c in reserved) > \
                self.allocator.num_free:
            return None
        chunks = []
        for seq, position, count in reserved:
            self._grow(seq, position + count - seq.num_computed)
            chunks.append(ScheduledChunk(seq, position, count, position + count >= seq.num_tokens))
        self._admit(chunks, budget)
        return chunks

    def _admissible(self, ahead: int) -> bool:
        """A sequence waits behind the first ``ahead`` waiting ones that could be admitted with them (room for
        ``ahead + 1`` more running sequences)."""
        return len(self.waiting) > ahead and len(self.running) + ahead < self.max_running

    def reserve_ahead(self, chunks: list[ScheduledChunk], steps: int, exact: bool = False) -> list[ScheduledChunk]:
        """``chunks``, each one decoding token, as the n-token chunks of a multi-step decode with the blocks of
        their n tokens allocated: n <= ``steps`` is the most that passes no sequence's max_len and whose blocks are
        free now (nothing is preempted); with ``exact``, n is ``steps`` or 1 (each n is a compile
        of its own: one multi-step shape per step shape); n = 1 (the chunks as they were) when none more fits."""
        if any(c.count != 1 or not c.samples for c in chunks):
            raise ValueError(f"reserve_ahead: chunk counts {[c.count for c in chunks]}: expected decoding chunks "
                             "(one token each, sampling)")
        seqs = [c.seq for c in chunks]
        n = min([steps] + [s.max_len - s.num_tokens for s in seqs])
        while n > 1 and sum(self._blocks_needed(s, n) for s in seqs) > self.allocator.num_free:
            n -= 1
        if exact and n < steps:
            return chunks
        if n <= 1:
            return chunks
        for seq in seqs:
            self._grow(seq, n)
        return [c._replace(count=n) for c in chunks]

    def reserve_next(self, seqs: list[SequenceState], running: list[int], steps: int) -> bool:
        """Allocate the blocks each of ``seqs`` needs for a decode of ``steps`` tokens after the ``running[i]`` tokens
        from its ``num_computed`` on that the step in flight computes; False, allocating nothing, when they are not
        all free (nothing is preempted)."""
        pairs = list(zip(seqs, running, strict=True))
        if sum(max(0, self._blocks_needed(s, r + steps)) for s, r in pairs) > self.allocator.num_free:
            return False
        for seq, r in pairs:
            self._grow(seq, r + steps)
        return True

    def update(self, chunks: list[ScheduledChunk], tokens: list[int | list[int]],
               ahead: Mapping[int, int] | None = None) -> list[tuple[SequenceState, list[str]]]:
        """Record a step: ``tokens[i]`` is chunk i's sampled token, or its accepted tokens in order (speculative
        decoding) or its n tokens (a multi-step decode), ignored unless the chunk samples. Tokens after a stop
        condition are dropped; the cache keeps only the positions of accepted tokens (rejected drafts' and a
        finished sequence's later slots are overwritten later) and the blocks that no longer hold any token are
        freed, but those of a step in flight after this one: ``ahead[seq_id]`` is how many tokens it computes for
        that sequence (from its new last token on; ``reserve_next``).

        Returns (sequence, the new text of each token it appended, in order) for every chunk that sampled, in
        ``chunks``' order; finished sequences leave the running set.
        """
        updated, ahead, size = [], ahead or {}, self.block_size
        for chunk, new in zip(chunks, tokens, strict=True):
            seq = chunk.seq
            seq.num_computed += chunk.count
            if chunk.samples:
                texts = []
                for token in (new,) if isinstance(new, int) else new:
                    texts.append(seq.append(int(token)))
                    if seq.finish_reason is not None:
                        break
                updated.append((seq, texts))
                num_tokens = len(seq.prompt_ids) + len(seq.output_ids)
                seq.num_computed = min(seq.num_computed, num_tokens - 1)
                # every token's block (the last is computed next) and those of a step in flight after it
                keep = -(-(num_tokens + ahead.get(seq.seq_id, 1) - 1) // size)
                if len(seq.block_table) > keep:
                    for block in reversed(seq.block_table[keep:]):
                        self.allocator.free(block)
                    del seq.block_table[keep:]
            if seq.num_computed // size > len(seq.block_hashes):
                self._register_full_blocks(seq)
            if seq.finish_reason is not None:
                self.running.remove(seq)
                self._release(seq)
        return updated

    def _blocks_needed(self, seq: SequenceState, count: int) -> int:
        return -(-(seq.num_computed + count) // self.block_size) - len(seq.block_table)

    def _reserve(self, seq: SequenceState, count: int, chunks: list[ScheduledChunk]) -> bool:
        """Allocate the blocks ``count`` more tokens of ``seq`` need, preempting the newest running sequences
        while none is free; False if ``seq`` itself had to be preempted."""
        needed = self._blocks_needed(seq, count)
        while self.allocator.num_free < needed:
            victim = self.running[-1]
            self._preempt(victim, chunks)
            if victim is seq:
                return False
        self._grow(seq, count)
        return True

    def _grow(self, seq: SequenceState, count: int) -> None:
        """Append to ``seq``'s block table the blocks ``count`` more tokens need (the caller made sure they are
        free)."""
        seq.block_table += [self.allocator.allocate() for _ in range(self._blocks_needed(seq, count))]

    def _preempt(self, seq: SequenceState, chunks: list[ScheduledChunk]) -> None:
        self.running.remove(seq)
        chunks[:] = [c for c in chunks if c.seq is not seq]
        self._release(seq)
        self.waiting.insert(0, seq)
        self.num_preemptions += 1

    def _release(self, seq: SequenceState) -> None:
        """Free the blocks of ``seq``, last first (so the LRU cache evicts tails before shared prefixes)."""
        for block in reversed(seq.block_table):
            self.allocator.free(block)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def _take_cached_prefix(self, seq: SequenceState) -> None:
        """Start a waiting ``seq`` from its longest cached prefix, keeping at least its last token to compute; from
        its first token when it scores its prompt (every position's logits are needed)."""
        if seq.scores_prompt:
            seq.num_cached_tokens = 0
            return
        hashes = hash_blocks(seq.tokens, self.block_size, lambda i: seq.block_salt(i, self.block_size),
                             (seq.num_tokens - 1) // self.block_size)
        seq.block_table = self.allocator.cached_prefix(hashes)
        seq.block_hashes = hashes[:len(seq.block_table)]
        seq.num_computed = seq.num_cached_tokens = len(seq.block_table) * self.block_size

    def _register_full_blocks(self, seq: SequenceState) -> None:
        """Register every block of ``seq`` that is now full and computed under its chained hash."""
        tokens = None
        for i in range(len(seq.block_hashes), seq.num_computed // self.block_size):
            tokens = seq.tokens if tokens is None else tokens
            previous = seq.block_hashes[-1] if seq.block_hashes else b""
            seq.block_hashes.append(hash_block(previous, tokens[i * self.block_size:(i + 1) * self.block_size],
                                               seq.block_salt(i, self.block_size)))
            self.allocator.register(seq.block_table[i], seq.block_hashes[-1])
