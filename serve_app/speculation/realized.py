"""The default k policy (``k_policy: adaptive``): k judged by the throughput each choice realizes.

The cost model (``speculation.policy.BlockSizePolicy``) predicts a round's time from the lines it
fits to the target's and the draft's calls. It cannot see what lies between them: hops, a draft
catching up after plain rounds, plain rounds pipelined while speculative ones are not. Served, it was
wrong both ways (issue 26: 0.80-0.93x plain decoding on the embedded model; a fixed k = 4 beating it on
the real pair). So each round is also timed as served, result to result, and filed under its batch
size (1, 2, 4, 8, 16, ...: rounds of 3 or 4 sequences share a bucket) and its arm: the most draft
tokens it asked of a sequence, 0 being plain decoding.

An arm's rate is predicted as (expected tokens) / (expected seconds), the cost model's numbers for
those rows at that k, each scaled by what rounds realized (``speculation.arms``):
- the drafts the model expects (from acceptance measured per draft position, per sequence) by the
  drafts accepted over those expected, pooled over every drafting arm of the bucket: the model's error
  there is the same at every k (its acceptance lags a change in content), and pooling keeps the noise
  of a block's acceptance out of the comparison between k's; the model's acceptance is its prior, worth
  a few drafts beside the bucket's decayed ones, so the ratio fades back to the model's as its rounds age
  (one rejected first block must not read as a draft never right, nor an unlucky stretch stay the verdict
  while plain decoding leads and nothing drafts to correct it);
- its seconds by its rounds' realized seconds over what the model predicts for those rounds now (so its
  own learning does not linger in the factor), an arm not measured by the nearest measured one's, a
  drafting arm's own shrunk toward its nearest drafting neighbour's as far as its rounds are few, where
  that makes it cheaper (``ArmRounds.time_factors``): the model's shape, the realized level; one slow
  round of an arm seldom played does not set its pace.
The sums decay (``arms.DECAY`` a round of the bucket), so they follow changes in load and content.

Each round plays the arm of the highest predicted rate (the leader), the smaller k on a tie. Past
k = 1 the rate against k is unimodal (each draft token adds less than the one before, and costs about
the same), so exploration looks next to the leader, as OSUB does (Combes and Proutière, ICML 2014),
and at plain decoding, which a fixed cost of every draft call (the hop) can put apart from the rest:
once ``EXPLORE_EVERY`` rounds of a bucket have gone by with the leader alone, one of those arms whose
measurement has faded below ``STALE`` rounds is played once (twice where it switches between plain
decoding and drafting: a switch round is dearer than the arm's pace and does not measure it, the round
after it does; ``speculation.arms``). A probe that falls due stays due until a
round plays it, so plain rounds sent ahead (``engine.pipeline``) delay it by a round but never swallow
it. That bounds exploration to 1 round in ``EXPLORE_EVERY``, spent on the arms nearest the best, whose
rates are nearest it; an arm predicted at a share r of the leader's rate waits longer
(``ArmRounds.stale``), and until what one play of it is predicted to lose (its seconds × (1 - r)) is
within ``EXPLORE_SHARE`` of the bucket's time since it was last played (an arm never played at that
batch size is tried as soon as it is due: the model's guess there is untested). So where drafting loses by far
(the real pair at 4-16 streams on 2 cores: a probe of k = 1 took two plain rounds' time for little gain,
one round in 30-40), probes cost at most about that share, while an arm level with
the leader is retried as often as before. Acceptance that collapses makes every drafting arm predict
less at once and plain decoding leads; k = 1 is still retried now and then, so speculation comes back
when it pays again (``tests/test_realized.py``).

A sequence alone (one stream) is the batch, and how well the draft guesses differs far more from one
request to the next than within one: its first ``MEASURE_ROUNDS`` rounds draft where plain decoding leads
the bucket, as long as they are predicted to lose at most ``MEASURE_SHARE`` of its time (``measuring``),
so its own acceptance, not the requests' before it, decides. Those rounds teach the model that
sequence's acceptance; they count as expected in the bucket's acceptance against the model, which
measures what the model misjudges, not how a new sequence differs from its prior.

``choose`` is a pure query; the clock of each bucket advances in ``record_costs``, once a real round.
"""

from __future__ import annotations

from collections.abc import Sequence

from serve_app.config import SpeculationConfig
from serve_app.speculation.arms import ArmRounds, RealizedRates, bucket
from serve_app.speculation.policy import BlockSizePolicy, FixedPolicy, KPolicy, RoundCosts, Row
from serve_app.speculation.types import VerifyResult

