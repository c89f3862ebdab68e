"""The default k policy on synthetic rounds with a deterministic clock: what it converges to when the
cost model is wrong either way, how it leaves and resumes speculation, what its exploration costs."""

from __future__ import annotations

import pickle
import random
from collections import Counter, deque
from collections.abc import Callable

import pytest
import torch

from serve_app.config import SpeculationConfig
from serve_app.speculation.arms import bucket
from serve_app.speculation.policy import BlockSizePolicy, FixedPolicy, RoundCosts, Row
from serve_app.speculation.realized import EXPLORE_EVERY, EXPLORE_SHARE, MEASURE_SHARE, RealizedPolicy, policy_for
from serve_app.speculation.types import VerifyResult

MAX_K = 4


def true_seconds(hop: float, step: float) -> Callable[[int, int], float]:
    """A round of ``batch`` rows at arm k as served: the target (20 ms + 1 ms a token), the engine
    (3 ms), and for a speculative round a draft call (``hop`` + ``step`` a draft step)."""
    return lambda batch, k: 0.023 + 0.001 * batch * (1 + k) + (hop + step * k if k else 0.0)


def expected_rate(batch: int, k: int, alpha: float, seconds: Callable[[int, int], float]) -> float:
    return batch * (1 + sum(alpha ** j for j in range(1, k + 1))) / seconds(batch, k)


def best_rate(batch: int, alpha: float, seconds: Callable[[int, int], float]) -> float:
    return max(expected_rate(batch, k, alpha, seconds) for k in range(MAX_K + 1))


class Switches:
    """What a round costs on top of its pace where it changes between plain decoding and drafting (served at
    one stream on the embedded model: a drafting round after a plain one took 65 ms where drafting rounds
    after drafting ones took 53, a plain round after a drafting one 47 where plain ones after plain ones
    took 38: the draft catching up, the pipeline refilling). Rounds one after another share it, across requests."""

    def __init__(self, into_plain: float, into_drafting: float):
        self.cost = (into_plain, into_drafting)
        self.last: bool | None = None  # whether the last round drafted

    def __call__(self, k: int) -> float:
        drafting, last = k > 0, self.last
        self.last = drafting
        return 0.0 if last is None or last == drafting else self.cost[drafting]


def play(policy, rounds: int, batch: int, alpha: Callable[[int], float], seconds: Callable[[int, int], float],
         seen_step: float, seed: int = 0, ahead: int = 0,
         verify: Callable[[int], float] = lambda tokens: 0.020 + 0.001 * tokens,
         switches: Switches | None = None) -> list[tuple[int, int, float]]:
    """Serve ``rounds`` rounds; the components the policy's model sees say a draft step costs
    ``seen_step`` and a target call of n tokens ``verify(n)``, and hide the hop. Returns (arm, tokens
    gained, seconds) per round. ``ahead``: plain rounds sent ahead as the engine does (``engine.pipeline``):
    after each round, up to ``ahead`` plain rounds are queued while the policy's choice drafts nothing, and
    are played before it is asked again. ``switches``: what changing between plain decoding and drafting adds."""
    rng = random.Random(seed)
    ids = tuple(f"s{i}" for i in range(batch))
    rows = [Row(s, MAX_K, "draft") for s in ids]
    out = []
    in_flight: deque[list[int]] = deque()
    for t in range(rounds):
        ks = in_flight.popleft() if in_flight else policy.choose(rows)
        accepted = []
        for k in ks:
            n = 0
            while n < k and rng.random() < alpha(t):
                n += 1
            accepted.append(n)
        arm = max(ks)
        tokens = torch.full((batch, arm + 1), -1)
        for i, n in enumerate(accepted):
            tokens[i, : n + 1] = 7
        policy.observe(VerifyResult(ids, torch.tensor(ks), torch.tensor(accepted), tokens))
        real = seconds(batch, arm) + (switches(arm) if switches else 0.0)
        gained = batch + sum(accepted)
        drafts = {"draft": (arm, 0.001 + seen_step * arm)} if arm else {}
        policy.record_costs(RoundCosts(batch + sum(ks), verify(batch + sum(ks)), drafts, 0.003, batch,
                                       real, gained, arm))
        out.append((arm, gained, real))
        while len(in_flight) < ahead and not any(policy.choose(rows)):
            in_flight.append([0] * batch)
    return out


def realized_rate(rounds: list[tuple[int, int, float]]) -> float:
    return sum(g for _, g, _ in rounds) / sum(s for _, _, s in rounds)


