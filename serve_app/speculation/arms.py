"""What each k realized as served, per batch size: the measurement under the default k policy
(``speculation.realized``) and what ``/metrics`` and ``tune`` report for any policy.

A round is filed under its batch bucket (1, 2, 4, 8, 16, ...: rounds of 3 or 4 sequences share one) and
its arm: the most draft tokens it asked of a sequence, 0 being plain decoding. Per arm, decayed sums
(``DECAY`` a round of the bucket) of its rounds, their sequences, verified tokens, tokens gained,
and seconds (result to result, everything included); over every drafting round, the tokens gained and
those a model expected (``acceptance``).

An arm's pace is what its rounds cost in a stretch of its kind. A round that switches between plain
decoding and drafting (the bucket's last round was of the other kind) costs more: served at one stream
on the embedded model, a drafting round after plain ones took 65 ms where one after drafting ones took 53
(the draft reads what it missed), and a plain round after a drafting one 47 where one after plain ones
took 38 (nothing was sent ahead of it). While one kind leads, every round of the other is such a switch,
so filed as its pace each arm would be measured at its dearest while the other leads, and whichever led
would keep the lead: drafting through a collapse of the draft's acceptance, plain decoding through
requests the draft guesses well. A switch round's seconds count in the bucket's time but not in its arm's
pace; its drafts count in the acceptance (``switched``: the next round of that arm measures it), and what
it took past the arm's pace is what a switch that way costs (``switch_s``).
"""

from __future__ import annotations

from collections.abc import Callable

DECAY = 0.97  # per round of a bucket: an arm's sums follow about its last 30 rounds
STALE = 0.5  # an arm's weight below this (about 23 rounds after one was played) is stale
PRIOR_DRAFTS = 4.0  # the model's acceptance counts as this many expected drafts beside a bucket's decayed ones
PRIOR_ROUNDS = 4.0  # a neighbour's pace counts as this many of a drafting arm's own rounds (``time_factors``)
SWITCH_EMA = 0.2  # the weight of a switch's excess over its arm's pace in ``ArmRounds.switch_s``


def bucket(batch: int) -> int:
    """1, 2, then the next power of two: 3-4 -> 4, 5-8 -> 8, 9-16 -> 16."""
    return batch if batch <= 2 else 1 << (batch - 1).bit_length()


