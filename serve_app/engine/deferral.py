"""Sequences left out of their proposer while drafting does not pay.

A decoder draft's prefill of a prompt costs as much compute as many target rounds, and on a host whose
draft and target share cores it slows the target while it runs. A sequence admitted at a batch size
where the k policy would not draft (a large batch on a CPU; the batch counts the waiting requests the
next step admits, as requests sent together reach a served engine one by one) is kept out of its proposer (it decodes
plainly) when that proposer can take it later (``Proposer.can_add_later``); once the policy would
draft for the running batch again (``KPolicy.would_draft``: its own choice, not one of its
once-in-a-while probes) and drafting is predicted to gain more over the tokens the batch may still
generate than the draft's reading of the held sequences' contexts costs (``KPolicy.hand_over_pays``: on
the real pair at 4 streams a hand-over took 1.9 s where a round drafting takes 0.8, for one such round),
every such sequence is handed over with its whole context so far, and drafts from the rounds after its
prefill. Requests sent together are held together, though, and a held row never drafts, not even in a
probe: at a batch size where the policy has never measured a drafting round and no sequence is with the
draft, the draft takes the one with the shortest context once that prefill's cost is within the policy's
exploration share of the time served there (``KPolicy.explore_pays``), so its probes measure drafting
there instead of its model's guess standing for ever (one prefill of one sequence per batch size, once).
An EAGLE head (``Proposer.reads_features``) takes a sequence at admission or later the same way, with
the target's features of the context, which the target keeps until then (``Verifier.take_features``):
served on the embedded model at 16 streams, where the policy plays plain, the head had taken every
sequence at admission, so every prompt's and every plain round's features went to the replica and on to
the head, and the head prefilled every prompt, for rounds that never drafted.

A decoder draft, and an EAGLE head (``Proposer.reads_late``), reads the tokens of a sequence it holds
only when it next drafts for it: after a stretch of plain rounds, every token of the stretch at once (a
prefill's worth, on cores the target may share; a head holds every sequence from its admission).
So a probe (a drafting round the policy's own choice would not play) drafts only for the sequence the
draft is least behind on (``scout``): one sequence catches up, not the batch. The round's interval,
catch-up included, is what the policy learns (what drafting there costs); the draft call's seconds
are not a draft step's cost. A round that hands held sequences over holds their
prefill: its interval is not what a round costs (``handed_over``). Either way the tokens the draft read
first (``read_first``) and the round's time teach the policy what catching up costs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from serve_app.config import SpeculationMethod
from serve_app.engine.block_sizer import BlockSizer
from serve_app.engine.request import Request
from serve_app.speculation.proposers.base import Proposer
from serve_app.speculation.types import ProposalBlock


class Deferral:
    def __init__(self, proposers: Mapping[SpeculationMethod, Proposer], sizer: BlockSizer,
                 bound: Callable[[Request], int], take_features: Callable[[Sequence[str]], list[torch.Tensor]],
                 joining: Callable[[], Sequence[Request]] = list):
        """``sizer``: the k policy's judgement of a batch, each request capped by ``bound(request)`` (the
        engine's hard bounds); ``take_features(seq_ids)``: the target's features of their contexts
        (``Verifier.take_features``); ``joining()``: the waiting requests the next step admits (in the
        batch the draft decides for)."""
        self.proposers, self.sizer, self.bound = proposers, sizer, bound
        self.take_features, self.joining = take_features, joining
        self.held: set[str] = set()  # running requests their proposer does not hold yet
        self.early: set[str] = set()  # handed over before the target's prefill (``start``), not running yet
        self.handing: dict[str, Request] = {}  # taken at ``admit``, to their proposer at ``hand_admitted``
        self.read: dict[str, int] = {}  # tokens of a sequence its draft has read (``reads_late``: at its last draft)
        self.handed_over = False  # the last ``split`` gave held sequences to their proposer
        self.read_first = 0  # tokens the drafts read this round before drafting (``split`` and ``scout``; ``took``)

    def start(self, req: Request, batch: Sequence[Request]) -> Callable[[], None]:
        """Admission is about to cache ``req``'s prompt on the target. A proposer that needs nothing of the
        target's and prefills aside (``Proposer.prefills_aside``: on cores of its own) takes it now, if the
        policy would draft for ``batch`` (what it joins: the running requests and those admitted with it):
        its prefill then runs beside the target's instead of beside the first rounds after it. One whose
        prefill would share the target's cores takes it after (``admit``): side by side, both would stall.
        Returns what undoes an early start if the target's call fails."""
        proposer = self.proposers[req.method]
        if not (proposer.can_add_later and proposer.prefills_aside) or proposer.reads_features \
                or not self.would_draft(batch):
            return lambda: None
        proposer.add_sequence(req.request_id, req.context_ids, req.params.sampling)
        self.early.add(req.request_id)
        self.read[req.request_id] = req.num_tokens

        def undo() -> None:
            proposer.remove_sequence(req.request_id)
            self.early.discard(req.request_id)
            self.read.pop(req.request_id, None)

        return undo

    def admit(self, ready: Iterable[Request], running: Mapping[str, Request]) -> None:
        """Requests whose prompt the target now holds (and now in ``running``): to their proposer, unless
        it took them at ``start`` or can take them later and the policy would not draft for ``running``."""
        drafting: bool | None = None
        taken = []
        for req in ready:
            if req.request_id in self.early:
                self.early.discard(req.request_id)
                continue
            if self.proposers[req.method].can_add_later:
                drafting = self.would_draft(self.batch(running)) if drafting is None else drafting
                if not drafting:
                    self.held.add(req.request_id)
                    continue
            taken.append(req)
        self._hand([r for r in taken if self.proposers[r.method].prefills_aside])
        self.handing.update((r.request_id, r) for r in taken if not self.proposers[r.method].prefills_aside)

    def hand_admitted(self, running: Mapping[str, Request]) -> None:
        """Requests ``admit`` took for a proposer that prefills on the target's cores (``Proposer.prefills_aside``
        false; those still in ``running``): to it now, before the round, after their first tokens went out. Its
        prefill no longer holds the first token back (the pair's 0.5 B draft in float32: about 1.1 s)."""
        requests = [req for seq_id, req in self.handing.items() if seq_id in running]
        self.handing.clear()
        self._hand(requests)

    def _hand(self, requests: Sequence[Request]) -> None:
        """Each request to its proposer, with its whole context so far (and the target's features of it,
        for a proposer that reads them: one call to the target for all of them)."""
        feature_ids = [r.request_id for r in requests if self.proposers[r.method].reads_features]
        features = dict(zip(feature_ids, self.take_features(feature_ids), strict=True)) if feature_ids else {}
        for req in requests:
            proposer = self.proposers[req.method]
            if proposer.reads_late:
                self.read[req.request_id] = req.num_tokens
            proposer.add_sequence(req.request_id, req.context_ids, req.params.sampling, features.get(req.request_id))

    def split(self, requests: Sequence[Request], running: Mapping[str, Request]
              ) -> tuple[list[ProposalBlock], list[Request]]:
        """Before a round's proposals: held sequences go to their proposer as ``releases`` says. Returns the
        held ones' empty block (they decode plainly) and the requests that propose as usual."""
        handed = [running[seq_id] for seq_id in self.releases(running)]
        self.handed_over = bool(handed)
        if handed:
            self._hand(handed)
            self.read_first += sum(r.num_tokens for r in handed)
            self.held.difference_update(r.request_id for r in handed)
        if not self.held:
            return [], list(requests)
        plain = [r.request_id for r in requests if r.request_id in self.held]
        rest = [r for r in requests if r.request_id not in self.held]
        return [ProposalBlock.make_dummy(plain, [[] for _ in plain])], rest

    def took(self) -> tuple[int, bool]:
        """(tokens the drafts read first, whether held sequences were handed over) since the last call: what
        the round just run took (none for a plain round sent ahead, which no ``split`` preceded)."""
        took, self.read_first, self.handed_over = (self.read_first, self.handed_over), 0, False
        return took

    def behind(self, req: Request) -> int | None:
        """Tokens of ``req`` its draft has still to read (None: not one that catches up)."""
        read = self.read.get(req.request_id)
        return None if read is None else req.num_tokens - read

    def scout(self, requests: Sequence[Request], sizes: dict[str, int], running: Mapping[str, Request],
              ahead: Iterable[str] = ()) -> bool:
        """This round's ``sizes`` (in place): a probe (they draft, the policy's own choice for ``running``
        would not) drafts, among the sequences a ``reads_late`` draft holds, only for the one it is least behind
        on. Returns whether a draft first reads more than a round's worth of tokens (``catches_up``); the
        drafts then will have read every token of the sequences they draft for, and of those drafted
        ahead (``ahead``)."""
        lag = {r.request_id: n for r in requests if sizes[r.request_id] and (n := self.behind(r)) is not None}
        if len(lag) > 1 and not self.would_draft(self.batch(running)):
            keep = min(lag, key=lambda s: (lag[s], s))
            for seq_id in lag.keys() - {keep}:
                sizes[seq_id] = 0
        behind = [lag[r.request_id] for r in requests
                  if sizes[r.request_id] and lag.get(r.request_id, 0) > r.num_speculative_tokens + 1]
        self.read_first += sum(behind)
        catches_up = bool(behind)
        for seq_id in [*(r.request_id for r in requests if sizes[r.request_id]), *ahead]:
            if seq_id in self.read:
                self.read[seq_id] = running[seq_id].num_tokens
        return catches_up

    def would_draft(self, requests: Sequence[Request]) -> bool:
        """Whether the k policy's own choice drafts for that batch (``BlockSizer.would_draft``)."""
        return self.sizer.would_draft(requests, [self.bound(r) for r in requests])

    def releasing(self, running: Mapping[str, Request]) -> bool:
        """Whether the next round's ``split`` hands held sequences over (so that round may draft)."""
        return bool(self.releases(running))

    def releases(self, running: Mapping[str, Request]) -> list[str]:
        """The held sequences the next round's ``split`` hands over: every one, where the policy would draft
        for the batch and drafting is predicted to gain more than the draft's reading of them costs
        (``BlockSizer.hand_over_pays``); else one, the shortest context (the cheapest to read), where no
        sequence of the batch is with a draft that can take it and the policy would pay that reading to
        measure drafting at the batch's size (``BlockSizer.explore_pays``): requests sent together are held
        together, and only a sequence a draft holds can show what drafting there realizes."""
        if not self.held:
            return []
        batch = self.batch(running)
        bounds = [self.bound(r) for r in batch]
        if self.sizer.would_draft(batch, bounds) and self.sizer.hand_over_pays(
                batch, bounds, sum(running[s].num_tokens for s in self.held)):
            return sorted(self.held)
        if any(s not in self.held and self.proposers[r.method].can_add_later for s, r in running.items()):
            return []
        shortest = min(self.held, key=lambda s: (running[s].num_tokens, s))
        return [shortest] if self.sizer.explore_pays(batch, bounds, running[shortest].num_tokens) else []

    def batch(self, running: Mapping[str, Request]) -> list[Request]:
        """The batch the draft decides for: the running requests and those about to join them (requests
        sent together reach a served engine one by one, the rest arriving during the first's prefill)."""
        return [*running.values(), *self.joining()]

    def discard(self, seq_id: str) -> None:
        self.held.discard(seq_id)
        self.early.discard(seq_id)
        self.handing.pop(seq_id, None)
        self.read.pop(seq_id, None)

    def clear(self) -> None:
        self.held.clear()
        self.early.clear()
        self.handing.clear()
        self.read.clear()
