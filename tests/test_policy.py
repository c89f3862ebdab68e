"""The block-size policy on synthetic acceptance and cost sequences."""

from __future__ import annotations

import random

import pytest
import torch

from serve_app.speculation.policy import VERIFY_KNEE, BlockSizePolicy, LinearCost, RoundCosts, Row
from serve_app.speculation.types import VerifyResult


def test_linear_cost_learns_a_line_and_follows_a_change():
    cost = LinearCost(0.010, 0.0)
    for _ in range(200):
        for x in (1, 4, 16):
            cost.add(x, 0.02 + 0.003 * x)
    assert cost.a == pytest.approx(0.02, rel=0.05) and cost.b == pytest.approx(0.003, rel=0.05)
    for _ in range(400):  # the hardware got faster (or the batch shape changed): the fit follows
        for x in (1, 4, 16):
            cost.add(x, 0.01 + 0.001 * x)
    assert cost(8) == pytest.approx(0.018, rel=0.05)


def test_linear_cost_never_has_a_negative_slope():
    cost = LinearCost(0.01, 0.001)
    for x, t in ((1, 0.05), (16, 0.01)) * 50:
        cost.add(x, t)
    assert cost.b == 0.0


def test_linear_cost_from_bunched_samples_does_not_extrapolate_wildly():
    cost = LinearCost(0.002, 0.002)
    for s in (2, 3, 4) * 9:
        cost.add(s, 0.006 * s)
    assert cost(1) == pytest.approx(0.006, rel=0.1) and cost(8) == pytest.approx(0.048, rel=0.1)


def test_linear_cost_with_a_second_feature_learns_each_slope():
    """A draft call: a fixed cost, a forward a step, and each row past the first a share of a step."""
    cost = LinearCost(0.002, 0.002, 0.0)
    for _ in range(60):
        for steps, rows in ((1, 1), (3, 1), (4, 1), (2, 2), (4, 2)):
            cost.add((steps, steps * (rows - 1)), 0.02 + 0.035 * steps + 0.008 * steps * (rows - 1))
    assert cost(4, 12) == pytest.approx(0.02 + 0.035 * 4 + 0.008 * 12, rel=0.05)  # 4 rows, never seen


def test_the_draft_line_learns_what_rows_cost_and_prices_a_batch_it_never_drafted_for():
    """Served (the real pair, 0.5 B int8 draft on one core): a call of 4 steps took 0.16 s for one row,
    0.19 for two and 0.32 for four; the line knew steps only, and priced four rows at one row's 0.16 s, so
    a one-row probe at 4 streams made drafting for all four look like a gain (it was not)."""
    def draft(steps: int, rows: int) -> float:
        return 0.02 + steps * (0.027 + 0.0075 * rows)

    policy = BlockSizePolicy(max_k=4)
    for _ in range(40):
        for rows in (1, 2):
            policy.record_costs(RoundCosts(rows * 5, 0.15, {"draft": (4, draft(4, rows))}, 0.005, batch=rows,
                                           interval_s=0.35, draft_rows={"draft": rows}))
    one, four = ({"draft": 1}, {"draft": 4})
    called = policy.seconds(4, 20, {"draft": 4}, rows=four) - policy.seconds(4, 20, {"draft": 4}, rows=one)
    assert called == pytest.approx(draft(4, 4) - draft(4, 1), rel=0.15)


def simulate(policy: BlockSizePolicy, rows: list[Row], alpha: float, verify, draft, rounds: int,
             rng: random.Random) -> list[list[int]]:
    """Feed the policy rounds of a world where each draft is accepted with probability ``alpha``,
    verifying n tokens costs ``verify(n)`` and drafting s steps ``draft(s)``."""
    chosen = []
    for _ in range(rounds):
        ks = policy.choose(rows)
        chosen.append(ks)
        accepted = [0] * len(rows)
        for i, k in enumerate(ks):
            while accepted[i] < k and rng.random() < alpha:
                accepted[i] += 1
        policy.observe(VerifyResult(tuple(r.seq_id for r in rows), torch.tensor(ks), torch.tensor(accepted),
                                    torch.zeros((len(rows), max(ks) + 1), dtype=torch.long)))
        steps = max(ks)
        n = len(rows) + sum(ks)
        policy.record_costs(RoundCosts(n, verify(n), {"draft": (steps, draft(steps))} if steps else {}, None))
    return chosen


