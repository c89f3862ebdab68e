"""Each round's k decided in one place: request defaults and the k = 0 rule, the draft token budget,
the engine's hard bounds, the seeded-row rule and the policy's pure choice."""

from __future__ import annotations

import pickle

import torch

from serve_app.engine.block_sizer import BlockSizer
from serve_app.engine.request import GenerationParams, Request
from serve_app.engine.round_timer import RoundTimer
from serve_app.speculation.policy import BlockSizePolicy, FixedPolicy, RoundCosts, Row
from serve_app.speculation.realized import RealizedPolicy
from serve_app.speculation.types import SamplingParams, VerifyResult


def request(i: int, k: int, method: str = "draft", seed: int | None = None) -> Request:
    return Request(f"r{i}", [1, 2, 3], GenerationParams(sampling=SamplingParams(seed=seed)), method, k)


def test_a_requests_k_and_method_come_from_it_then_the_defaults_and_k_0_means_plain():
    sizer = BlockSizer("draft", 4, None, FixedPolicy())
    assert sizer.for_request(None, None) == ("draft", 4)
    assert sizer.for_request("ngram", 2) == ("ngram", 2)
    assert sizer.for_request(None, 0) == ("none", 0)  # no proposer holds it
    assert sizer.for_request("none", 3) == ("none", 0)


def test_the_budget_and_the_engines_bounds_cap_every_row():
    sizer = BlockSizer("draft", 4, 6, FixedPolicy())
    reqs = [request(0, 4), request(1, 4), request(2, 0, "none")]
    assert sizer.choose(reqs, [16, 1, 16]) == [3, 1, 0]  # 6 // 2 drafting, then the bound, a plain row 0
    assert BlockSizer("draft", 4, None, FixedPolicy()).choose(reqs, [16, 2, 16]) == [4, 2, 0]


class Never:
    """A policy that would choose plain decoding for every row it may choose for."""

    def choose(self, rows, plain_overhead_hidden=False):
        return [0] * len(rows)


def test_a_seeded_row_keeps_its_cap_the_others_get_the_policys_choice():
    sizer = BlockSizer("draft", 3, None, FixedPolicy())
    sizer.policy = Never()
    assert sizer.choose([request(0, 3), request(1, 3, seed=7)], [16, 16]) == [0, 3]


def seasoned_policy() -> RealizedPolicy:
    """The default policy after rounds at batch 1 in which speculation realized less than plain decoding."""
    policy = RealizedPolicy(BlockSizePolicy(max_k=2, prior_alpha=0.9, verify_cost=(0.015, 0.0001),
                                            draft_cost=(0.0005, 0.0001)))
    for i in range(24):
        spec = i % 2 == 0
        policy.record_costs(RoundCosts(3 if spec else 1, 0.015, {"draft": (2, 0.001)} if spec else {}, None, batch=1,
                                       interval_s=0.05, gained=3 if spec else 1, k=2 if spec else 0))
    return policy


def test_the_policys_choice_has_no_side_effect():
    policy = seasoned_policy()
    rows = [Row("a", 2, "draft")]
    before = pickle.dumps(policy)
    first = policy.choose(rows)
    assert pickle.dumps(policy) == before  # choosing changed nothing
    assert [policy.choose(rows) for _ in range(5)] == [first] * 5
    sizer = BlockSizer("draft", 2, None, policy)
    sizer.choose([request(0, 2)], [16])
    assert pickle.dumps(policy) == before


def test_the_policys_clock_advances_once_per_real_round():
    policy = seasoned_policy()
    held = policy.realized.buckets[1].rounds
    sizer = BlockSizer("draft", 2, None, policy)
    result = VerifyResult(("a",), torch.tensor([2]), torch.tensor([1]), torch.tensor([[5, 6, -1]]))
    for _ in range(3):
        sizer.choose([request(0, 2)], [16])
        sizer.choose([request(0, 2)], [16])  # asked twice in a round (pipelined plain rounds do)
        sizer.on_round(result, RoundCosts(3, 0.015, {}, None, batch=1, interval_s=0.05, gained=2))
    assert policy.realized.buckets[1].rounds == held + 3


def test_the_round_timer_measures_result_to_result_and_never_across_an_admission():
    timer = RoundTimer()
    result = VerifyResult(("a", "b"), torch.tensor([2, 0]), torch.tensor([1, 0]),
                          torch.tensor([[5, 6, -1], [7, -1, -1]]))
    timer.drafted("draft", [2, 0], 0.004)
    _, first = timer.finish(result, 0.0, 0.0, None, admitted=False)
    assert (first.tokens, first.batch, first.gained, first.interval_s) == (4, 2, 3, None)
    assert first.draft_s == {"draft": (2, 0.004)} and first.draft_rows == {"draft": 1}
    _, second = timer.finish(result, 0.0, 0.0, timer.overhead(), admitted=False)
    assert second.interval_s is not None and second.interval_s >= 0 and second.draft_s == {}
    _, third = timer.finish(result, 0.0, 0.0, None, admitted=True)
    assert third.interval_s is None


def test_a_round_whose_draft_read_first_is_timed_as_a_catch_up_and_a_hand_over_is_not_a_rounds_interval():
    timer = RoundTimer()
    result = VerifyResult(("a", "b"), torch.tensor([2, 2]), torch.tensor([1, 0]),
                          torch.tensor([[5, 6, -1], [7, -1, -1]]))
    timer.finish(result, 0.0, 0.0, None, admitted=False)
    timer.drafted("draft", [2, 2], None)  # caught up first: its seconds are not a draft step's
    _, probe = timer.finish(result, 0.0, 0.0, None, admitted=False, read=40)
    assert probe.draft_s == {} and probe.draft_rows == {"draft": 2}
    assert probe.catch_up is not None and probe.catch_up[0] == 40 and probe.catch_up[1] == probe.interval_s
    _, handed = timer.finish(result, 0.0, 0.0, None, admitted=False, read=300, handed_over=True)
    assert handed.interval_s is None and handed.catch_up is not None and handed.catch_up[0] == 300
    _, beside = timer.finish(result, 0.0, 0.0, None, admitted=True, read=300, handed_over=True)
    assert beside.catch_up is None  # beside the target's prefill: not what catching up costs
