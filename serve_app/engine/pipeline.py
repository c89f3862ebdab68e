"""Plain rounds pipelined (vLLM's async scheduling), where the target runs calls in the order sent.

Up to ``PIPELINE_DEPTH`` rounds are sent before the earliest is processed, so the target starts
round n + 1 as soon as round n is done, and the round trip and the replica's work on round n's
outputs (detokenizing, streaming) overlap its compute instead of adding to every round. A round is
plain when no sequence drafts (k = 0 by request, or the policy or the budget said so): the target
already holds each sequence's last token, so a round needs nothing of the one before but which
sequences go on, and a plain round adds exactly one token to each. Sequences that reach max_tokens
are left out in advance; one that ends by EOS or a stop string while later rounds are in flight had
tokens computed in vain, which the engine drops (its release reaches the target after those rounds,
actor calls running in order).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping, Sequence

from serve_app.engine.request import Request
from serve_app.speculation.types import ProposalBlock, VerifyResult
from serve_app.speculation.verifier import Verifier

PIPELINE_DEPTH = 2  # plain rounds in flight: enough to hide a round trip behind a round's compute

Wait = Callable[[], VerifyResult]


class PlainPipeline:
    def __init__(self, depth: int = PIPELINE_DEPTH):
        self.depth = depth
        self.in_flight: deque[tuple[Wait, float, tuple[str, ...]]] = deque()  # (wait, sent at, seq_ids), oldest first

    def __bool__(self) -> bool:
        return bool(self.in_flight)

    def pop(self) -> tuple[Wait, float]:
        wait, sent, _ = self.in_flight.popleft()
        return wait, sent

    def clear(self) -> None:
        self.in_flight.clear()

    def fill(self, verifier: Verifier, result: VerifyResult, running: Mapping[str, Request], eos_ids: Collection[int],
             drafts: Callable[[Sequence[Request], Mapping[str, int]], bool]) -> None:
        """After ``result``, keep ``depth`` plain rounds in flight while every sequence that goes on
        has nothing to draft (``drafts(requests, tokens each gains before)`` says whether any would)."""
        gained: Counter[str] = Counter()  # tokens each sequence gains before the next round sent
        ended = set()
        for i, seq_id in enumerate(result.seq_ids):
            new = result.new_tokens(i)
            gained[seq_id] += len(new)
            req = running.get(seq_id)
            if req is not None and not req.params.ignore_eos and any(t in eos_ids for t in new):
                ended.add(seq_id)
        for _, _, seq_ids in self.in_flight:
            gained.update(seq_ids)  # a plain round adds one token to each of its sequences
        while len(self.in_flight) < self.depth:
            going_on = [r for r in running.values() if r.request_id not in ended
                        and len(r.output_ids) + gained[r.request_id] < r.params.max_tokens]
            if not going_on or drafts(going_on, gained):
                return
            seq_ids = tuple(r.request_id for r in going_on)
            block = ProposalBlock.make_dummy(seq_ids, [[] for _ in seq_ids])
            self.in_flight.append((verifier.verify_async(block), time.perf_counter(), seq_ids))
            gained.update(seq_ids)
