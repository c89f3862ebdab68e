"""Overlapped rounds: the draft drafts block n + 1 while the target verifies block n.

PEARL's post-verify (Liu et al. 2024, arXiv 2408.11850), across the actor boundary: once block n is
sent to the target, each drafting sequence's proposer continues from the optimistic continuation (all
of block n accepted, then its own guess of the target's next token) and drafts the next block. When
the verdict comes back, a sequence whose whole block was kept and whose target token was the guess (a
hit) has its next block ready: the next round sends it without a draft call, so the draft's time was
hidden behind the verify. Otherwise (a miss) the block is dropped and the proposer rolls its cache back
like any rejected draft (``DraftModelProposer.observe``). The target never sees a dropped block, and a
kept block is verified like any other, so the output stays the target's exactly.

A hit needs the whole block accepted and the guess right: with per-token acceptance a about a^(k+1) of
rounds. The draft's work on misses is wasted, but it runs on the draft's own cores while they would
otherwise idle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from serve_app.config import SpeculationMethod
from serve_app.engine.request import Request
from serve_app.speculation.proposers.base import Drafted, Proposer
from serve_app.speculation.types import PAD_TOKEN, ProposalBlock, VerifyResult
from serve_app.speculation.verifier import Verifier

AheadRow = tuple[str, SpeculationMethod, int]  # (seq_id, its method, k of its next block)


class DraftAhead:
    """``DraftAhead({})`` (no proposer that can draft ahead) is the engine's look-ahead without
    ``overlap``: it drafts nothing and holds nothing."""

    def __init__(self, proposers: Mapping[SpeculationMethod, Proposer]):
        self.proposers = {m: p for m, p in proposers.items() if p.can_propose_ahead}
        self.ready: dict[str, ProposalBlock] = {}  # one-row blocks drafted ahead that held
        self.tries = self.hits = 0

    @property
    def enabled(self) -> bool:
        return bool(self.proposers)

    def rows(self, block: ProposalBlock, running: Mapping[str, Request], bound: Callable[[Request, int], int]
             ) -> list[AheadRow]:
        """(seq_id, method, k of its next block) of each drafting row of ``block``, to draft ahead: within
        the request's cap and ``bound(request, tokens it gains first)``, the engine's hard bounds."""
        if not self.enabled:
            return []
        rows = []
        for seq_id, k in zip(block.seq_ids, block.num_draft_tokens.tolist(), strict=True):
            if k:
                req = running[seq_id]
                rows.append((seq_id, req.method, min(k, req.num_speculative_tokens, bound(req, k + 1))))
        return rows

    def verify(self, verifier: Verifier, block: ProposalBlock, rows: Iterable[AheadRow]
               ) -> tuple[VerifyResult, list[Drafted]]:
        """Send the block to the target, then have the proposers of ``rows`` = (seq_id, method, k of
        its next block) draft their next blocks meanwhile (an in-process target verifies first: the
        same outcome, one after the other)."""
        wait = verifier.verify_async(block)
        drafting = self.start(rows)
        return wait(), drafting()

    def start(self, rows: Iterable[AheadRow]) -> Callable[[], list[Drafted]]:
        """Draft ahead for ``rows`` whose block was just sent. A proposer in this process drafts now;
        one on an actor drafts there while the returned function waits."""
        rows = list(rows)
        waits = []
        for method, proposer in self.proposers.items():
            group = [(s, k) for s, m, k in rows if m == method]
            if any(k for _, k in group):
                waits.append(proposer.propose_ahead([s for s, _ in group], [k for _, k in group]))
        return lambda: [wait() for wait in waits]

    def finish(self, drafted: Sequence[Drafted], result: VerifyResult, going_on: Iterable[str]) -> None:
        """Keep the blocks of the sequences that hit and go on."""
        rows = {s: i for i, s in enumerate(result.seq_ids)}
        going_on = set(going_on)
        for guesses, block in drafted:
            for j, seq_id in enumerate(block.seq_ids):
                if guesses[j] == PAD_TOKEN or seq_id not in rows:
                    continue
                self.tries += 1
                i = rows[seq_id]
                if result.kept_block_then(i, int(result.num_draft_tokens[i]), guesses[j]):
                    self.hits += 1
                    if seq_id in going_on and int(block.num_draft_tokens[j]) > 0:
                        self.ready[seq_id] = block.select([j])

    def take(self, seq_ids: Iterable[str]) -> list[ProposalBlock]:
        """The ready blocks of these sequences (each used once)."""
        return [self.ready.pop(s) for s in seq_ids if s in self.ready]

    def drop(self, seq_id: str) -> None:
        self.ready.pop(seq_id, None)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.tries if self.tries else 0.0