def fresh() -> RealizedPolicy:
    return RealizedPolicy(BlockSizePolicy(MAX_K))


def test_the_default_policy_is_the_realized_one_and_the_others_stay_choosable():
    assert isinstance(policy_for(SpeculationConfig(draft="d")), RealizedPolicy)
    assert type(policy_for(SpeculationConfig(draft="d", k_policy="cost_model"))) is BlockSizePolicy
    assert isinstance(policy_for(SpeculationConfig(draft="d", k_policy="fixed")), FixedPolicy)


def test_batches_share_buckets_by_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_it_converges_to_the_best_k_when_the_cost_model_thinks_drafting_too_dear():
    """The model's draft line says 30 ms a step (it would decode plainly); drafting really costs 6."""
    seconds = true_seconds(hop=0.002, step=0.006)
    alpha = 0.8
    model_alone = BlockSizePolicy(MAX_K)
    play(model_alone, 100, 1, lambda t: alpha, seconds, seen_step=0.030)
    assert model_alone.choose([Row("s0", MAX_K, "draft")]) == [0]  # the model alone would not draft
    rounds = play(fresh(), 600, 1, lambda t: alpha, seconds, seen_step=0.030)
    tail = rounds[-300:]
    assert realized_rate(tail) >= 0.97 * best_rate(1, alpha, seconds)
    assert Counter(a for a, _, _ in tail).most_common(1)[0][0] >= 2


def test_it_converges_to_plain_decoding_when_the_cost_model_thinks_drafting_cheap():
    """The model sees 6 ms draft steps, not the 40 ms hop of each draft call: drafting never pays."""
    seconds = true_seconds(hop=0.040, step=0.006)
    alpha = 0.8
    assert max(range(MAX_K + 1), key=lambda k: expected_rate(1, k, alpha, seconds)) == 0
    model_alone = BlockSizePolicy(MAX_K)
    play(model_alone, 100, 1, lambda t: alpha, seconds, seen_step=0.006)
    assert model_alone.choose([Row("s0", MAX_K, "draft")]) != [0]  # the model alone would draft
    rounds = play(fresh(), 600, 1, lambda t: alpha, seconds, seen_step=0.006)
    tail = rounds[-300:]
    assert realized_rate(tail) >= 0.97 * best_rate(1, alpha, seconds)
    assert sum(a == 0 for a, _, _ in tail) >= 0.85 * len(tail)


@pytest.mark.parametrize("ahead", [0, 2])
def test_under_load_it_finds_plain_decoding_and_explores_at_most_one_round_in_eight(ahead):
    """Batch 16 on a CPU: every draft token costs a verify slot for 16 rows. It still probes now and
    then, with plain rounds sent ahead too."""
    seconds = lambda batch, k: 0.020 + 0.004 * batch * (1 + k) + (0.010 + 0.006 * k if k else 0.0)  # noqa: E731
    alpha = 0.6
    rounds = play(fresh(), 400, 16, lambda t: alpha, seconds, seen_step=0.006, ahead=ahead)
    tail = rounds[-300:]
    assert realized_rate(tail) >= 0.97 * best_rate(16, alpha, seconds)
    assert 1 <= sum(a != 0 for a, _, _ in tail) <= len(tail) / EXPLORE_EVERY


@pytest.mark.parametrize("ahead", [0, 2])
@pytest.mark.parametrize("batch", [4, 16])
def test_where_drafting_loses_by_far_its_probes_cost_at_most_the_exploration_share(batch, ahead):
    """The real pair at 4 and 16 streams on 2 cores (issue 26): a call of the 0.5 B draft costs about
    half a plain round of the 1.5 B target before its first step, and each draft token a verify slot,
    so a probe of k = 1 takes about two plain rounds' time for little gain. Probes there were one round
    in 30-40; what they lose (their seconds beyond what the best arm would have gained in them) stays
    within ``EXPLORE_SHARE`` of the time, and there are still some."""
    seconds = lambda b, k: 0.090 + 0.011 * b * (1 + k) + (0.066 + 0.045 * k if k else 0.0)  # noqa: E731
    alpha = 0.6
    assert max(range(MAX_K + 1), key=lambda k: expected_rate(batch, k, alpha, seconds)) == 0
    rounds = play(fresh(), 1500, batch, lambda t: alpha, seconds, seen_step=0.045, ahead=ahead)
    tail = rounds[300:]
    best = best_rate(batch, alpha, seconds)
    lost = sum(s - g / best for a, g, s in tail if a)
    assert 1 <= sum(a > 0 for a, _, _ in tail)
    assert lost <= 1.2 * EXPLORE_SHARE * sum(s for _, _, s in tail)