class ArmRounds:
    """One bucket's arms."""

    FIELDS = ("weight", "batch", "tokens", "gained", "seconds")

    def __init__(self, arms: int = 1):
        self.sums = {f: [0.0] * arms for f in self.FIELDS}
        self.drafts = {"batch": 0.0, "gained": 0.0, "expected": 0.0}  # every timed drafting round's (``acceptance``)
        self.rounds = 0
        self.elapsed = 0.0  # seconds of every round here that was timed (not decayed)
        self.played: dict[int, int] = {}  # each arm's last round (the bucket's clock when it was played)
        self.last: int | None = None  # the arm of the last round here
        self.switched = False  # the last round here switched between plain decoding and drafting
        self.switch_s = [0.0, 0.0]  # what a switch into plain decoding, into drafting, adds to the arm's pace (EMA)

    def add(self, arm: int, batch: int, tokens: int, gained: int, seconds: float | None, expected: float) -> None:
        self.rounds += 1
        self.elapsed += seconds or 0.0
        self.played[arm] = self.rounds
        self.switched = self.last is not None and (self.last > 0) != (arm > 0)
        self.last = arm
        for values in self.sums.values():
            values.extend([0.0] * (arm + 1 - len(values)))
            for a in range(len(values)):
                values[a] *= DECAY
        for f in self.drafts:
            self.drafts[f] *= DECAY
        if not seconds or expected <= 0:
            return
        if arm:
            for f, v in zip(self.drafts, (batch, gained, expected), strict=True):
                self.drafts[f] += v
        if not self.switched:
            for f, v in zip(self.FIELDS, (1.0, batch, tokens, gained, seconds), strict=True):
                self.sums[f][arm] += v
        elif self.measured(arm):
            into = int(arm > 0)
            excess = max(seconds - self.sums["seconds"][arm] / self.sums["weight"][arm], 0.0)
            self.switch_s[into] += SWITCH_EMA * (excess - self.switch_s[into])

    def stale(self, arm: int, share: float = 1.0) -> bool:
        """Whether the arm's rounds have faded below ``STALE`` × ``share`` (an arm predicted at a share
        r of the leader's rate is retried after about ln(r²) / ln(DECAY) more rounds than one level with it)."""
        return arm >= len(self.sums["weight"]) or self.sums["weight"][arm] < STALE * share

    def measured(self, arm: int) -> bool:
        """Whether a round of the arm was ever measured here (not only played beside an admission)."""
        return arm < len(self.sums["weight"]) and self.sums["weight"][arm] > 0

    def drafted(self) -> bool:
        """Whether a drafting round was measured here (a switch round too: it measured the drafts)."""
        return self.drafts["batch"] > 0

    def since(self, arm: int) -> int:
        """Rounds since the arm was last played (every round so far if never)."""
        return self.rounds - self.played.get(arm, 0)

    def since_other(self, arm: int) -> int:
        """Rounds since one played another arm than ``arm`` (every round so far if none did)."""
        return self.rounds - max((r for a, r in self.played.items() if a != arm), default=0)

    def acceptance(self) -> float:
        """Drafts accepted over what the model expected, over every drafting arm (its error is the same
        at every k: the acceptance it reads), beside the model's own acceptance as a prior worth
        ``PRIOR_DRAFTS`` expected drafts accepted as expected. The bucket's sums decay a round, plain or
        not, so the ratio is what recent drafting rounds say, and it fades back to the model's as they
        age: the first rejected block of a fresh bucket does not read as a draft that is never right (a
        ratio of one round's counts: 0), and an unlucky stretch does not stay the verdict while plain
        decoding leads and nothing drafts to correct it. (Before, the prior faded with every drafting
        round and the decayed sums kept their ratio, however old: served at one stream on the embedded
        model, where drafting gains about 10 %, the ratio sat at 0.2-0.6 after a run of rejected blocks,
        though the model's expectations matched what drafting rounds realized within 2 %, and plain
        decoding led 55-70 % of its rounds where a fixed k = 4 decoded 1.08-1.13x plain decoding.)"""
        d = self.drafts
        return (d["gained"] - d["batch"] + PRIOR_DRAFTS) / (d["expected"] - d["batch"] + PRIOR_DRAFTS)

    def time_factors(self, model_seconds: Callable[[int], float], arms: int) -> list[float] | None:
        """Per arm 0..arms-1, realized seconds over a model's; None before any round here. ``model_seconds(m)``:
        the model's seconds now for the rounds arm m played here (their mean batch and tokens). An arm not
        measured takes the nearest measured arm's ratio (the model's shape, the realized level: its error
        grows with the distance in k). A drafting arm's own ratio is shrunk toward that of the nearest other
        measured drafting arm, as if that were ``PRIOR_ROUNDS`` of its rounds (no more than that arm's own
        decayed rounds: an arm probed once in hundreds of rounds is not priced by a neighbour measured once
        before that), where that makes it cheaper:
        an arm's mean seconds do not fade with its weight, so one slow round of an arm seldom played would
        otherwise set its pace until it is played again, which that pace puts off (in process at one
        stream: the one round of k = 4 in a while took 47 ms where its rounds took 27-30, and it was
        predicted at 0.7x the leader's rate). Never dearer than its own rounds say, so an arm the model
        prices too dear keeps its edge over its neighbours (the model's shape error grows with k). Plain
        rounds keep their own (pipelined or not, they are played most)."""
        weights = self.sums["weight"]
        ratio = {m: self.sums["seconds"][m] / (w * max(model_seconds(m), 1e-9)) for m, w in enumerate(weights) if w > 0}
        if not ratio:
            return None

        def nearest(arm: int, among: list[int]) -> int:
            return min(among, key=lambda m: (abs(m - arm), m))

        out = []
        for arm in range(arms):
            if arm not in ratio:
                out.append(ratio[nearest(arm, list(ratio))])
                continue
            others = [m for m in ratio if m and m != arm]
            if not arm or not others:
                out.append(ratio[arm])
            else:  # never dearer than its own rounds say: a slow outlier fades, a cheaper arm keeps its edge
                w, n = weights[arm], nearest(arm, others)
                prior = min(PRIOR_ROUNDS, weights[n])  # a neighbour counts for no more than its own rounds
                out.append(min(ratio[arm], (w * ratio[arm] + prior * ratio[n]) / (w + prior)))
        return out

    def tokens_per_second(self, arm: int) -> float | None:
        """What the arm's rounds realized lately, or None where it is stale."""
        return None if self.stale(arm) else self.realized(arm)

    def realized(self, arm: int) -> float:
        """Tokens a second the arm's measured rounds realized (their decayed sums; 0 if none)."""
        return self.sums["gained"][arm] / self.sums["seconds"][arm] if self.measured(arm) else 0.0

    def drafting_beat_plain(self) -> bool:
        """Whether, plain rounds measured here, some drafting arm's rounds realized more tokens a second."""
        return self.measured(0) and \
            max(map(self.realized, range(1, len(self.sums["weight"]))), default=0.0) > self.realized(0)

    def mean(self, field: str, arm: int) -> float:
        return self.sums[field][arm] / self.sums["weight"][arm]


class RealizedRates:
    """Every bucket's arms, and the arm each bucket's last round played."""

    def __init__(self) -> None:
        self.buckets: dict[int, ArmRounds] = {}
        self.chosen: dict[int, int] = {}

    def record(self, k: int, batch: int, tokens: int, gained: int, seconds: float | None,
               expected: float | None = None) -> None:
        """One round; ``expected``: the tokens a model expected it to gain (default: what it gained)."""
        if batch > 0:
            b = bucket(batch)
            self.buckets.setdefault(b, ArmRounds()).add(k, batch, tokens, gained, seconds,
                                                       gained if expected is None else expected)
            self.chosen[b] = k

    def snapshot(self) -> dict:
        """Per batch bucket: the k its last round played, what each k realized lately (tokens per
        second; None: stale) and over how many rounds (decayed)."""
        return {str(b): {"k": self.chosen.get(b, 0),
                         "tokens_per_second": [None if (r := c.tokens_per_second(a)) is None else round(r, 4)
                                               for a in range(len(c.sums["weight"]))],
                         "rounds": [round(w, 2) for w in c.sums["weight"]]}
                for b, c in sorted(self.buckets.items())}
