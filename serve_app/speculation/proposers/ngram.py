"""N-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method).

Find the most recent earlier occurrence of the sequence's last n tokens (n from ``max_n`` down to
``min_n``) and propose the tokens that followed it. Proposals are deterministic, so q is one-hot
on the proposed token; speculative sampling stays exact with that q.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from serve_app.speculation.proposers.base import Proposer, TokenHistory
from serve_app.speculation.types import ProposalBlock, SamplingParams, VerifyResult


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Continuation of the latest earlier match of the longest suffix n-gram, at most k tokens."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows start at 0..length-n-1, so the suffix itself is never its own match
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start: start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.history = TokenHistory()

    def add_sequence(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                     features: torch.Tensor | None = None) -> None:
        self.history.add(seq_id, prompt_ids, params)

    def remove_sequence(self, seq_id: str) -> None:
        self.history.remove(seq_id)

    def propose(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> ProposalBlock:
        drafts = [
            lookup(np.asarray(self.history.tokens[s]), k, self.min_n, self.max_n) if k > 0 else []
            for s, k in zip(seq_ids, num_tokens, strict=True)
        ]
        if all(self.history.params[s].greedy for s in seq_ids):
            return ProposalBlock.make_dummy(seq_ids, drafts)
        return ProposalBlock.make_dummy(seq_ids, drafts, q=[[{t: 1.0} for t in d] for d in drafts])

    def observe(self, result: VerifyResult) -> None:
        self.history.extend(result)