@pytest.mark.parametrize("ahead", [0, 2])
def test_a_batch_size_never_drafted_at_is_tried_soon_however_dear_the_model_thinks_drafting(ahead):
    """Served (the pair at 4 streams after requests that asked for plain decoding): the model's lines,
    learned where a draft step looked dear, put every drafting arm far below plain decoding at a batch
    size where no round drafted yet. A prediction no round there has tested is not worth the patience
    ``EXPLORE_SHARE`` buys: drafting is tried within a few rounds, and kept where it pays."""
    seconds = true_seconds(hop=0.002, step=0.006)
    policy = fresh()
    play(policy, 100, 1, lambda t: 0.8, seconds, seen_step=0.060)  # the model's draft line: 60 ms a step
    ids = tuple(f"p{i}" for i in range(4))
    for _ in range(200):  # plain decoding by request at batch 4: measured, nothing drafted there
        policy.observe(VerifyResult(ids, torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                                    torch.full((4, 1), 7)))
        policy.record_costs(RoundCosts(4, 0.024, {}, 0.003, 4, seconds(4, 0), 4, 0))
    for s in ids:
        policy.forget(s)
    assert policy.leader([Row(f"s{i}", MAX_K, "draft") for i in range(4)]) == 0  # the model: plain leads
    rounds = play(policy, 300, 4, lambda t: 0.9, seconds, seen_step=0.060, ahead=ahead)
    assert any(a for a, _, _ in rounds[:3 * EXPLORE_EVERY])
    assert realized_rate(rounds[-100:]) >= 0.95 * best_rate(4, 0.9, seconds)


@pytest.mark.parametrize("ahead", [0, 2])
def test_it_leaves_speculation_when_acceptance_collapses_and_returns_when_it_recovers(ahead):
    """Also with plain rounds sent ahead (``ahead``): a probe that falls due while plain rounds are in
    flight is still played, once they are (before, the pipeline swallowed every probe at one stream,
    and speculation never came back). Each run's choices are checked; the rates, against the best arm's
    expected rate, over four runs together: 300 rounds of one run draw acceptance by chance (over 40
    seeds, about one run in ten realized under 0.95 of the expected rate, whatever the policy)."""
    seconds = true_seconds(hop=0.002, step=0.006)
    alpha = lambda t: 0.0 if 300 <= t < 700 else 0.85  # noqa: E731
    collapsed, recovered = [], []
    for seed in range(4):
        rounds = play(fresh(), 1200, 1, alpha, seconds, seen_step=0.006, ahead=ahead, seed=seed)
        before = rounds[200:300]
        collapsed += rounds[350:700]
        recovered += rounds[900:]
        assert sum(a > 0 for a, _, _ in before) >= 0.9 * len(before)
        assert sum(a > 0 for a, _, _ in rounds[350:700]) <= 0.1 * 350
        assert sum(a > 0 for a, _, _ in rounds[900:]) >= 0.9 * 300
    assert realized_rate(collapsed) >= 0.95 * best_rate(1, 0.0, seconds)
    assert realized_rate(recovered) >= 0.95 * best_rate(1, 0.85, seconds)


@pytest.mark.parametrize("ahead", [0, 2])
def test_a_switch_between_plain_decoding_and_drafting_is_not_taken_for_the_pace_of_either(ahead):
    """Served at one stream on the embedded model (issue 26): a drafting round after plain ones took 65 ms
    where one after drafting ones took 53, and a plain round after a drafting one 47 where one after plain
    ones took 38 (the draft catching up, the pipeline refilled). While plain decoding led, every drafting
    round was such a switch, and so was every probe of plain decoding while drafting led: each arm was
    measured at its dearest while the other led, and whichever led kept the lead (requests a fixed k = 4
    decoded 1.3x faster left to plain decoding for 60-90 of their 93 rounds). Here a switch costs half a
    plain round into drafting and a quarter into plain decoding, and drafting gains a fifth: after the
    draft's acceptance collapsed and recovered, the default drafts again, and a switch's second round
    measures the arm."""
    seconds = lambda batch, k: 0.040 if k == 0 else 0.044 + 0.001 * k  # noqa: E731
    alpha = lambda t: 0.0 if 300 <= t < 600 else 0.3  # noqa: E731
    best = best_rate(1, 0.3, seconds)
    assert best >= 1.2 / seconds(1, 0)
    rounds = play(fresh(), 1400, 1, alpha, seconds, seen_step=0.001, ahead=ahead,
                  switches=Switches(into_plain=0.010, into_drafting=0.020))
    collapsed = rounds[350:600]  # before: 6 plain rounds of 250, 0.87x plain decoding's rate
    assert sum(a == 0 for a, _, _ in collapsed) >= 0.75 * len(collapsed)
    assert realized_rate(collapsed) >= 0.95 / seconds(1, 0)
    recovered = rounds[900:]
    assert sum(a > 0 for a, _, _ in recovered) >= 0.9 * len(recovered)
    assert realized_rate(recovered) >= 0.95 * best


