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
    def __init__(self, proposers: Mapping[SpeculationMethod, Proposer]):
        self.proposers = proposers
        self.held: set[str] = set()  # running requests their proposer does not hold yet

    def admit(self, ready: Iterable[tuple[Request, torch.Tensor | None]], drafting: bool) -> None:
        """Requests whose prompt the target now holds: to their proposer, or held unless ``drafting``
        (whether the policy would draft at the batch they join)."""
        for req, features in ready:
            proposer = self.proposers[req.method]
            if proposer.can_add_later and not drafting:
                self.held.add(req.request_id)
            else:
                proposer.add_sequence(req.request_id, req.context_ids, req.params.sampling, features)

    def split(self, requests: Sequence[Request], running: Mapping[str, Request],
              would_draft: Callable[[Sequence[Request]], bool]) -> tuple[list[ProposalBlock], list[Request]]:
        """Before a round's proposals: every held sequence goes to its proposer if the policy would draft
        for the running batch again. Returns the held ones' empty block (they decode plainly) and the
        requests that propose as usual."""
        if self.held and would_draft(list(running.values())):
            for seq_id in self.held:
                req = running[seq_id]
                self.proposers[req.method].add_sequence(seq_id, req.context_ids, req.params.sampling)
            self.held.clear()
        if not self.held:
            return [], list(requests)
        plain = [r.request_id for r in requests if r.request_id in self.held]
        rest = [r for r in requests if r.request_id not in self.held]
        return [ProposalBlock.make_dummy(plain, [[] for _ in plain])], rest

    def discard(self, seq_id: str) -> None:
        self.held.discard(seq_id)

    def clear(self) -> None:
        self.held.clear()