EXPLORE_EVERY = 8  # at most one round in this many of a bucket tries a stale neighbour of the leader
EXPLORE_SHARE = 0.005  # what probes of an arm may lose (predicted), as a share of the bucket's time
MEASURE_ROUNDS = 2  # drafting rounds that measure a sequence alone before its own acceptance counts as known
MEASURE_SHARE = 0.02  # what those rounds may lose (predicted), as a share of the sequence's time at plain decoding


class RealizedPolicy:
    def __init__(self, model: BlockSizePolicy):
        self.model = model
        self.max_k = model.max_k
        self.realized = RealizedRates()
        self.predicted_gain = 0.0  # of the round just observed, as the model expected it before the result
        self.drafted: dict[str, int] = {}  # each sequence's drafting rounds so far (``measuring``)
        self.measured_new = False  # the round just observed drafted only for sequences being measured

    # ---- learning ----------------------------------------------------------------------------
    def observe(self, result: VerifyResult) -> None:
        """The round's outcome (before its costs): first what the model expected it to gain."""
        rows = [Row(s, k, "") for s, k in zip(result.seq_ids, result.num_draft_tokens.tolist(), strict=True)]
        self.predicted_gain = len(rows) + sum(sum(g) for g in self.model.gains(rows, self.max_k))
        # a round that measures new sequences alone says how they differ from the model's prior, not what
        # the model misjudges: their own acceptance takes it in (the model's, per sequence)
        self.measured_new = any(r.cap for r in rows) and all(
            self.drafted.get(r.seq_id, 0) < MEASURE_ROUNDS for r in rows if r.cap)
        for row in rows:
            if row.cap:
                self.drafted[row.seq_id] = self.drafted.get(row.seq_id, 0) + 1
        self.model.observe(result)

    def record_costs(self, costs: RoundCosts) -> None:
        self.realized.record(min(costs.k, self.max_k), costs.batch, costs.tokens, costs.gained, costs.interval_s,
                             costs.gained if self.measured_new else self.predicted_gain)
        self.model.record_costs(costs)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """The target's line past the knee: rounds at a few streams never reach it, and a batch's round
        would be priced by the slope of 1-5 tokens (on the real pair about 0.3 ms a token, where each token
        past 16 costs 7-10). A draft's prior line may look dear beside it: its probes measure the draft."""
        self.model.record_forward(tokens, seconds)

    def forget(self, seq_id: str) -> None:
        self.drafted.pop(seq_id, None)
        self.model.forget(seq_id)

    # ---- the choice --------------------------------------------------------------------------
    def rates(self, rows: Sequence[Row]) -> list[float]:
        """Predicted tokens per second of each arm 0..top for these rows (top: the largest cap)."""
        return [gained / seconds for gained, seconds in self.predict(rows)]

    def predict(self, rows: Sequence[Row]) -> list[tuple[float, float]]:
        """Predicted (tokens gained, seconds) of a round at each arm 0..top for these rows: the model's,
        the drafts scaled by the bucket's acceptance against the model and the seconds by what the arm's
        rounds (few of them: with its nearest drafting neighbour's) realized against the model as it is now
        (``ArmRounds.time_factors``: its own learning does not linger). Plain rounds pipelined or not:
        their realized seconds have it."""
        top = min(self.max_k, max((r.cap for r in rows), default=0))
        batch = len(rows)
        calibration = self.realized.buckets.get(bucket(batch)) or ArmRounds()
        gains = self.model.gains(rows, top)
        methods = {r.method for r in rows}

        def then(m: int) -> float:  # the model's seconds now for arm m's rounds here (a probe drafts for one row)
            c = calibration
            drafting = dict.fromkeys(methods, (c.mean("tokens", m) - c.mean("batch", m)) / max(m, 1))
            return self.model.seconds(c.mean("batch", m), c.mean("tokens", m), dict.fromkeys(methods, m), rows=drafting)

        factors = calibration.time_factors(then, top + 1)
        acceptance = calibration.acceptance()
        out = []
        for arm in range(top + 1):
            ks = [min(r.cap, arm) for r in rows]
            steps = {m: max(k for r, k in zip(rows, ks, strict=True) if r.method == m) for m in methods}
            drafting = {m: sum(k > 0 for r, k in zip(rows, ks, strict=True) if r.method == m) for m in methods}
            gained = batch + sum(sum(g[:k]) for g, k in zip(gains, ks, strict=True))
            seconds = self.model.seconds(batch, batch + sum(ks), steps, rows=drafting)
            if factors is not None:
                gained = batch + (gained - batch) * acceptance
                seconds *= factors[arm]
            out.append((gained, max(seconds, 1e-9)))
        return out

    def leader(self, rows: Sequence[Row]) -> int:
        """The arm of the highest predicted rate (the smaller k on a tie)."""
        return best(self.rates(rows))

    def would_draft(self, rows: Sequence[Row]) -> bool:
        """Whether a decoder draft's prefill is worth it for these rows (``engine.deferral``): the leader
        drafts at their batch bucket. Where no drafting round was measured there, a sequence alone is
        taken (only a sequence the draft holds can show what drafting realizes), and a batch only where
        the model's lines were fitted to the calls of the leader's round (``BlockSizePolicy.fitted``: a
        prompt's prefill teaches the target's line what many tokens cost): requests sent together are
        held together, so a batch left out here decodes plainly until a hand-over (``explore_pays``). Where
        plain decoding leads, a sequence alone that ``measuring`` would measure is taken."""
        if not any(r.cap for r in rows):
            return False
        unexplored = self.unexplored(rows)
        if unexplored and len(rows) == 1:
            return True
        predicted = self.predict(rows)
        leader = best([gained / seconds for gained, seconds in predicted])
        if leader == 0:
            return self.measuring(rows, predicted) > 0
        return not unexplored or self.model.fitted(rows, [min(r.cap, leader) for r in rows])

    def measuring(self, rows: Sequence[Row], predicted: Sequence[tuple[float, float]]) -> int:
        """A sequence alone that fewer than ``MEASURE_ROUNDS`` rounds drafted for: the drafting arm predicted
        best for it, where those rounds are predicted to lose at most ``MEASURE_SHARE`` of its time at plain
        decoding (what it may still generate, ``Row.remaining``, at plain decoding's rate); else 0. At one
        stream each request is the batch, and how well the draft guesses it differs from one request to
        the next far more than within one: its first rounds measure its own acceptance, which the bucket's
        leader, learned on the requests before it, does not know (the embedded model's replica in process:
        a fixed k = 4 took 43 to 64 rounds for 96 tokens, request by request; after requests it guessed badly,
        the default left later requests to plain decoding from their admission, 0.85x the fixed k = 4)."""
        if len(rows) != 1 or not rows[0].cap or len(predicted) < 2:
            return 0
        left = MEASURE_ROUNDS - self.drafted.get(rows[0].seq_id, 0)
        if left <= 0:
            return 0
        rates = [gained / seconds for gained, seconds in predicted]
        arm = best(rates[1:]) + 1
        lost = left * predicted[arm][1] * max(0.0, 1 - rates[arm] / rates[0])
        return arm if lost <= MEASURE_SHARE * rows[0].remaining / rates[0] else 0

    def unexplored(self, rows: Sequence[Row]) -> bool:
        """Whether no drafting round was measured at these rows' batch bucket."""
        calibration = self.realized.buckets.get(bucket(len(rows)))
        return calibration is None or not calibration.drafted()

    def explore_pays(self, rows: Sequence[Row], read: int) -> bool:
        """Rows the draft holds none of are never probed (a held row's cap is 0), and requests sent together
        are held together: without a hand-over, drafting at their batch size would never be measured. One
        pays where none was measured there yet and the draft's reading of ``read`` tokens (the model's
        catch-up line) is within ``EXPLORE_SHARE`` of the time rounds there have taken, the probes' bound:
        exploring a batch size costs a bounded share of the time served at it. (Served on the real pair,
        one sequence taken at once at 4 and 16 streams, a fresh server's 4-request load gave its first
        tokens 0.8 s later than ``draft: none``'s, and its probes at 16 streams cost 0.89x, one run each.)"""
        calibration = self.realized.buckets.get(bucket(len(rows)))
        if calibration is None or not calibration.elapsed or not any(r.cap for r in rows) or not self.unexplored(rows):
            return False
        return calibration.elapsed * EXPLORE_SHARE >= self.model.catch_up(read)

    def plain_measured(self, batch: int) -> bool:
        """Whether a plain round was measured at this batch's bucket: the bar every arm there is judged
        against, which until then is the model's lines extrapolated from other batch sizes."""
        calibration = self.realized.buckets.get(bucket(batch))
        return calibration is not None and calibration.measured(0)

    def hand_over_pays(self, rows: Sequence[Row], remaining: int, read: int) -> bool:
        """The leader's predicted gain over plain decoding, over ``remaining`` tokens, against the model's
        line of what reading ``read`` tokens costs the draft; and only where rounds that drafted at this
        batch size realized more tokens a second than plain ones. A hand-over costs seconds of catch-up
        for a prediction extrapolated from the few rows the draft held (served, the real pair at 16 streams:
        one row's probe, then 15 sequences handed over, 5.6 s, for drafting rounds at 0.6x plain decoding)."""
        calibration = self.realized.buckets.get(bucket(len(rows)))
        if calibration is None or not calibration.drafting_beat_plain():
            return False
        rates = self.rates(rows)
        leader = best(rates)
        return leader > 0 and remaining * (1 / rates[0] - 1 / rates[leader]) > self.model.catch_up(read)

    def arm(self, rows: Sequence[Row]) -> int:
        if not self.plain_measured(len(rows)):
            return 0  # plain decoding first: a round of it costs nothing against the bar it sets
        predicted = self.predict(rows)
        rates = [gained / seconds for gained, seconds in predicted]
        leader = best(rates)
        if leader == 0 and (measure := self.measuring(rows, predicted)):
            return measure
        calibration = self.realized.buckets.get(bucket(len(rows)))
        if calibration is None:
            return leader
        last = min(calibration.last or 0, len(rates) - 1)
        if (last > 0) != (leader > 0):
            if calibration.switched and calibration.stale(last):
                return last  # a switch's second round: what the arm costs in a stretch of it (``speculation.arms``)
            stay = best(rates[1:]) + 1 if last else 0
            if not self.switch_pays(rows, predicted, stay, leader, sum(calibration.switch_s)):
                leader = stay
        if calibration.since_other(leader) < EXPLORE_EVERY:
            return leader

        def due(a: int) -> bool:  # faded, and one play's predicted loss within the share of the time since
            share = rates[a] / rates[leader]
            if not calibration.stale(a, share ** 2):
                return False
            if a not in calibration.played:  # the model's guess alone: one round there is worth more
                return True
            plays = 2 if (a > 0) != (leader > 0) else 1  # a switch and the round that measures it
            return calibration.since(a) * predicted[leader][1] * EXPLORE_SHARE >= plays * predicted[a][1] * (1 - share)

        stale = [a for a in {leader + 1, leader - 1, 0} if 0 <= a < len(rates) and a != leader and due(a)]
        return max(stale, key=lambda a: rates[a]) if stale else leader

    @staticmethod
    def switch_pays(rows: Sequence[Row], predicted: Sequence[tuple[float, float]], stay: int, leader: int,
                    cost: float) -> bool:
        """Whether changing from plain decoding to drafting or back (from the best arm of the kind played last,
        ``stay``, to ``leader``) saves more than ``cost`` (a switch there and back, ``ArmRounds.switch_s``: a
        lead that fades is a switch back) over ``EXPLORE_EVERY`` rounds of the leader, or what the rows may
        still generate if less: a lead within the noise does not flip the kind every few rounds, each flip
        paying a switch."""
        (g_stay, s_stay), (g_lead, s_lead) = predicted[stay], predicted[leader]
        tokens = EXPLORE_EVERY * g_lead
        if all(r.remaining for r in rows):
            tokens = min(tokens, sum(r.remaining for r in rows))
        return tokens * (s_stay / g_stay - s_lead / g_lead) > cost

    def choose(self, rows: Sequence[Row], plain_overhead_hidden: bool = False) -> list[int]:
        """Every row drafts min(its cap, the arm). A pure query."""
        if not rows:
            return []
        arm = self.arm(rows)
        return [min(r.cap, arm) for r in rows]

    def snapshot(self) -> dict:
        """The model's view, and what each k realized per batch bucket (``RealizedRates.snapshot``)."""
        return {**self.model.snapshot(), "realized": self.realized.snapshot()}


def best(rates: Sequence[float]) -> int:
    """The arm of the highest rate, the smaller k on a tie."""
    return max(range(len(rates)), key=lambda a: (rates[a], -a))


def policy_for(spec: SpeculationConfig) -> KPolicy:
    """The engine's k policy: k judged by what it realizes (the default), the cost model alone, or
    every row its cap when k is fixed or nothing drafts."""
    if spec.k_policy == "fixed" or spec.method == "none" or spec.num_speculative_tokens == 0:
        return FixedPolicy()
    model = BlockSizePolicy(spec.num_speculative_tokens)
    return model if spec.k_policy == "cost_model" else RealizedPolicy(model)