@pytest.mark.parametrize("ahead", [0, 2])
@pytest.mark.parametrize("plain_before", [0, 300])
def test_a_rejected_first_block_and_a_rejected_probe_do_not_stop_speculation_for_dozens_of_rounds(
        ahead, plain_before):
    """Served at one stream (issue 26): a fresh replica's first block and the probe after it were both
    rejected (the start of an answer is the hardest to guess), and then plain decoding led for 30-60
    rounds, though each later block was mostly accepted: the drafts' acceptance against the model's
    was a ratio of one or two rounds' counts, 0. Here a plain round is nearly as dear as a drafting one
    (the target's call about flat at few tokens, the draft cheap), as on the embedded model. Also after
    ``plain_before`` rounds of requests that asked for plain decoding (``num_speculative_tokens: 0``)."""
    seconds = lambda batch, k: 0.038 + 0.001 * batch * (1 + k) + (0.003 + 0.001 * k if k else 0.0)  # noqa: E731
    alpha = lambda t: 0.0 if t < 12 else 0.85  # noqa: E731
    policy = fresh()
    for _ in range(plain_before):
        policy.observe(VerifyResult(("p",), torch.tensor([0]), torch.tensor([0]), torch.full((1, 1), 7)))
        policy.record_costs(RoundCosts(1, 0.021, {}, 0.003, 1, seconds(1, 0), 1, 0))
    policy.forget("p")
    rounds = play(policy, 72, 1, alpha, seconds, seen_step=0.001, ahead=ahead)
    # it drafts from its first rounds (a fresh one after one plain round, the bar), and the target rejects all of it
    assert rounds[1 if plain_before == 0 else 0][0] > 0 and next(g for a, g, _ in rounds if a) == 1
    after = rounds[12:]
    assert sum(a == 0 for a, _, _ in after) <= 0.1 * len(after)
    assert realized_rate(after) >= 0.9 * best_rate(1, 0.85, seconds)


def test_where_drafting_gains_a_little_an_unlucky_stretch_does_not_leave_plain_decoding_in_the_lead():
    """Served at one stream on the embedded model (issue 26): a drafting round about 1.5x a plain one,
    drafting about 1.1x plain decoding; the default played plain decoding in 55-70 % of its rounds where
    a fixed k = 4 won. The drafts accepted against the model's expectation, a ratio of decayed sums, had
    dropped to 0.2-0.6 after rejected blocks and stayed there: plain rounds decayed both sums alike and
    nothing drafted to correct them, though the model was right within 2 %. Here requests one after
    another at a constant acceptance (the model right): the ratio must stay near 1 and the rate near
    the best arm's. Before the fix: the ratio 0.21-0.56 and 0.94x the best arm's rate (plain decoding
    0.92x); after it 0.75-1.06 and 0.96x (what is left: each sequence's own acceptance, a handful of
    blocks, flips the lead when drafting gains this little)."""
    seconds = lambda batch, k: 0.0228 if k == 0 else 0.0325 + 0.0005 * k  # noqa: E731
    alpha = 0.4
    assert expected_rate(1, 0, alpha, seconds) < 0.92 * best_rate(1, alpha, seconds)
    tails = []
    for seed in range(6):
        policy = fresh()
        requests = [serve_one(policy, f"q{i}", 96, alpha, seconds, seed=100 * seed + i) for i in range(40)]
        assert policy.realized.buckets[1].acceptance() >= 0.7
        tails += [r for rounds in requests[10:] for r in rounds]
    assert realized_rate(tails) >= 0.95 * best_rate(1, alpha, seconds)


