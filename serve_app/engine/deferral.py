"""Sequences left out of their proposer while drafting does not pay.

A decoder draft's prefill of a prompt costs as much compute as many target rounds, and on a host whose
draft and target share cores it slows the target while it runs. A sequence admitted at a batch size
where the k policy would not draft (a large batch on a CPU) is kept out of its proposer (it decodes
plainly) when that proposer can take it later (``Proposer.can_add_later``); once the policy would
draft for the running batch again (``KPolicy.would_draft``: its own choice, not one of its
once-in-a-while probes), every such sequence is handed over with its whole context so far, and drafts
from the rounds after its prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from serve_app.config import SpeculationMethod
from serve_app.engine.request import Request
from serve_app.speculation.proposers.base import Proposer
from serve_app.speculation.types import ProposalBlock


class Deferral:
    def __init__(self, proposers: Mapping[SpeculationMethod, Proposer],
                 would_draft: Callable[[Sequence[Request]], bool]):
        """``would_draft(requests)``: whether the k policy's own choice drafts for that batch."""
        self.proposers, self.would_draft = proposers, would_draft
        self.held: set[str] = set()  # running requests their proposer does not hold yet
        self.early: set[str] = set()  # handed over before the target's prefill (``start``), not running yet

    def start(self, req: Request, batch: Sequence[Request]) -> Callable[[], None]:
        """Admission is about to cache ``req``'s prompt on the target. A proposer that needs nothing of the
        target's and prefills aside (``Proposer.prefills_aside``: on cores of its own) takes it now, if the
        policy would draft for ``batch`` (what it joins: the running requests and those admitted with it):
        its prefill then runs beside the target's instead of beside the first rounds after it. One whose
        prefill would share the target's cores takes it after (``admit``): side by side, both would stall.
        Returns what undoes an early start if the target's call fails."""
        proposer = self.proposers[req.method]
        if not (proposer.can_add_later and proposer.prefills_aside) or not self.would_draft(batch):
            return lambda: None
        proposer.add_sequence(req.request_id, req.context_ids, req.params.sampling)
        self.early.add(req.request_id)

        def undo() -> None:
            proposer.remove_sequence(req.request_id)
            self.early.discard(req.request_id)

        return undo

    def admit(self, ready: Iterable[tuple[Request, torch.Tensor | None]], running: Mapping[str, Request]) -> None:
        """Requests whose prompt the target now holds (and now in ``running``): to their proposer, unless
        it took them at ``start`` or can take them later and the policy would not draft for ``running``."""
        drafting: bool | None = None
        for req, features in ready:
            if req.request_id in self.early:
                self.early.discard(req.request_id)
                continue
            proposer = self.proposers[req.method]
            if proposer.can_add_later:
                drafting = self.would_draft(list(running.values())) if drafting is None else drafting
                if not drafting:
                    self.held.add(req.request_id)
                    continue
            proposer.add_sequence(req.request_id, req.context_ids, req.params.sampling, features)

    def split(self, requests: Sequence[Request], running: Mapping[str, Request]
              ) -> tuple[list[ProposalBlock], list[Request]]:
        """Before a round's proposals: every held sequence goes to its proposer if the policy would draft
        for the running batch again. Returns the held ones' empty block (they decode plainly) and the
        requests that propose as usual."""
        if self.releasing(running):
            for seq_id in self.held:
                req = running[seq_id]
                self.proposers[req.method].add_sequence(seq_id, req.context_ids, req.params.sampling)
            self.held.clear()
        if not self.held:
            return [], list(requests)
        plain = [r.request_id for r in requests if r.request_id in self.held]
        rest = [r for r in requests if r.request_id not in self.held]
        return [ProposalBlock.make_dummy(plain, [[] for _ in plain])], rest

    def releasing(self, running: Mapping[str, Request]) -> bool:
        """Whether the next round's ``split`` hands the held sequences over (so that round may draft)."""
        return bool(self.held) and self.would_draft(list(running.values()))

    def discard(self, seq_id: str) -> None:
        self.held.discard(seq_id)
        self.early.discard(seq_id)

    def clear(self) -> None:
        self.held.clear()
        self.early.clear()
