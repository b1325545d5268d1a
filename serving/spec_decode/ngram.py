"""N-gram prompt lookup: drafts copied from the sequence's own history, no model."""

from collections.abc import Sequence

import numpy as np

from serving.spec_decode.protocol import DraftRequest, Proposal

DEFAULT_NGRAM = 3  # longest n-gram prompt lookup tries to match (then shorter, down to min_n)


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens in its own
    history and propose the tokens that followed it; tries n, n - 1, ..., min_n. Deterministic (q one-hot).

    Strong on repetitive output (code edits, quoting the prompt, lists); proposes nothing when no n-gram recurs.
    """

    def __init__(self, n: int = DEFAULT_NGRAM, min_n: int = 1):
        if not 1 <= min_n <= n:
            raise ValueError(f"NgramDrafter: n={n}, min_n={min_n}: expected 1 <= min_n <= n")
        self.n, self.min_n = n, min_n

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier match of the longest recurring tail n-gram."""
        ids = np.asarray(token_ids, np.int64)
        for n in range(min(self.n, len(ids) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [L - n, n], ending before the tail
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = hits[-1] + n
                return ids[start:start + k].tolist()
        return []

    def propose(self, requests: Sequence[DraftRequest], k: int) -> Proposal:
        return Proposal([self.lookup(r.token_ids, min(k, r.max_draft)) if r.max_draft > 0 else [] for r in requests])

    def release(self, seq_id: int) -> None:
        """Stateless: nothing to forget."""