def test_one_slow_round_of_an_arm_does_not_keep_it_from_being_played():
    """At one stream (issue 26, the embedded model's replica in process): the only round of k = 4 in
    a while had taken 47 ms (beside a stall), where its rounds took 27-30; an arm's mean seconds do not
    fade with its weight, so k = 4 stayed predicted at that round's pace, 0.7x the leader's rate, and was
    not retried for hundreds of rounds (a fixed k = 4 decoded 1.07x the default over six requests). A
    rarely played arm's own rounds count for what their weight is worth beside its nearest drafting
    neighbour's, which the model's lines carry over to it."""
    seconds = true_seconds(hop=0.008, step=0.002)
    alpha = 0.9
    assert max(range(MAX_K + 1), key=lambda k: expected_rate(1, k, alpha, seconds)) == MAX_K
    policy = fresh()
    play(policy, 1, 1, lambda t: alpha, seconds, seen_step=0.002)  # plain decoding first: the bar
    policy.observe(VerifyResult(("s0",), torch.tensor([MAX_K]), torch.tensor([MAX_K]), torch.full((1, MAX_K + 1), 7)))
    policy.record_costs(RoundCosts(1 + MAX_K, 0.020 + 0.001 * (1 + MAX_K), {"draft": (MAX_K, 0.001 + 0.002 * MAX_K)},
                                   0.003, 1, 3 * seconds(1, MAX_K), 1 + MAX_K, MAX_K))  # k = 4 once, 3x its pace
    rounds = play(policy, 400, 1, lambda t: alpha, seconds, seen_step=0.002)
    tail = rounds[-300:]
    assert Counter(a for a, _, _ in tail).most_common(1)[0][0] == MAX_K
    assert realized_rate(tail) >= 0.97 * best_rate(1, alpha, seconds)


def serve_one(policy, seq_id: str, tokens: int, alpha: float, seconds: Callable[[int, int], float], seed: int = 0,
              rounds: int | None = None, switches: Switches | None = None) -> list[tuple[int, int, float]]:
    """One request of ``tokens`` tokens alone (one stream), as the engine asks: its row's cap within what
    it may still generate; the draft step's seconds seen as they are; aborted after ``rounds`` rounds if
    given; ``switches``: what changing between plain decoding and drafting adds. Returns (arm, gained, seconds)."""
    rng = random.Random(seed)
    out: list[tuple[int, int, float]] = []
    made = 0
    while made < tokens and (rounds is None or len(out) < rounds):
        remaining = tokens - made
        (k,) = policy.choose([Row(seq_id, min(MAX_K, remaining - 1), "draft", remaining)])
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        policy.observe(VerifyResult((seq_id,), torch.tensor([k]), torch.tensor([n]),
                                    torch.tensor([[7] * (n + 1) + [-1] * (k - n)])))
        took = seconds(1, k) + (switches(k) if switches else 0.0)
        policy.record_costs(RoundCosts(1 + k, 0.020 + 0.001 * (1 + k), {"draft": (k, 0.002 * k)} if k else {},
                                       0.003, 1, took, 1 + n, k))
        out.append((k, 1 + n, took))
        made += 1 + n
    policy.forget(seq_id)
    return out


def test_at_one_stream_each_new_request_is_measured_in_its_first_rounds_where_plain_decoding_leads():
    """At one stream (issue 26, the embedded model's replica in process): requests follow one another, and how well the
    draft guesses differs from one to the next far more than within one (a fixed k = 4 took 43 to 64
    rounds for 96 tokens, request by request). After requests the draft guessed badly, plain decoding led
    the bucket, every later request was left to it from its admission, and one the draft would have
    guessed well never drafted: 0.85x a fixed k = 4 over six requests. A request alone whose own
    acceptance no round has measured is worth its first drafting rounds: where the draft guesses it well
    it drafts on; where not, those rounds cost at most ``MEASURE_SHARE`` of its time."""
    # a hop of 10 ms: at 8, plain decoding and k = 3 were predicted within 0.1 % for a fresh sequence here
    seconds = true_seconds(hop=0.010, step=0.002)
    assert max(range(MAX_K + 1), key=lambda k: expected_rate(1, k, 0.1, seconds)) == 0
    policy = fresh()
    for i in range(3):
        serve_one(policy, f"bad{i}", 96, 0.1, seconds, seed=i)
    new = [Row("good", MAX_K, "draft", 96)]
    assert policy.leader(new) == 0  # the bucket's leader: plain decoding
    assert policy.would_draft(new)  # but the draft takes it (its prefill is worth its measurement)
    assert not policy.would_draft([Row("good", MAX_K, "draft")])  # how long it runs unknown: no budget
    acceptance = policy.realized.buckets[1].acceptance()
    measured = serve_one(policy, "bad3", 96, 0.0, seconds, rounds=2)  # measuring it, every draft rejected
    assert [k > 0 for k, _, _ in measured] == [True, True]
    assert policy.realized.buckets[1].acceptance() == pytest.approx(acceptance, rel=0.1)  # they count as expected
    bad = serve_one(policy, "bad4", 96, 0.1, seconds, seed=8)
    assert all(k > 0 for k, _, _ in bad[:2])
    plain = 1 / seconds(1, 0)
    lost = sum(s - g / plain for k, g, s in bad if k)  # measured, then plain decoding and the bucket's probes
    assert lost <= (1.2 * MEASURE_SHARE + EXPLORE_SHARE) * sum(s for _, _, s in bad)
    good = serve_one(policy, "good", 96, 0.85, seconds, seed=7)
    assert all(k > 0 for k, _, _ in good[:2])
    assert sum(k > 0 for k, _, _ in good) >= 0.8 * len(good)
    assert realized_rate(good) >= 0.9 * best_rate(1, 0.85, seconds)
    assert not policy.would_draft([Row(f"s{i}", MAX_K, "draft", 96) for i in range(4)])  # one stream only


