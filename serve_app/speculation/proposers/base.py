"""The proposer protocol: propose a block, then learn the outcome (transformers' CandidateGenerator).

The engine treats a draft model and n-gram lookup alike. A proposer keeps its own copy of each
sequence's tokens, so the same object can live in another process (a Ray actor) and be fed only
the typed messages of ``serve_app.speculation.types``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from serve_app.speculation.types import PAD_TOKEN, ProposalBlock, SamplingParams, VerifyResult

# Drafted ahead: each row's guess of the target's next token (PAD_TOKEN: none), and the blocks.
Drafted = tuple[list[int], ProposalBlock]


def nothing_drafted(seq_ids: Sequence[str]) -> Drafted:
    return [PAD_TOKEN] * len(seq_ids), ProposalBlock.make_dummy(seq_ids, [[] for _ in seq_ids])


@runtime_checkable
class Proposer(Protocol):
    """Implementations subclass it explicitly, so the optional capability below has its default."""

    can_propose_ahead: bool = False  # drafts the next block while the target verifies (``propose_ahead``)
    # takes a sequence at any point of its life, from its whole context (a decoder draft: its prefill needs
    # nothing of the target's), so the engine may leave it out while drafting does not pay (``Engine._admit``)
    can_add_later: bool = False
    # add_sequence needs the target's features of every context token but the last (an EAGLE head): the engine
    # keeps those of a sequence it holds out of the proposer (``engine.deferral``) and hands them over with it
    reads_features: bool = False
    busy: bool = False  # work of its own in flight on shared cores (a prompt's prefill): rounds now are not typical
    # add_sequence returns at once and the prefill runs on cores the target's forwards leave free (a remote draft
    # on cores of its own), so admission may hand it a prompt before the target's prefill (``engine.deferral``)
    prefills_aside: bool = False
    # reads a sequence's new tokens only when it next drafts for it (a draft model, an EAGLE head): after a
    # stretch of plain rounds, the whole stretch at once (``engine.deferral`` keeps probes from paying it)
    reads_late: bool = False

    def add_sequence(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                     features: torch.Tensor | None = None) -> None:
        """Start tracking a sequence (a draft model prefills it here). ``features``: the target's
        hidden states over the prompt but its last token, from ``TargetVerifier.add_sequence``
        (an EAGLE head reads them; other proposers ignore them)."""

    def remove_sequence(self, seq_id: str) -> None:
        """Forget a finished or aborted sequence."""

    def propose(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> ProposalBlock:
        """Up to ``num_tokens[i]`` draft tokens for each sequence (fewer where it has none)."""

    def observe(self, result: VerifyResult) -> None:
        """Learn what the target kept; rows of sequences this proposer does not hold are ignored."""

    def propose_ahead(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> Callable[[], Drafted]:
        """Overlapped rounds (``engine.ahead``): start drafting each sequence's next block from the
        optimistic continuation of the block just sent; the returned function waits for it. A
        proposer without the capability drafts nothing ahead."""
        drafted = nothing_drafted(seq_ids)
        return lambda: drafted


class TokenHistory:
    """Each sequence's tokens as the target has decided them (shared by proposers)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}

    def add(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.tokens[seq_id] = list(prompt_ids)
        self.params[seq_id] = params

    def remove(self, seq_id: str) -> None:
        self.tokens.pop(seq_id, None)
        self.params.pop(seq_id, None)

    def extend(self, result: VerifyResult) -> list[str]:
        """Append each held row's new tokens; return the seq_ids that were held."""
        held = []
        for i, seq_id in enumerate(result.seq_ids):
            if seq_id in self.tokens:
                self.tokens[seq_id].extend(result.new_tokens(i))
                held.append(seq_id)
        return held


class NoProposer(Proposer):
    """Plain decoding: proposes nothing, so every round is one target step."""

    def add_sequence(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                     features: torch.Tensor | None = None) -> None:
        pass

    def remove_sequence(self, seq_id: str) -> None:
        pass

    def propose(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> ProposalBlock:
        return ProposalBlock.make_dummy(seq_ids, [[] for _ in seq_ids])

    def observe(self, result: VerifyResult) -> None:
        pass
