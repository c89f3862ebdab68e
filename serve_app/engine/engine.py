"""The engine: admits requests, runs speculation rounds over the running batch, reports outputs.

It talks to a target verifier and to proposers only through ``add_sequence``/``remove_sequence``
and the typed round messages, so either side can be a local object or a Ray actor handle (``serve_app.workers``).

One round, for every running sequence at once (Leviathan et al. 2023, Algorithm 1, batched):

    block  = concat(proposer.propose(its sequences, k_i) for each proposer)   # draft
    result = target.verify(block)                                           # score + accept
    proposer.observe(result)                                                # roll back / extend
    each request appends result.new_tokens(i) and checks its stop conditions

Plain rounds are pipelined where the target runs calls in the order sent (``engine.pipeline``). Each
round's k per sequence comes from ``engine.block_sizer`` within the engine's hard bounds; ``engine.deferral``
decides when a draft takes a sequence; with ``overlap`` the draft drafts the next block while the target
verifies this one (``engine.ahead``); ``engine.admission`` caches prompts in chunks as slots free up.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from transformers import PreTrainedTokenizerBase

from serve_app.config import SpeculationMethod
from serve_app.engine.admission import Admission
from serve_app.engine.ahead import DraftAhead
from serve_app.engine.block_sizer import BlockSizer
from serve_app.engine.deferral import Deferral
from serve_app.engine.pipeline import PlainPipeline
from serve_app.engine.request import GenerationParams, Request, RequestError, RequestOutput
from serve_app.engine.round_timer import RoundTimer
from serve_app.engine.stats import SpecStats
from serve_app.speculation.policy import KPolicy, RoundCosts
from serve_app.speculation.proposers.base import Drafted, Proposer
from serve_app.speculation.types import ProposalBlock, VerifyResult
from serve_app.speculation.verifier import Verifier

RoundSink = Callable[[VerifyResult, float], None]  # a metrics sink: (result, seconds) per round


class Engine:
    def __init__(
        self,
        verifier: Verifier,
        proposers: Mapping[SpeculationMethod, Proposer],
        tokenizer: PreTrainedTokenizerBase,
        sizer: BlockSizer,
        *,
        max_seq_len: int,
        eos_ids: Iterable[int],
        on_round: RoundSink | None = None,
        max_prompt_len: int | None = None,  # a compiled prefill graph's limit (Neuron); None: max_seq_len
        prefill_chunk: int | None = None,  # most prompt tokens cached per step; None: whole prompts at admission
        overlap: bool = False,  # draft block n + 1 while the target verifies block n (engine.ahead)
    ):
        if sizer.default_method not in proposers:
            raise ValueError(f"default method {sizer.default_method!r} has no proposer")
        self.verifier = verifier
        self.proposers = dict(proposers)
        self.tokenizer = tokenizer
        self.sizer = sizer
        self.max_seq_len = max_seq_len
        self.max_prompt_len = max_prompt_len
        self.ahead = DraftAhead(self.proposers if overlap else {})
        if overlap and not self.ahead.enabled:
            raise ValueError("speculation.overlap needs a decoder draft model: n-gram lookup is nearly free and an "
                             "EAGLE head reads the target's features of the tokens it continues from, which a "
                             "block drafted ahead has not got; set overlap: false or draft: <a decoder model>")
        self.eos_ids = frozenset(eos_ids)
        self.on_round: RoundSink = on_round or (lambda result, seconds: None)
        self.admission = Admission(prefill_chunk, lambda tokens, seconds: self.sizer.on_prefill(tokens, seconds))
        self.waiting, self.prefilling = self.admission.waiting, self.admission.prefilling  # the same queues
        self.running: dict[str, Request] = {}
        self.deferral = Deferral(  # who the draft takes, and when
            self.proposers, sizer, self._bound, lambda seq_ids: self.verifier.take_features(seq_ids),
            lambda: list(self.waiting)[:self.verifier.free_slots])
        self.stats = SpecStats()
        self._ids = itertools.count()
        self.pipeline = PlainPipeline()  # plain rounds sent ahead (only where the verifier can_send_ahead)
        self.timer = RoundTimer()
        self.last_costs: RoundCosts | None = None  # what the last round cost (the policy's and the planner's input)

    @property
    def policy(self) -> KPolicy:
        return self.sizer.policy

    @policy.setter
    def policy(self, policy: KPolicy) -> None:
        self.sizer.policy = policy

    # ---- requests -----------------------------------------------------------------------------
    def validate(self, prompt_ids: Sequence[int], params: GenerationParams) -> SpeculationMethod:
        """Check a request without touching engine state (safe from any thread)."""
        method = params.method or self.sizer.default_method
        if method not in self.proposers:
            raise RequestError(f"speculation method {method!r} is not available here; "
                               f"available: {sorted(self.proposers)}", "speculative_method")
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        if params.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", "max_tokens")
        if self.max_prompt_len is not None and len(prompt_ids) > self.max_prompt_len:
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) exceeds the {self.max_prompt_len} tokens "
                               "the compiled prefill graph takes (engine.neuron.max_context_length)", "prompt")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_seq_len} tokens", "max_tokens"
            )
        return method

    def add_request(self, prompt_ids: Sequence[int], params: GenerationParams,
                    request_id: str | None = None) -> str:
        method, k = self.sizer.for_request(self.validate(prompt_ids, params), params.num_speculative_tokens)
        request_id = request_id or f"req-{next(self._ids)}"
        self.waiting.append(Request(request_id, list(prompt_ids), params, method, k))
        return request_id

    def abort(self, request_id: str) -> None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
        for req in list(self.prefilling):
            if req.request_id == request_id:
                self.prefilling.remove(req)
                self._release(req)
        if request_id in self.running:
            self._release(self.running.pop(request_id))

    def abort_all(self) -> list[Request]:
        """Drop every request (after a worker failure); returns them so callers can be told."""
        dropped = list(self.waiting) + list(self.prefilling) + list(self.running.values())
        self.pipeline.clear()
        self.ahead.ready.clear()
        self.waiting.clear()
        self.prefilling.clear()
        for req in list(self.running.values()):
            del self.running[req.request_id]
            try:
                self._release(req)
            except Exception:  # noqa: BLE001 - the worker that failed may not answer
                pass
        return dropped

    def requeue_admitted(self) -> int:
        """After the target lost every sequence's state (its worker died and a new one took its
        place): every admitted request goes back to the head of the queue, oldest first, to cache its
        prompt plus the tokens it has generated and go on from there; the tokens already reported
        stay reported. Rounds in flight are dropped (their tokens were never reported). Proposers
        forget the sequences too and take them again at re-admission. Returns how many requeued."""
        self.pipeline.clear()
        self.timer.reset()
        admitted = sorted([*self.prefilling, *self.running.values()], key=lambda r: r.arrival)
        self.prefilling.clear()
        self.running.clear()
        self.deferral.clear()
        for req in admitted:
            self.ahead.drop(req.request_id)
            self.proposers[req.method].remove_sequence(req.request_id)
            req.prefilled = 0
        self.waiting.extendleft(reversed(admitted))
        return len(admitted)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.pipeline)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit what fits, run one round; an output per running request (a prompt cached whole: its first token)."""
        overhead, admitted, first = None, False, list[RequestOutput]()
        ahead_blocks: list[Drafted] = []
        if self.pipeline:  # a plain round sent ahead by an earlier step
            wait, start = self.pipeline.pop()
            result = wait()
            verify_start = self.timer.verify_start(start)
        else:
            overhead = self.timer.overhead()  # the engine's and its caller's work since the last round
            admitted, first = self._admit()
            if first and self.admission.prefill_chunk is None or not self.running:
                self.timer.reset()  # first tokens out now, from the prefills; proposers and a round next step
                return first
            self.deferral.hand_admitted(self.running)  # prompts cached since the last round, first tokens out
            start = time.perf_counter()
            block = self._propose(list(self.running.values()))
            verify_start = time.perf_counter()
            rows = self.ahead.rows(block, self.running, self._bound)  # to draft ahead (``overlap``)
            result, ahead_blocks = self.ahead.verify(self.verifier, block, rows)
        for proposer in self.proposers.values():
            proposer.observe(result)
        disturbed = admitted or any(p.busy for p in self.proposers.values())  # beside a prefill: not what a round costs
        elapsed, self.last_costs = self.timer.finish(result, start, verify_start, overhead, disturbed,
                                                     *self.deferral.took())
        self.sizer.on_round(result, self.last_costs)
        self.on_round(result, elapsed)
        if self.verifier.can_send_ahead and not self.prefilling and not self.ahead.ready \
                and not (self.waiting and self.verifier.free_slots > 0):  # an admission changes the batch
            self.pipeline.fill(self.verifier, result, self.running, self.eos_ids, lambda reqs, gained: any(
                self._block_sizes(reqs, gained)) or self.deferral.releasing(self.running))

        for i, seq_id in enumerate(result.seq_ids):
            if (req := self.running.get(seq_id)) is not None:  # else aborted or ended (see engine.pipeline)
                drafted, accepted = int(result.num_draft_tokens[i]), int(result.num_accepted[i])
                req.stats.record_round(drafted, accepted)
                self.stats.record_round(drafted, accepted)
        outputs = [*first, *self._append(result)]
        if ahead_blocks:
            self.ahead.finish(ahead_blocks, result, self.running)
        return outputs

    def _append(self, result: VerifyResult) -> list[RequestOutput]:
        """Each running request's new tokens (a round's, or the first, from the prefill), stops checked."""
        outputs = []
        for i, seq_id in enumerate(result.seq_ids):
            if (req := self.running.get(seq_id)) is not None:
                req.append(result.new_tokens(i), self.eos_ids, self.tokenizer)
                if req.finish_reason is not None:
                    del self.running[seq_id]
                    self._release(req)
                outputs.append(req.take_output())
        return outputs

    def _admit(self) -> tuple[bool, list[RequestOutput]]:
        """Admission's step (``engine.admission``): a cached prompt's request takes its first token (the prefill's)
        and enters the round (its proposer as ``engine.deferral`` decides). Returns (admitted or cached, outputs)."""
        joining = self.deferral.joining()  # what this step admits, at most
        batch = [*self.running.values(), *self.prefilling, *joining]
        admitted, ready, tokens = self.admission.step(self.verifier, lambda req: self.deferral.start(req, batch))
        if not ready:
            return admitted, []
        self.running.update((req.request_id, req) for req in ready)
        first = VerifyResult.plain([req.request_id for req in ready], tokens)
        for proposer in self.proposers.values():
            proposer.observe(first)  # one that took a request at ``deferral.start`` reads its first token
        outputs = self._append(first)
        self.deferral.admit([req for req in ready if req.request_id in self.running], self.running)
        return admitted, outputs

    def _propose(self, requests: Sequence[Request]) -> ProposalBlock:
        blocks = self.ahead.take(r.request_id for r in requests)
        ahead_ids = {b.seq_ids[0] for b in blocks}  # drafted ahead, and the last round kept what they rest on
        requests = [r for r in requests if r.request_id not in ahead_ids]
        plain, drafting = self.deferral.split(requests, self.running)
        sizes = dict(zip((r.request_id for r in requests), self._block_sizes(requests), strict=True))
        catching_up = self.deferral.scout(drafting, sizes, self.running, ahead_ids)  # not a draft step's seconds
        blocks += plain
        for method, proposer in self.proposers.items():
            group = [r.request_id for r in drafting if r.method == method]
            if group:
                ks = [sizes[s] for s in group]
                start = time.perf_counter()
                blocks.append(proposer.propose(group, ks))
                if any(ks):
                    self.timer.drafted(method, ks, None if catching_up else time.perf_counter() - start)
        return ProposalBlock.concat(blocks)

    def _block_sizes(self, requests: Sequence[Request], pending: Mapping[str, int] | None = None) -> list[int]:
        """This round's k for each request: the sizer's choice within the hard bounds (0 for one its draft
        does not hold yet, ``engine.deferral``, so the policy judges the round it is)."""
        held, pending = self.deferral.held, pending or {}
        bounds = [0 if r.request_id in held else self._bound(r, pending.get(r.request_id, 0)) for r in requests]
        return self.sizer.choose(requests, bounds, pipelined=self.verifier.can_send_ahead)

    def _bound(self, req: Request, pending: int = 0) -> int:
        """The most a request may draft: never past max_tokens (the target adds one token of its own)
        or past the cache. ``pending``: tokens the request is about to gain."""
        remaining = req.params.max_tokens - len(req.output_ids) - pending - 1
        room = self.max_seq_len - req.num_tokens - pending - 1
        return max(0, min(remaining, room))

    def _release(self, req: Request) -> None:
        self.deferral.discard(req.request_id)
        self.sizer.forget(req.request_id)
        self.ahead.drop(req.request_id)
        self.verifier.remove_sequence(req.request_id)
        self.proposers[req.method].remove_sequence(req.request_id)

    # ---- convenience --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: GenerationParams | Sequence[GenerationParams]
                 ) -> list[RequestOutput]:
        """Run requests to completion (batched up to the runner's slots); outputs in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, GenerationParams) else list(params)
        ids: list[str] = []
        try:
            for p, gp in zip(prompts, plist, strict=True):
                ids.append(self.add_request(p, gp))
        except RequestError:
            for request_id in ids:  # all or nothing
                self.abort(request_id)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