def test_its_choice_has_no_side_effect_and_its_clock_advances_once_a_round():
    policy = fresh()
    seconds = true_seconds(hop=0.002, step=0.006)
    play(policy, 2 * EXPLORE_EVERY + 3, 1, lambda t: 0.8, seconds, seen_step=0.006)
    rows = [Row("s0", MAX_K, "draft")]
    before = pickle.dumps(policy)
    first = policy.choose(rows)
    assert [policy.choose(rows) for _ in range(5)] == [first] * 5
    assert pickle.dumps(policy) == before
    clock = policy.realized.buckets[1].rounds
    play(policy, 3, 1, lambda t: 0.8, seconds, seen_step=0.006)
    assert policy.realized.buckets[1].rounds == clock + 3


def test_each_row_keeps_its_cap_and_the_snapshot_reports_the_choice_and_realized_rates():
    policy = fresh()
    seconds = true_seconds(hop=0.002, step=0.006)
    play(policy, 60, 1, lambda t: 0.8, seconds, seen_step=0.006)
    assert policy.leader([Row("a", MAX_K, "draft")]) > 0  # (its choice now may be a probe of plain decoding)
    assert policy.choose([Row("a", MAX_K, "draft"), Row("b", 1, "draft")]) [1] <= 1
    realized = policy.snapshot()["realized"]["1"]
    assert realized["k"] in range(MAX_K + 1)
    rate = realized["tokens_per_second"][realized["k"]]
    assert rate is not None and 0.5 * best_rate(1, 0.8, seconds) < rate < 1.5 * best_rate(1, 0.8, seconds)


def test_it_would_draft_for_a_sequence_alone_until_measured_and_then_as_its_own_choice_says():
    """``would_draft`` (a draft's prefill worth it?): before any drafting round at a batch, yes for one
    sequence, no for a batch; once measured, its leader there; never one of its probes."""
    under_load = lambda batch, k: 0.020 + 0.004 * batch * (1 + k) + (0.010 + 0.006 * k if k else 0.0)  # noqa: E731
    rows = lambda n: [Row(f"s{i}", MAX_K, "draft") for i in range(n)]  # noqa: E731
    policy = fresh()
    assert policy.would_draft(rows(1)) and not policy.would_draft(rows(4)) and not policy.would_draft(rows(16))
    assert not policy.would_draft([Row("s0", 0, "draft")])  # nothing may draft
    play(policy, 400, 4, lambda t: 0.6, under_load, seen_step=0.006)
    assert not policy.would_draft(rows(4))  # measured at 4: plain decoding leads
    probes = [policy.would_draft(rows(4)) for _ in range(EXPLORE_EVERY)]
    before = pickle.dumps(policy)
    assert not any(probes) and pickle.dumps(policy) == before
    cheap = lambda batch, k: 0.050 + 0.0005 * batch * (1 + k) + (0.002 + 0.002 * k if k else 0.0)  # noqa: E731
    play(policy, 300, 4, lambda t: 0.9, cheap, seen_step=0.002)
    assert policy.would_draft(rows(4))  # drafting leads at 4 once it pays there


