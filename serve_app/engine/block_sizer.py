"""Each round's block size k per sequence, decided in one place.

The rules, in the order they apply:
1. a request's k and method: its own ``num_speculative_tokens`` and ``speculative_method``, else the
   config's; k = 0 means plain decoding by request, so no proposer holds the sequence at all (and
   ``method: none`` means k = 0);
2. the draft token budget: each drafting sequence gets at most budget // (sequences drafting);
3. the engine's hard bounds, which it passes in: max_tokens, room in the cache, tokens in flight;
4. the k policy chooses within those caps, except for seeded rows: a seeded request keeps its cap,
   since its samples depend on the blocks and a timing-led choice would make the same seed give
   different text from run to run.
The policy's choice is a pure query; it learns once per real round, through ``on_round``.
"""

from __future__ import annotations

from collections.abc import Sequence

from serve_app.config import SpeculationMethod
from serve_app.engine.request import Request
from serve_app.speculation.policy import KPolicy, RoundCosts, Row
from serve_app.speculation.types import VerifyResult


class BlockSizer:
    def __init__(self, default_method: SpeculationMethod, default_k: int, draft_token_budget: int | None,
                 policy: KPolicy):
        self.default_method = default_method
        self.default_k = default_k
        self.draft_token_budget = draft_token_budget  # most draft tokens per round over the batch; None: no cap
        self.policy = policy

    def for_request(self, method: SpeculationMethod | None, k: int | None) -> tuple[SpeculationMethod, int]:
        """A request's method and k (its cap for every round) from what it asked for and the defaults."""
        method = method or self.default_method
        k = self.default_k if k is None else k
        if k == 0 or method == "none":  # plain decoding: no proposer holds it, so it costs no draft work
            return "none", 0
        return method, k

    def caps(self, requests: Sequence[Request], bounds: Sequence[int]) -> list[int]:
        """The most each request may draft this round: its k, the budget's share, ``bounds``."""
        drafting = sum(r.num_speculative_tokens > 0 for r in requests)
        share = self.draft_token_budget // drafting if self.draft_token_budget is not None and drafting else None
        return [max(0, min(r.num_speculative_tokens, bound, bound if share is None else share))
                for r, bound in zip(requests, bounds, strict=True)]

    def would_draft(self, requests: Sequence[Request], bounds: Sequence[int]) -> bool:
        """Whether the policy's own choice drafts for these requests (``KPolicy.would_draft``); a seeded
        request drafts its cap."""
        caps = self.caps(requests, bounds)
        seeded = any(c and r.params.sampling.seed is not None for r, c in zip(requests, caps, strict=True))
        return seeded or self.policy.would_draft(rows(requests, caps))

    def hand_over_pays(self, requests: Sequence[Request], bounds: Sequence[int], read: int) -> bool:
        """``KPolicy.hand_over_pays`` for these requests, over the tokens they may still generate; a seeded
        request drafts its cap, whatever it costs."""
        caps = self.caps(requests, bounds)
        if any(c and r.params.sampling.seed is not None for r, c in zip(requests, caps, strict=True)):
            return True
        batch = rows(requests, caps)
        return self.policy.hand_over_pays(batch, sum(r.remaining for r in batch), read)

    def explore_pays(self, requests: Sequence[Request], bounds: Sequence[int], read: int) -> bool:
        """``KPolicy.explore_pays`` for these requests."""
        return self.policy.explore_pays(rows(requests, self.caps(requests, bounds)), read)

    def choose(self, requests: Sequence[Request], bounds: Sequence[int], pipelined: bool = False) -> list[int]:
        """This round's k for each request, within ``bounds`` (the engine's hard bounds per request)."""
        caps = self.caps(requests, bounds)
        if not any(caps):
            return caps
        free = [i for i, r in enumerate(requests) if r.params.sampling.seed is None]
        chosen = self.policy.choose(rows([requests[i] for i in free], [caps[i] for i in free]),
                                    plain_overhead_hidden=pipelined)
        for i, k in zip(free, chosen, strict=True):
            caps[i] = k
        return caps

    def on_round(self, result: VerifyResult, costs: RoundCosts) -> None:
        """What a real round delivered and cost (the policy's only input)."""
        self.policy.observe(result)
        self.policy.record_costs(costs)

    def on_prefill(self, tokens: int, seconds: float) -> None:
        """A target forward that cached ``tokens`` prompt tokens (``KPolicy.record_prefill``)."""
        self.policy.record_prefill(tokens, seconds)

    def forget(self, seq_id: str) -> None:
        self.policy.forget(seq_id)


def rows(requests: Sequence[Request], caps: Sequence[int]) -> list[Row]:
    """What the policy sees of each request: its id, its cap this round, its proposer, what it may still generate."""
    return [Row(r.request_id, c, r.method, max(0, r.params.max_tokens - len(r.output_ids)))
            for r, c in zip(requests, caps, strict=True)]
