"""The engine: admits requests, runs speculation rounds over the running batch, reports outputs.

It talks to a target verifier and to proposers only through ``add_sequence``/``remove_sequence``
and the typed round messages, so either side can be a local object or (next) a Ray actor handle.

One round, for every running sequence at once (Leviathan et al. 2023, Algorithm 1, batched):

    block  = concat(proposer.propose(its sequences, k_i) for each proposer)   # draft
    result = target.verify(block)                                           # score + accept
    proposer.observe(result)                                                # roll back / extend
    each request appends result.new_tokens(i) and checks its stop conditions

Plain rounds are pipelined when the target lives in another process and runs calls in the order
sent (a verifier with ``verify_async`` and ``can_send_ahead``): up to ``PIPELINE_DEPTH`` rounds are
sent before the earliest is processed, so the target starts round n + 1 as soon as round n is done,
and the round trip and the replica's work on round n's outputs (detokenizing, streaming) overlap its
compute instead of adding to every round (vLLM's async scheduling). A round is plain when no
sequence drafts (k = 0 by request, or the draft token budget spent under load): the target already
holds each sequence's last token, so a round needs nothing of the one before but which sequences go
on, and a plain round adds exactly one token to each. Sequences that reach max_tokens are left out
in advance; one that ends by EOS or a stop string while later rounds are in flight had tokens
computed in vain, which the engine drops (its release reaches the target after those rounds, actor
calls running in order).

Each round's k per sequence comes from the block-size policy (``speculation.policy``, fed every
round's result and costs) within the request's own k; without one, the request's k. With ``overlap``
the draft drafts each sequence's next block while the target verifies this one (``engine.ahead``).

Chunked prefill (``prefill_chunk``): a step caches at most that many prompt tokens before its round,
continuing the prompt it started in an earlier step, so admitting a long prompt delays the running
sequences by a chunk a round, never by the whole prompt. A sequence joins the round once its prompt
is cached (and then enters its proposer, which prefills its own copy at once: drafts are small).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from serve_app.config import SpeculationMethod
from serve_app.engine.ahead import DraftAhead, Drafted
from serve_app.engine.request import GenerationParams, Request, RequestOutput
from serve_app.engine.stats import SpecStats
from serve_app.speculation.policy import BlockSizePolicy, RoundCosts, Row
from serve_app.speculation.proposers.base import Proposer
from serve_app.speculation.types import ProposalBlock, VerifyResult
from serve_app.speculation.verifier import Verifier

PIPELINE_DEPTH = 2  # plain rounds in flight: enough to hide a round trip behind a round's compute


class RequestError(ValueError):
    """A request the engine cannot take (too long, unknown method, ...); a client error. ``param``:
    the request field it is about (the OpenAI error body names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Engine:
    def __init__(
        self,
        verifier: Verifier,
        proposers: Mapping[SpeculationMethod, Proposer],
        tokenizer: PreTrainedTokenizerBase,
        *,
        default_method: SpeculationMethod,
        default_k: int,
        max_seq_len: int,
        eos_ids: Iterable[int],
        on_round: Callable[[VerifyResult, float], None] | None = None,
        max_prompt_len: int | None = None,  # a compiled prefill graph's limit (Neuron); None: max_seq_len
        draft_token_budget: int | None = None,  # most draft tokens per round over the batch; None: no cap
        prefill_chunk: int | None = None,  # most prompt tokens cached per step; None: whole prompts at admission
        policy: BlockSizePolicy | None = None,  # picks each round's k per sequence; None: each request's k
        overlap: bool = False,  # draft block n + 1 while the target verifies block n (engine.ahead)
    ):
        if default_method not in proposers:
            raise ValueError(f"default method {default_method!r} has no proposer")
        self.verifier = verifier
        self.proposers = dict(proposers)
        self.tokenizer = tokenizer
        self.default_method = default_method
        self.default_k = default_k
        self.max_seq_len = max_seq_len
        self.max_prompt_len = max_prompt_len
        self.draft_token_budget = draft_token_budget
        self.prefill_chunk = prefill_chunk
        self.policy = policy
        self.ahead = DraftAhead(self.proposers) if overlap else None
        if self.ahead is not None and not self.ahead.proposers:
            raise ValueError("speculation.overlap needs a decoder draft model: n-gram lookup is nearly free and an "
                             "EAGLE head reads the target's features of the tokens it continues from, which a "
                             "block drafted ahead has not got; set overlap: false or draft: <a decoder model>")
        self.eos_ids = frozenset(eos_ids)
        self.on_round = on_round  # metrics sink: (result, seconds) per round
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        # admitted, prompt partly cached on the target (oldest first), with the features returned so far
        self.prefilling: deque[tuple[Request, list[torch.Tensor | None]]] = deque()
        self.stats = SpecStats()
        self._ids = itertools.count()
        self._pipelined = getattr(verifier, "can_send_ahead", False)  # a remote target, calls run in order
        # plain rounds sent ahead, oldest first: (wait for the result, sent at, seq_ids)
        self._in_flight: deque[tuple[Callable[[], VerifyResult], float, tuple[str, ...]]] = deque()
        self._draft_s: dict[str, tuple[int, float]] = {}  # this round's proposer calls: (steps, seconds)
        self._round_end: float | None = None  # when the last round's result came
        self.last_costs: RoundCosts | None = None  # what the last round cost (the policy's and the planner's input)

    # ---- requests -----------------------------------------------------------------------------
    def validate(self, prompt_ids: Sequence[int], params: GenerationParams) -> SpeculationMethod:
        """Check a request without touching engine state (safe from any thread)."""
        method = params.method or self.default_method
        if method not in self.proposers:
            raise RequestError(f"speculation method {method!r} is not available here; "
                               f"available: {sorted(self.proposers)}", "speculative_method")
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        if params.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", "max_tokens")
        if self.max_prompt_len is not None and len(prompt_ids) > self.max_prompt_len:
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) exceeds the {self.max_prompt_len} tokens "
                               "the compiled prefill graph takes (engine.neuron.max_context_length + 1)", "prompt")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_seq_len} tokens", "max_tokens"
            )
        return method

    def add_request(self, prompt_ids: Sequence[int], params: GenerationParams,
                    request_id: str | None = None) -> str:
        method = self.validate(prompt_ids, params)
        k = self.default_k if params.num_speculative_tokens is None else params.num_speculative_tokens
        if k == 0:  # plain decoding: no proposer holds the sequence, so it costs no draft work at all
            method = "none"
        if method == "none":
            k = 0
        request_id = request_id or f"req-{next(self._ids)}"
        self.waiting.append(Request(request_id, list(prompt_ids), params, method, k))
        return request_id

    def abort(self, request_id: str) -> None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
        for entry in list(self.prefilling):
            if entry[0].request_id == request_id:
                self.prefilling.remove(entry)
                self._release(entry[0])
        req = self.running.pop(request_id, None)
        if req is not None:
            self._release(req)

    def abort_all(self) -> list[Request]:
        """Drop every request (after a worker failure); returns them so callers can be told."""
        dropped = list(self.waiting) + [r for r, _ in self.prefilling] + list(self.running.values())
        self._in_flight.clear()
        if self.ahead is not None:
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
        self._in_flight.clear()
        self._round_end = None
        admitted = sorted([r for r, _ in self.prefilling] + list(self.running.values()), key=lambda r: r.arrival)
        self.prefilling.clear()
        self.running.clear()
        for req in admitted:
            if self.ahead is not None:
                self.ahead.drop(req.request_id)
            self.proposers[req.method].remove_sequence(req.request_id)
            req.prefilled = 0
        self.waiting.extendleft(reversed(admitted))
        return len(admitted)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self._in_flight)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit what fits, run one speculation round; return an output for every running request."""
        overhead, ahead_blocks, admitted = None, [], False
        if self._in_flight:  # a plain round sent ahead by an earlier step
            wait, start, _ = self._in_flight.popleft()
            result = wait()
            verify_start = start if self._round_end is None else max(start, self._round_end)
        else:
            if self._round_end is not None:  # the engine's and its caller's work since the last round
                overhead = time.perf_counter() - self._round_end
            admitted = self._admit()
            if not self.running:
                self._round_end = None
                return []
            start = time.perf_counter()
            block = self._propose(list(self.running.values()))
            verify_start = time.perf_counter()
            if self.ahead is None:
                result = self.verifier.verify(block)
            else:  # the draft's unhidden time, if any, counts in the target's
                result, ahead_blocks = self._verify_drafting_ahead(block)
        for proposer in self.proposers.values():
            proposer.observe(result)
        previous_end, self._round_end = self._round_end, time.perf_counter()
        elapsed = self._round_end - start
        tokens = len(result.seq_ids) + int(result.num_draft_tokens.sum())
        interval = None if previous_end is None or admitted else self._round_end - previous_end
        kept = len(result.seq_ids) + int(result.num_accepted.sum())
        self.last_costs = RoundCosts(tokens, self._round_end - verify_start, self._draft_s, overhead,
                                     len(result.seq_ids), interval, kept)
        self._draft_s = {}
        if self.policy is not None:
            self.policy.observe(result)
            self.policy.record_costs(self.last_costs)
        if self.on_round is not None:
            self.on_round(result, elapsed)
        if self._pipelined:
            self._send_ahead(result)

        outputs = []
        for i, seq_id in enumerate(result.seq_ids):
            req = self.running.get(seq_id)
            if req is None:
                continue  # aborted, or ended in a round already processed (see the module docstring)
            drafted, accepted = int(result.num_draft_tokens[i]), int(result.num_accepted[i])
            req.stats.record_round(drafted, accepted)
            self.stats.record_round(drafted, accepted)
            req.append(result.new_tokens(i), self.eos_ids, self.tokenizer)
            if req.finish_reason is not None:
                del self.running[seq_id]
                self._release(req)
            outputs.append(req.take_output())
        if self.ahead is not None and ahead_blocks:
            self.ahead.finish(ahead_blocks, result, self.running)
        return outputs

    def _verify_drafting_ahead(self, block: ProposalBlock) -> tuple[VerifyResult, list[Drafted]]:
        """Send the block to the target, then have each drafting sequence's proposer draft its next
        block meanwhile (an in-process target: one after the other, for the same outcome)."""
        rows = []
        for seq_id, k in zip(block.seq_ids, block.num_draft_tokens.tolist(), strict=True):
            req = self.running[seq_id]
            if k:
                rows.append((seq_id, req.method, min(k, self._block_size(req, None, pending=k + 1))))
        send = getattr(self.verifier, "verify_async", None)
        wait = send(block) if send is not None else None
        drafting = self.ahead.start(rows)  # type: ignore[union-attr]
        result = wait() if wait is not None else self.verifier.verify(block)
        return result, drafting()

    def _send_ahead(self, result: VerifyResult) -> None:
        """Keep ``PIPELINE_DEPTH`` plain rounds in flight while every sequence that goes on has nothing
        to draft and nobody waits to be admitted (an admission changes the batch)."""
        if self.prefilling or (self.waiting and self.verifier.free_slots > 0) or (self.ahead and self.ahead.ready):
            return
        gained: Counter[str] = Counter()  # tokens each sequence gains before the next round sent
        ended = set()
        for i, seq_id in enumerate(result.seq_ids):
            new = result.new_tokens(i)
            gained[seq_id] += len(new)
            req = self.running.get(seq_id)
            if req is not None and not req.params.ignore_eos and any(t in self.eos_ids for t in new):
                ended.add(seq_id)
        for _, _, seq_ids in self._in_flight:
            gained.update(seq_ids)  # a plain round adds one token to each of its sequences
        while len(self._in_flight) < PIPELINE_DEPTH:
            going_on = [r for r in self.running.values() if r.request_id not in ended
                        and len(r.output_ids) + gained[r.request_id] < r.params.max_tokens]
            if not going_on or any(self._block_sizes(going_on, gained)):
                return
            seq_ids = tuple(r.request_id for r in going_on)
            block = ProposalBlock.make_dummy(seq_ids, [[] for _ in seq_ids])
            wait = self.verifier.verify_async(block)  # type: ignore[attr-defined]
            self._in_flight.append((wait, time.perf_counter(), seq_ids))
            gained.update(seq_ids)

    def _admit(self) -> bool:
        """Cache prompts on the target, at most ``prefill_chunk`` tokens this step (the prompt started
        earlier first); a sequence whose prompt is all cached enters its proposer and the round.
        Returns whether it did any of that."""
        budget, admitted = self.prefill_chunk, False
        while budget is None or budget > 0:
            if self.prefilling:
                req, parts = self.prefilling[0]
                n = self._prefill_count(req, budget)
                parts.append(self.verifier.continue_prefill(req.request_id, n))  # type: ignore[attr-defined]
            elif self.waiting and self.verifier.free_slots > 0:
                req = self.waiting[0]
                n = self._prefill_count(req, budget)
                parts = [self.verifier.add_sequence(req.request_id, req.context_ids, req.params.sampling, n)]
                self.waiting.popleft()  # only once the target holds it: a failed call leaves it queued
                self.prefilling.append((req, parts))
            else:
                return admitted
            admitted = True
            req.prefilled += n
            req.stats.target_forward_passes += int(n > 0)
            if budget is not None:
                budget -= max(n, 1)  # a one-token prompt caches nothing, but admitting it is a call
            if req.prefilled == len(req.context_ids) - 1:
                self.prefilling.popleft()
                features = None if parts[0] is None else torch.cat(parts)  # type: ignore[arg-type]  # EAGLE reads them
                self.proposers[req.method].add_sequence(req.request_id, req.context_ids, req.params.sampling, features)
                self.running[req.request_id] = req
        return admitted

    @staticmethod
    def _prefill_count(req: Request, budget: int | None) -> int:
        left = len(req.context_ids) - 1 - req.prefilled  # the last token is scored by the first round
        return left if budget is None else min(left, budget)

    def _budget_cap(self, requests: Sequence[Request]) -> int | None:
        """Each drafting request's share of the draft token budget this round (None: no cap)."""
        drafting = sum(r.num_speculative_tokens > 0 for r in requests)
        return None if self.draft_token_budget is None or not drafting else self.draft_token_budget // drafting

    def _propose(self, requests: Sequence[Request]) -> ProposalBlock:
        blocks = self.ahead.take(r.request_id for r in requests) if self.ahead is not None else []
        held = {b.seq_ids[0] for b in blocks}  # drafted ahead, and the last round kept what they rest on
        requests = [r for r in requests if r.request_id not in held]
        sizes = dict(zip((r.request_id for r in requests), self._block_sizes(requests), strict=True))
        for method, proposer in self.proposers.items():
            group = [r.request_id for r in requests if r.method == method]
            if group:
                ks = [sizes[s] for s in group]
                start = time.perf_counter()
                blocks.append(proposer.propose(group, ks))
                if any(ks):
                    self._draft_s[method] = (max(ks), time.perf_counter() - start)
        return ProposalBlock.concat(blocks)

    def _block_sizes(self, requests: Sequence[Request], pending: Mapping[str, int] | None = None) -> list[int]:
        """This round's k for each request: the policy's choice within each request's cap, or the cap."""
        cap = self._budget_cap(requests)
        caps = [self._block_size(r, cap, (pending or {}).get(r.request_id, 0)) for r in requests]
        if self.policy is None or not any(caps):
            return caps
        # A seeded request keeps its k: its samples depend on the blocks, and timing-led choices would
        # make the same seed give different text from run to run.
        free = [i for i, r in enumerate(requests) if r.params.sampling.seed is None]
        rows = [Row(requests[i].request_id, caps[i], requests[i].method) for i in free]
        for i, k in zip(free, self.policy.choose(rows, plain_overhead_hidden=self._pipelined), strict=True):
            caps[i] = k
        return caps

    def _block_size(self, req: Request, cap: int | None, pending: int = 0) -> int:
        # Never draft past max_tokens (the target adds one token of its own), past the cache, or past
        # this round's share of the draft token budget. ``pending``: tokens the request is about to gain.
        remaining = req.params.max_tokens - len(req.output_ids) - pending - 1
        room = self.max_seq_len - req.num_tokens - pending - 1
        k = req.num_speculative_tokens if cap is None else min(req.num_speculative_tokens, cap)
        return max(0, min(k, remaining, room))

    def _release(self, req: Request) -> None:
        if self.policy is not None:
            self.policy.forget(req.request_id)
        if self.ahead is not None:
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