def test_at_a_batch_size_never_drafted_at_it_would_draft_where_lines_fitted_that_wide_say_drafting_pays():
    """Requests sent together meet a batch size where no round drafted yet. Its model's guess there is
    trusted once its lines were fitted to the calls such a round makes: the draft's, and target forwards
    of at least as many tokens as the round would verify (a prompt's prefill is one: ``record_prefill``).
    Then ``would_draft`` follows the model's leader there (served on the real pair: drafting at 4 streams
    decodes at 1.5x plain decoding, at 16 the 2 cores are compute-bound and plain decoding leads); before,
    a batch is not worth a draft's prefill (the model's lines extrapolated, as in
    ``test_at_a_batch_size_new_to_it_plain_decoding_is_measured_first``)."""
    rows = lambda n: [Row(f"s{i}", MAX_K, "draft") for i in range(n)]  # noqa: E731
    target = lambda tokens: 0.100 + 0.001 * tokens + 0.007 * max(tokens - 8, 0)  # noqa: E731 - compute-bound past 8
    step = 0.030
    policy = fresh()
    play(policy, 40, 1, lambda t: 0.8, lambda batch, k: target(batch * (1 + k)) + 0.003 + (step * k if k else 0.0),
         seen_step=step, verify=target)
    assert policy.would_draft(rows(1)) and not policy.would_draft(rows(4))  # no forward of 12 tokens seen
    policy.record_prefill(150, target(150))
    assert policy.would_draft(rows(4)) and not policy.would_draft(rows(16))
    assert policy.leader(rows(4)) > 0 and policy.leader(rows(16)) == 0
    before = pickle.dumps(policy)
    assert policy.would_draft(rows(4)) and pickle.dumps(policy) == before  # a query
    fixed = FixedPolicy()
    fixed.record_prefill(150, 1.0)
    assert fixed.would_draft(rows(4))  # every row drafts its cap


def one_round(policy: RealizedPolicy, batch: int, k: int, seconds: float) -> None:
    """A round of ``batch`` rows at arm k, every draft accepted, ``seconds`` result to result."""
    ids = tuple(f"s{i}" for i in range(batch))
    policy.observe(VerifyResult(ids, torch.full((batch,), k), torch.full((batch,), k), torch.full((batch, k + 1), 7)))
    tokens = batch * (1 + k)
    policy.record_costs(RoundCosts(tokens, seconds * 0.9, {"draft": (k, 0.002 * k)} if k else {}, 0.0, batch,
                                   seconds, tokens, k))


def test_a_batch_size_never_drafted_at_is_worth_a_hand_over_once_its_cost_is_a_small_share_of_the_time_there():
    """``explore_pays``: no drafting round measured at these rows' batch size, and the draft's reading of the
    handed-over sequence (the model's catch-up line) within ``EXPLORE_SHARE`` of the time rounds there took
    (``engine.deferral`` then gives the draft one sequence, so a probe can measure drafting there)."""
    rows = lambda n, cap=MAX_K: [Row(f"s{i}", cap, "draft") for i in range(n)]  # noqa: E731
    policy = fresh()
    assert not policy.explore_pays(rows(4), read=100)  # no time at 4 yet
    read_s = policy.model.catch_up(100)
    plain_s = 0.05
    needed = read_s / EXPLORE_SHARE / plain_s  # plain rounds at 4 before a hand-over of 100 tokens pays
    for _ in range(int(needed * 0.9)):
        one_round(policy, 4, 0, plain_s)
    assert not policy.explore_pays(rows(4), read=100) and policy.explore_pays(rows(4), read=50)
    for _ in range(int(needed * 0.2)):
        one_round(policy, 4, 0, plain_s)
    assert policy.explore_pays(rows(4), read=100) and policy.explore_pays(rows(3), read=100)  # the same bucket
    assert not policy.explore_pays(rows(4, cap=0), read=100)  # nothing may draft
    assert not policy.explore_pays(rows(8), read=1)  # no time at 8
    assert not FixedPolicy().explore_pays(rows(4), 1) and not BlockSizePolicy(MAX_K).explore_pays(rows(4), 1)
    one_round(policy, 4, 2, 0.08)  # drafting measured at 4: nothing left to explore there
    assert not policy.explore_pays(rows(4), read=1)


