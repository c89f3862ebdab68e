"""The engine: admits requests, runs speculation rounds over the running batch, reports outputs.

It talks to a target verifier and to proposers only through ``add_sequence``/``remove_sequence``
and the typed round messages, so either side can be a local object or (next) a Ray actor handle.

One round, for every running sequence at once (Leviathan et al. 2023, Algorithm 1, batched):

    block  = concat(proposer.propose(its sequences, k_i) for each proposer)   # draft
    result = target.verify(block)                                           # score + accept
    proposer.observe(result)                                                # roll back / extend
    each request appends result.new_tokens(i) and checks its stop conditions
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from transformers import PreTrainedTokenizerBase

from serve_app.config import SpeculationMethod
from serve_app.engine.request import GenerationParams, Request, RequestOutput
from serve_app.engine.stats import SpecStats
from serve_app.speculation.proposers.base import Proposer
from serve_app.speculation.types import ProposalBlock, VerifyResult
from serve_app.speculation.verifier import TargetVerifier


class RequestError(ValueError):
    """A request the engine cannot take (too long, unknown method, ...); a client error."""


class Engine:
    def __init__(
        self,
        verifier: TargetVerifier,
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
        self.eos_ids = frozenset(eos_ids)
        self.on_round = on_round  # metrics sink: (result, seconds) per round
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.stats = SpecStats()
        self._ids = itertools.count()

    # ---- requests -----------------------------------------------------------------------------
    def validate(self, prompt_ids: Sequence[int], params: GenerationParams) -> SpeculationMethod:
        """Check a request without touching engine state (safe from any thread)."""
        method = params.method or self.default_method
        if method not in self.proposers:
            raise RequestError(f"speculation method {method!r} is not available here; "
                               f"available: {sorted(self.proposers)}")
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if params.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        if self.max_prompt_len is not None and len(prompt_ids) > self.max_prompt_len:
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) exceeds the {self.max_prompt_len} tokens "
                               "the compiled prefill graph takes (engine.neuron.max_context_length + 1)")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_seq_len} tokens"
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
        req = self.running.pop(request_id, None)
        if req is not None:
            self._release(req)

    def abort_all(self) -> list[Request]:
        """Drop every request (after a worker failure); returns them so callers can be told."""
        dropped = list(self.waiting) + list(self.running.values())
        self.waiting.clear()
        for req in list(self.running.values()):
            del self.running[req.request_id]
            try:
                self._release(req)
            except Exception:  # noqa: BLE001 - the worker that failed may not answer
                pass
        return dropped

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit what fits, run one speculation round; return an output for every running request."""
        self._admit()
        if not self.running:
            return []
        requests = list(self.running.values())
        start = time.perf_counter()
        block = self._propose(requests)
        result = self.verifier.verify(block)
        for proposer in self.proposers.values():
            proposer.observe(result)
        elapsed = time.perf_counter() - start
        if self.on_round is not None:
            self.on_round(result, elapsed)

        by_id = {r.request_id: r for r in requests}
        outputs = []
        for i, seq_id in enumerate(result.seq_ids):
            req = by_id[seq_id]
            drafted, accepted = int(result.num_draft_tokens[i]), int(result.num_accepted[i])
            req.stats.record_round(drafted, accepted)
            self.stats.record_round(drafted, accepted)
            req.append(result.new_tokens(i), self.eos_ids, self.tokenizer)
            if req.finish_reason is not None:
                del self.running[seq_id]
                self._release(req)
            outputs.append(req.take_output())
        return outputs

    def _admit(self) -> None:
        while self.waiting and self.verifier.free_slots > 0:
            req = self.waiting.popleft()
            params = req.params.sampling
            features = self.verifier.add_sequence(req.request_id, req.prompt_ids, params)  # None unless EAGLE
            self.proposers[req.method].add_sequence(req.request_id, req.prompt_ids, params, features)
            if len(req.prompt_ids) > 1:
                req.stats.target_forward_passes += 1  # the prefill
            self.running[req.request_id] = req

    def _propose(self, requests: Sequence[Request]) -> ProposalBlock:
        drafting = sum(r.num_speculative_tokens > 0 for r in requests)
        cap = None if self.draft_token_budget is None or not drafting else self.draft_token_budget // drafting
        blocks = []
        for method, proposer in self.proposers.items():
            group = [r for r in requests if r.method == method]
            if group:
                sizes = [self._block_size(r, cap) for r in group]
                blocks.append(proposer.propose([r.request_id for r in group], sizes))
        return ProposalBlock.concat(blocks)

    def _block_size(self, req: Request, cap: int | None) -> int:
        # Never draft past max_tokens (the target adds one token of its own), past the cache, or past
        # this round's share of the draft token budget.
        remaining = req.params.max_tokens - len(req.output_ids) - 1
        room = self.max_seq_len - req.num_tokens - 1
        k = req.num_speculative_tokens if cap is None else min(req.num_speculative_tokens, cap)
        return max(0, min(k, remaining, room))

    def _release(self, req: Request) -> None:
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
