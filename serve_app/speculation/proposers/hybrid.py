"""N-gram lookup where the context offers a match, the draft model elsewhere.

Prompt lookup is nearly free and accepts long runs when the answer repeats the input (code edits,
quoting); a trained draft is better on open text. Each round, a sequence whose last ``min_match``
tokens occur earlier in its context takes the n-gram proposal; the others ask the draft. Both
proposers see every outcome, so the draft's cache stays current (it catches up on the tokens of
n-gram rounds at its next proposal).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from serve_app.speculation.proposers.base import Drafted, Proposer
from serve_app.speculation.proposers.ngram import NgramProposer, lookup
from serve_app.speculation.types import ProposalBlock, SamplingParams, VerifyResult


def _drafts(name: str) -> property:
    """A flag of the hybrid read from its draft proposer (read-only)."""
    return property(lambda self: getattr(self.draft, name), doc=f"the draft's ``{name}``")


class HybridProposer(Proposer):
    def __init__(self, ngram: NgramProposer, draft: Proposer, min_match: int = 2):
        self.ngram, self.draft, self.min_match = ngram, draft, min_match
        self.by_draft: set[str] = set()  # sequences the draft proposed for in the last round

    def add_sequence(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                     features: torch.Tensor | None = None) -> None:
        self.ngram.add_sequence(seq_id, prompt_ids, params)
        self.draft.add_sequence(seq_id, prompt_ids, params, features)

    def remove_sequence(self, seq_id: str) -> None:
        self.ngram.remove_sequence(seq_id)
        self.draft.remove_sequence(seq_id)

    def propose(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> ProposalBlock:
        by_lookup: list[tuple[str, int]] = []
        by_draft: list[tuple[str, int]] = []
        for s, k in zip(seq_ids, num_tokens, strict=True):
            matched = k > 0 and lookup(np.asarray(self.ngram.history.tokens[s]), 1,
                                       max(self.min_match, self.ngram.min_n), self.ngram.max_n)
            (by_lookup if matched else by_draft).append((s, k))
        self.by_draft = {s for s, k in by_draft if k}
        blocks = [p.propose([s for s, _ in rows], [k for _, k in rows])
                  for p, rows in ((self.ngram, by_lookup), (self.draft, by_draft)) if rows]
        return ProposalBlock.concat(blocks)  # the engine matches rows by seq_id, not by order

    def propose_ahead(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> Callable[[], Drafted]:
        """Overlapped rounds: the draft drafts ahead for the sequences it proposed for (what it returns:
        see ``DraftModelProposer.propose_ahead``); a lookup is nearly free, so its sequences look up
        again next round."""
        return self.draft.propose_ahead(*self._draft_rows(seq_ids, num_tokens))

    # flags the engine reads: the draft's (the lookup needs nothing of the target, is never busy, drafts nothing ahead)
    can_propose_ahead = _drafts("can_propose_ahead")
    can_add_later = _drafts("can_add_later")
    reads_features = _drafts("reads_features")
    busy = _drafts("busy")
    prefills_aside = _drafts("prefills_aside")
    reads_late = _drafts("reads_late")

    def _draft_rows(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> tuple[list[str], list[int]]:
        return list(seq_ids), [k if s in self.by_draft else 0 for s, k in zip(seq_ids, num_tokens, strict=True)]

    def observe(self, result: VerifyResult) -> None:
        self.ngram.observe(result)
        self.draft.observe(result)