def cpu_verify(n: int) -> float:  # measured shape here: ~16 ms a step, ~1.2 ms a token more
    return 0.016 + 0.0012 * n


def test_drafts_the_full_block_when_acceptance_is_high_and_verifying_is_cheap():
    policy = BlockSizePolicy(max_k=4)
    rows = [Row("a", 4, "draft")]
    chosen = simulate(policy, rows, 0.9, cpu_verify, lambda s: 0.001 * s, 50, random.Random(0))
    assert all(ks == [4] for ks in chosen[-10:])


def test_drops_to_zero_when_verifying_cannot_pay_and_comes_back_when_it_can():
    rng = random.Random(1)
    policy = BlockSizePolicy(max_k=4)
    big = [Row(f"s{i}", 4, "draft") for i in range(16)]
    # A CPU-like target (a token more costs 1.5 ms over a 16 ms step), a draft step 2 ms, acceptance
    # 0.5: at a batch of 16 a verified draft costs more than the token it is worth, so plain wins.
    verify = lambda n: 0.016 + 0.0015 * n  # noqa: E731
    chosen = simulate(policy, big, 0.5, verify, lambda s: 0.002 * s, 80, rng)
    assert all(sum(ks) == 0 for ks in chosen[-20:])
    # Load falls to one sequence: the step's fixed cost dominates, speculation pays and comes back.
    chosen = simulate(policy, [Row("t", 4, "draft")], 0.5, verify, lambda s: 0.002 * s, 60, rng)
    assert all(ks[0] >= 1 for ks in chosen[-10:])


def test_drops_to_zero_when_acceptance_collapses():
    policy = BlockSizePolicy(max_k=4)
    rows = [Row("a", 4, "draft")]
    chosen = simulate(policy, rows, 0.05, cpu_verify, lambda s: 0.004 * s, 60, random.Random(2))
    assert all(ks == [0] for ks in chosen[-10:])


def test_a_slow_draft_shortens_blocks():
    fast = BlockSizePolicy(max_k=8)
    slow = BlockSizePolicy(max_k=8)
    rows = [Row("a", 8, "draft")]
    k_fast = simulate(fast, rows, 0.8, cpu_verify, lambda s: 0.0005 * s, 60, random.Random(3))[-1][0]
    k_slow = simulate(slow, rows, 0.8, cpu_verify, lambda s: 0.006 * s, 60, random.Random(3))[-1][0]
    assert k_fast > k_slow >= 1


def test_sequences_get_their_own_k_from_their_own_acceptance():
    policy = BlockSizePolicy(max_k=4)
    for _ in range(30):
        policy.record("good", 4, 4)
        policy.record("bad", 4, 0)
    for _ in range(100):
        policy.record_costs(RoundCosts(3, cpu_verify(3), {"draft": (4, 0.004)}, None))
        policy.record_costs(RoundCosts(9, cpu_verify(9), {"draft": (4, 0.004)}, None))
    good, bad = policy.choose([Row("good", 4, "draft"), Row("bad", 4, "draft")])
    assert good == 4 and bad == 0


def test_respects_each_rows_cap_and_a_free_proposer_drafts_more():
    policy = BlockSizePolicy(max_k=6, prior_alpha=0.7)
    ks = policy.choose([Row("a", 2, "draft"), Row("b", 0, "draft")])
    assert ks[0] <= 2 and ks[1] == 0
    for _ in range(50):
        policy.record_costs(RoundCosts(2, cpu_verify(2), {"ngram": (6, 0.00005), "draft": (6, 0.03)}, None))
        policy.record_costs(RoundCosts(7, cpu_verify(7), {"ngram": (1, 0.00005), "draft": (1, 0.005)}, None))
    by_lookup, by_model = policy.choose([Row("x", 6, "ngram")])[0], policy.choose([Row("y", 6, "draft")])[0]
    assert by_lookup > by_model


