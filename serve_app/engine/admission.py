"""Admission: requests wait for a KV-cache slot, then the target caches their prompts.

Chunked prefill (``prefill_chunk``): a step caches at most that many prompt tokens before its round,
continuing the prompt it started in an earlier step, so admitting a long prompt delays the running
sequences by a chunk a round, never by the whole prompt. A sequence joins the round once its prompt
is cached (the engine hands it to its proposer then, or before the target's prefill when the proposer
needs nothing of the target's: ``engine.deferral``). The forward that caches a prompt's last token scores
it (``Verifier.add_sequence``): the request's first token comes from its prefill, as in vLLM, and whole-
prompt admission caches one prompt a step so that token goes out before the next prompt's prefill (served
on the real pair the first token had come from the first round, after the draft's prefill and first block:
0.5 s later at one stream; at 16, each request sent together waited for every prompt of the burst).

Requests sent together reach a served engine one by one: the first is often admitted alone, the rest
arriving during its prefill. ``arrivals`` (the serving loop's) queues those before the step goes on, so
the batch its round and its draft are decided for is the one about to run.

Each of the target's prefill calls is timed for the k policy (``on_forward``: tokens, seconds): the only
forwards of many tokens before a round at a large batch, which price such a round (``engine.deferral``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from serve_app.engine.request import Request
from serve_app.speculation.verifier import Verifier


class Admission:
    def __init__(self, prefill_chunk: int | None = None,
                 on_forward: Callable[[int, float], None] = lambda tokens, seconds: None):
        self.prefill_chunk = prefill_chunk  # most prompt tokens cached per step; None: whole prompts
        self.on_forward = on_forward  # each prefill call of the target: (tokens, seconds)
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()  # admitted, prompt partly cached on the target (oldest first)
        self.arrivals: Callable[[], object] = lambda: None  # queues requests submitted meanwhile (``waiting``)

    def step(self, verifier: Verifier, starting: Callable[[Request], Callable[[], None]] = lambda req: lambda: None
             ) -> tuple[bool, list[Request], list[int]]:
        """Cache what this step's budget allows (the prompt started earlier first; without a budget, one
        whole prompt). Returns whether it did anything, the requests whose prompt is now all cached, and
        their first tokens. ``starting(req)`` runs before the target takes a new request, and returns what
        undoes it should the target's call fail."""
        budget, admitted, ready, first = self.prefill_chunk, False, list[Request](), list[int]()
        while (budget is None and not ready) or (budget is not None and budget > 0):
            if self.prefilling:
                req = self.prefilling[0]
                n = self._count(req, budget)
                start = time.perf_counter()
                token = verifier.continue_prefill(req.request_id, n)
            elif self.waiting and verifier.free_slots > 0:
                req = self.waiting[0]
                n = self._count(req, budget)
                undo = starting(req)
                start = time.perf_counter()
                try:
                    token = verifier.add_sequence(req.request_id, req.context_ids, req.params.sampling, n)
                except BaseException:
                    undo()
                    raise
                self.waiting.popleft()  # only once the target holds it: a failed call leaves it queued
                self.prefilling.append(req)
            else:
                break
            self.on_forward(n, time.perf_counter() - start)
            admitted = True
            req.prefilled += n
            req.stats.target_forward_passes += 1
            if budget is not None:
                budget -= n
            if req.prefilled == len(req.context_ids):
                if token is None:
                    raise RuntimeError(f"the target cached all of {req.request_id}'s prompt but drew no first token")
                ready.append(self.prefilling.popleft())
                first.append(token)
        if ready:
            self.arrivals()
        return admitted, ready, first

    @staticmethod
    def _count(req: Request, budget: int | None) -> int:
        left = len(req.context_ids) - req.prefilled
        return left if budget is None else min(left, budget)