def test_a_hand_over_is_played_only_when_drafting_is_predicted_to_gain_more_than_the_catch_up_costs():
    """Handing held sequences to a draft makes it read their whole contexts first (the real pair at 4
    streams: 1.9 s for a round whose target and draft calls took 0.47 s and 0.32 s, three sequences handed
    over, for one drafting round). It pays only if drafting's
    predicted gain over the tokens still to generate covers that; the cost of a token read is learned
    from rounds that caught up (``RoundCosts.catch_up``: what they took past a round's predicted time)."""
    policy = fresh()
    rows = [Row(f"s{i}", MAX_K, "draft") for i in range(4)]
    play(policy, 300, 4, lambda t: 0.9, true_seconds(0.002, 0.001), 0.001)
    gained, seconds = zip(*policy.predict(rows), strict=True)
    rates = [g / s for g, s in zip(gained, seconds, strict=True)]
    leader = max(range(len(rates)), key=rates.__getitem__)
    assert leader > 0 and rates[leader] > 1.2 * rates[0]  # drafting leads at this batch
    saved_per_token = 1 / rates[0] - 1 / rates[leader]
    predicted = policy.model.seconds(4, 4 + 4 * leader, {"draft": leader}, rows={"draft": 4})
    for tokens in (100, 300, 600) * 10:  # caught up at 2 ms a token read
        policy.record_costs(RoundCosts(4 + 4 * leader, 0.03, {}, 0.003, batch=4, k=leader, gained=8,
                                       draft_rows={"draft": 4}, catch_up=(tokens, predicted + 0.002 * tokens)))
    assert policy.model.catch_up(600) == pytest.approx(1.2, rel=0.1)
    enough = 1.3 / saved_per_token  # tokens to generate whose predicted saving passes 1.2 s
    assert policy.hand_over_pays(rows, remaining=int(enough), read=600)
    assert not policy.hand_over_pays(rows, remaining=int(enough / 1.3), read=600)
    assert not policy.hand_over_pays(rows, remaining=10 ** 6, read=10 ** 9)


def test_at_a_batch_size_new_to_it_plain_decoding_is_measured_first():
    """Plain decoding is the bar every arm is judged against. At a batch size where no plain round was
    measured, that bar is the model's lines extrapolated (served, the real pair: learned at 1-4 streams,
    they priced drafting for 16 streams at more than plain decoding there realized, and 15 sequences were
    handed to the draft, 4.6 s of catch-up, before 25 drafting rounds at 0.7x plain decoding's rate). So
    the first round measured at a new batch size is plain, and nothing is handed over before it."""
    policy = fresh()
    play(policy, 200, 1, lambda t: 0.9, true_seconds(0.002, 0.001), 0.001)  # drafting pays at one stream
    assert policy.leader([Row("x", MAX_K, "draft")]) > 0
    ids = tuple(f"p{i}" for i in range(16))
    rows = [Row(s, MAX_K, "draft") for s in ids]
    assert policy.choose(rows) == [0] * 16
    assert not policy.hand_over_pays(rows, remaining=10 ** 6, read=1)

    def plain_round(interval: float | None) -> None:
        policy.observe(VerifyResult(ids, torch.zeros(16, dtype=torch.long), torch.zeros(16, dtype=torch.long),
                                    torch.full((16, 1), 7)))
        policy.record_costs(RoundCosts(16, 0.036, {}, 0.003, 16, interval, 16, 0))

    plain_round(None)  # beside an admission: not a measure of what a round costs
    assert policy.choose(rows) == [0] * 16
    plain_round(0.040)
    assert policy.choose(rows) == [min(r.cap, policy.leader(rows)) for r in rows]  # the arms compete as before


def test_held_sequences_are_handed_over_only_where_drafting_realized_more_than_plain_decoding():
    """The draft holds one sequence of 16 (the others held back at admission): its probes are all that
    drafting realized at this batch size, and they realized less than plain decoding. However much the
    model predicts for all 16 drafting, the hand-over's seconds of catch-up are not spent on it."""
    policy = fresh()
    play(policy, 200, 1, lambda t: 0.9, true_seconds(0.002, 0.001), 0.001)
    ids = tuple(f"p{i}" for i in range(16))
    rows = [Row(s, MAX_K, "draft") for s in ids]

    def round_(k: int, seconds: float) -> None:  # row 0 drafts k, every draft accepted
        ks = torch.tensor([k] + [0] * 15)
        policy.observe(VerifyResult(ids, ks, ks.clone(), torch.full((16, k + 1), 7)))
        policy.record_costs(RoundCosts(16 + k, 0.020 + 0.001 * (16 + k), {"draft": (k, 0.001)} if k else {}, 0.003,
                                       16, seconds, 16 + k, k, {"draft": 1} if k else {}))

    for _ in range(8):
        round_(0, 0.040)  # 400 tokens a second
    round_(4, 0.060)  # 333
    assert policy.leader(rows) > 0 and not policy.hand_over_pays(rows, remaining=10 ** 6, read=1)
    round_(4, 0.045)
    round_(4, 0.045)  # the probes' rounds together: 20 tokens in 45-60 ms, above plain decoding's rate
    assert policy.hand_over_pays(rows, remaining=10 ** 6, read=1)