def test_pipelined_plain_rounds_make_plain_decoding_more_attractive():
    policy = BlockSizePolicy(max_k=4, prior_alpha=0.35)
    for _ in range(50):
        policy.record_costs(RoundCosts(2, cpu_verify(2), {"draft": (1, 0.004)}, 0.006))
        policy.record_costs(RoundCosts(5, cpu_verify(5), {"draft": (4, 0.010)}, 0.006))
    rows = [Row("a", 4, "draft")]
    assert sum(policy.choose(rows, plain_overhead_hidden=True)) <= sum(policy.choose(rows))


def test_plain_rounds_cost_what_they_take_from_result_to_result():
    """A plain round's call may take 15 ms while the replica's work around it makes rounds come 25 ms
    apart: the policy weighs speculation against the 25."""
    def learned(interval: float) -> int:
        policy = BlockSizePolicy(max_k=2, prior_alpha=0.4)
        for _ in range(30):
            policy.record_costs(RoundCosts(1, 0.015, {}, None, batch=1, interval_s=interval))
            policy.record_costs(RoundCosts(3, 0.020, {"draft": (2, 0.004)}, 0.002, batch=1))
        return sum(policy.choose([Row("a", 2, "draft")]))
    assert learned(0.015) == 0 and learned(0.025) > 0


def test_plain_rounds_teach_the_target_line_what_a_token_costs():
    """Served (the real pair at 16 streams on 2 cores): every drafting round had been at one stream,
    k = 4 (5 tokens verified), so the target's line knew one point and kept its prior slope; plain rounds
    of 16 sequences took 0.25 s, a call of 32 tokens 0.42 s. A plain round is a target call all the same:
    it teaches the line its slope, and drafting for 16 rows is not predicted to pay."""
    def verify(n: int) -> float:
        return 0.085 + 0.0105 * n

    policy = BlockSizePolicy(max_k=4)
    rows1, rows16 = [Row("a", 4, "draft")], [Row(f"s{i}", 4, "draft") for i in range(16)]
    rng = random.Random(0)
    for _ in range(60):  # each draft accepted with probability 0.8: 3.4 tokens a round at k = 4
        accepted = next(j for j in range(5) if j == 4 or rng.random() >= 0.8)
        policy.observe(VerifyResult(("a",), torch.tensor([4]), torch.tensor([accepted]), torch.full((1, 5), 7)))
        policy.record_costs(RoundCosts(5, verify(5), {"draft": (4, 0.170)}, 0.005, batch=1, interval_s=0.31))
    assert sum(policy.choose(rows1)) > 0
    for _ in range(30):
        policy.record_costs(RoundCosts(16, verify(16), {}, None, batch=16, interval_s=verify(16) + 0.005))
    assert policy.verify_s(32) == pytest.approx(verify(32), rel=0.1)
    assert sum(policy.choose(rows16)) == 0



def test_the_target_line_bends_where_a_forward_turns_compute_bound():
    """A forward's time is about flat while it streams the weights (a few tokens) and grows by each token's
    compute past that. Served (the real pair, after the kernel got faster at 8-20 rows): rounds of 1-5
    tokens mostly, a few of up to 20, and one straight line through them priced a verified block of 80
    tokens at about half what it took, so 16 streams drafted at 0.7x plain decoding. The line has a second
    slope past ``VERIFY_KNEE`` tokens, learned from the rounds there."""
    def forward(n: int) -> float:
        return 0.100 + 0.001 * min(n, VERIFY_KNEE) + 0.009 * max(n - VERIFY_KNEE, 0)

    policy, straight = BlockSizePolicy(max_k=4), LinearCost(0.015, 0.001)
    for n in [1] * 30 + [2] * 10 + [4] * 10 + [5] * 10 + [8, 12, 16, 20] * 2:  # tokens a forward, as served
        policy.record_costs(RoundCosts(n, forward(n), {}, None, batch=n))
        straight.add(n, forward(n))
    assert straight(80) < 0.75 * forward(80)
    assert policy.verify_s(80) == pytest.approx(forward(80), rel=0.1)
