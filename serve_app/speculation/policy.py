"""The block-size policy: each round, k per sequence (0 to its cap) for the most tokens per second.

Fed by every round's ``VerifyResult`` and timings, it keeps
- **acceptance per draft position**, per sequence, decayed so it follows what the sequence is writing
  now, with the engine-wide rates (decayed more slowly) as the prior of a sequence that has drafted
  little; ``alpha[j]`` is P(draft j accepted | drafts before it accepted);
- **costs, learned online** as lines fitted by exponentially weighted least squares: a target round
  against the tokens it verifies (batch + drafts), a draft call against its draft steps (per proposer:
  an n-gram lookup costs next to nothing, a draft model a forward a step plus the exchange), and the
  engine's own work between rounds.

Expected tokens of a row drafting k: 1 + sum_{j<=k} prod_{m<=j} alpha[m] (Leviathan et al. 2023, §3,
per position instead of one rate). A round's time: the draft calls for its longest block, the target
for batch + sum(k) tokens, the engine's overhead. For each longest block K the best k's are found
greedily (the gain of a row's next token only falls, and a token's cost is the line's slope), and
the best K wins, K = 0 (plain decoding) included; a plain round is cheaper again where the engine
pipelines plain rounds (its overhead is hidden). So speculation switches itself off when verifying
cannot pay (a large batch on a CPU, low acceptance, a slow draft) and back on when it can.
SGLang's ``AdaptiveStepSlot`` adapts EAGLE's steps from acceptance alone; this adds the costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from serve_app.speculation.arms import RealizedRates
from serve_app.speculation.types import VerifyResult

# A target forward streams every weight whatever its tokens, and past a few tokens each adds its compute:
# about flat, then linear (the 1.5 B target on 2 cores, our kernels: 98 ms for 1 token, 102 for 4, 122 for
# 8, 139 for 12, 184 for 16, 225 for 20). The target's line has a second slope past this many tokens: fitted
# to rounds of 1-20 tokens of that curve, it prices 80 at 0.92x what the curve's last slope gives (a single
# slope: 0.66x, a knee at 4: 0.78x), SmolLM2-135M's at 1.07x, and a straight curve exactly.
VERIFY_KNEE = 8


def forward_features(tokens: float) -> tuple[float, float]:
    """A target forward's features for its line: its tokens, and those past ``VERIFY_KNEE``."""
    return tokens, max(tokens - VERIFY_KNEE, 0.0)


class LinearCost:
    """t(x) = a + b·x (or a + b₁·x₁ + b₂·x₂ + ...), fitted online by exponentially weighted least squares.

    The slopes are shrunk toward the prior line's (ridge, ``stiffness`` in samples at unit distance)
    so that samples bunched at a few x (a draft that always runs 3-4 steps) do not extrapolate
    wildly, and a feature never varied (rows, while one sequence ran) keeps its prior slope; with no
    sample yet the prior line stands."""

    def __init__(self, a: float, *b: float, decay: float = 0.98, stiffness: float = 1.0):
        self.decay, self.stiffness, self.prior = decay, stiffness, b
        n = len(b)
        self._w, self._t, self._x = 0.0, 0.0, [0.0] * n  # decayed sums of w, w·t, w·x
        self._xx, self._xt = [[0.0] * n for _ in range(n)], [0.0] * n  # of w·x·xᵀ, w·x·t
        self.a, self.slopes = a, list(b)

    @property
    def b(self) -> float:
        return self.slopes[0]

    def add(self, x: float | Sequence[float], t: float) -> None:
        xs = [float(x)] if isinstance(x, int | float) else [float(v) for v in x]
        d = self.decay
        self._w, self._t = self._w * d + 1.0, self._t * d + t
        for i, xi in enumerate(xs):
            self._x[i] = self._x[i] * d + xi
            self._xt[i] = self._xt[i] * d + xi * t
            for j, xj in enumerate(xs):
                self._xx[i][j] = self._xx[i][j] * d + xi * xj
        w, n = self._w, len(xs)
        mx, mt = [v / w for v in self._x], self._t / w
        cov = [[self._xx[i][j] - w * mx[i] * mx[j] + (self.stiffness if i == j else 0.0) for j in range(n)]
               for i in range(n)]
        rhs = [self._xt[i] - w * mx[i] * mt + self.stiffness * self.prior[i] for i in range(n)]
        slopes = solve(cov, rhs)
        # more work never costs less
        self.slopes = list(self.prior) if slopes is None else [max(v, 0.0) for v in slopes]
        self.a = max(mt - sum(b * m for b, m in zip(self.slopes, mx, strict=True)), 0.0)

    def __call__(self, *x: float) -> float:
        return self.a + sum(b * v for b, v in zip(self.slopes, x, strict=False))


def solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """x with matrix·x = rhs (Gaussian elimination, partial pivoting); None where singular."""
    n = len(rhs)
    m = [[*row, r] for row, r in zip(matrix, rhs, strict=True)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda i: abs(m[i][c]))
        if abs(m[pivot][c]) < 1e-12:
            return None
        m[c], m[pivot] = m[pivot], m[c]
        for i in range(c + 1, n):
            f = m[i][c] / m[c][c]
            m[i] = [v - f * u for v, u in zip(m[i], m[c], strict=True)]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


class Acceptance:
    """Decayed counts of draft positions reached and accepted, and the rates they give."""

    def __init__(self, decay: float):
        self.decay = decay
        self.reached: list[float] = []
        self.accepted: list[float] = []

    def record(self, drafted: int, accepted: int) -> None:
        """One round of this sequence (or of the engine); a round without drafts only decays the
        counts, so a rate not measured for a while returns to its prior and gets tried again."""
        self.reached = [v * self.decay for v in self.reached]
        self.accepted = [v * self.decay for v in self.accepted]
        self.add(drafted, accepted)

    def add(self, drafted: int, accepted: int) -> None:
        """Count one block without decaying."""
        if len(self.reached) < drafted:
            grow = drafted - len(self.reached)
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        for j in range(min(accepted + 1, drafted)):  # positions the target looked at
            self.reached[j] += 1.0
            self.accepted[j] += j < accepted

    def rate(self, j: int, prior: float, weight: float) -> float:
        """P(draft j accepted | drafts before it accepted), the counts shrunk toward ``prior`` by
        ``weight`` samples; the prior where there is neither a count nor a weight."""
        if j >= len(self.reached) or self.reached[j] + weight <= 0:
            return prior
        return (self.accepted[j] + weight * prior) / (self.reached[j] + weight)

    def measured(self, j: int) -> float | None:
        """The measured rate at position j alone; None where the target never looked at it (drafted
        but always rejected before it, or never drafted)."""
        if j >= len(self.reached) or self.reached[j] <= 0:
            return None
        return self.accepted[j] / self.reached[j]


@dataclass(frozen=True)
class RoundCosts:
    """What one round cost, as the engine measured it."""

    tokens: int  # verified by the target: the batch plus its drafts
    verify_s: float  # the target's call (for a round sent ahead: from when the target could start it)
    draft_s: Mapping[str, tuple[int, float]]  # per proposer that drafted: (its longest block, seconds of its call)
    overhead_s: float | None  # the engine's and its caller's work since the last round (None: not measured)
    batch: int = 0  # sequences in the round
    interval_s: float | None = None  # from the last round's result to this one's, all included (None: unknown)
    gained: int = 0  # tokens the round added over the batch (accepted drafts + one each)
    k: int = 0  # the most draft tokens any sequence was asked for (0: a plain round)
    draft_rows: Mapping[str, int] = field(default_factory=dict)  # per proposer that drafted: the rows it drafted for
    # a round whose draft first read tokens it was behind on (a hand-over's contexts, a probe after plain
    # rounds): (tokens read, the round's seconds result to result); None: none read, or not measured
    catch_up: tuple[int, float] | None = None


@dataclass(frozen=True)
class Row:
    """One sequence of the round: its id, the most it may draft, its proposer, and the most tokens it may
    still generate (0: not known)."""

    seq_id: str
    cap: int
    method: str
    remaining: int = 0


class KPolicy(Protocol):
    """Chooses each round's k per row within its cap, from what it has been told of past rounds.
    ``choose`` is a pure query: calling it twice changes nothing; what it learns comes from
    ``observe`` and ``record_costs``, once per real round."""

    def choose(self, rows: Sequence[Row], plain_overhead_hidden: bool = False) -> list[int]: ...

    def would_draft(self, rows: Sequence[Row]) -> bool:
        """Whether these rows are worth a draft's prefill: the policy's own choice would draft for them
        (its once-in-a-while probes aside). A pure query (``engine.deferral`` asks it)."""
        ...

    def hand_over_pays(self, rows: Sequence[Row], remaining: int, read: int) -> bool:
        """Whether drafting for these rows is predicted to gain, over the ``remaining`` tokens they may still
        generate, more than a draft reading ``read`` tokens first costs (``engine.deferral``). A pure query."""
        ...

    def explore_pays(self, rows: Sequence[Row], read: int) -> bool:
        """Whether a draft should take one of these rows (reading ``read`` tokens first) only to measure
        drafting at their batch size, which no row the draft holds can (``engine.deferral``). A pure query."""
        ...

    def observe(self, result: VerifyResult) -> None: ...

    def record_costs(self, costs: RoundCosts) -> None: ...

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """A target forward caching ``tokens`` prompt tokens took ``seconds`` (the engine's call): what a
        forward of many tokens costs, which no round at the batch sizes served so far has shown."""
        ...

    def forget(self, seq_id: str) -> None: ...

    def snapshot(self) -> dict: ...


class FixedPolicy:
    """``k_policy: fixed`` (and nothing to draft): every row drafts its cap. It still reports what each
    k realized (``speculation.arms``)."""

    def __init__(self) -> None:
        self.realized = RealizedRates()

    def choose(self, rows: Sequence[Row], plain_overhead_hidden: bool = False) -> list[int]:
        return [r.cap for r in rows]

    def would_draft(self, rows: Sequence[Row]) -> bool:
        return any(self.choose(rows))

    def hand_over_pays(self, rows: Sequence[Row], remaining: int, read: int) -> bool:
        return True  # every row drafts its cap, whatever it costs

    def explore_pays(self, rows: Sequence[Row], read: int) -> bool:
        return False  # it measures nothing to choose by

    def observe(self, result: VerifyResult) -> None:
        pass

    def record_costs(self, costs: RoundCosts) -> None:
        self.realized.record(costs.k, costs.batch, costs.tokens, costs.gained, costs.interval_s)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        pass

    def forget(self, seq_id: str) -> None:
        pass

    def snapshot(self) -> dict:
        return {"realized": self.realized.snapshot()}


class BlockSizePolicy:
    """The cost model (``k_policy: cost_model``): k per row from the acceptance and cost lines above.
    It is blind to costs its lines do not see (hops, a draft catching up, a pipeline draining):
    ``speculation.realized.RealizedPolicy`` judges its predictions by what rounds realize."""

    def __init__(self, max_k: int, prior_alpha: float = 0.6, prior_weight: float = 4.0,
                 seq_decay: float = 0.9, global_decay: float = 0.99,
                 verify_cost: tuple[float, float] = (0.015, 0.001),
                 draft_cost: tuple[float, ...] = (0.002, 0.002, 0.0),
                 catch_up_cost: tuple[float, float] = (0.0, 0.002)):
        """``verify_cost``/``draft_cost``/``catch_up_cost``: prior lines (seconds; a + b·tokens; a + b·steps +
        c·steps·(rows - 1), c 0 if not given; a + b·tokens read) until rounds are measured. ``prior_alpha``:
        the acceptance assumed before any round."""
        self.max_k = max_k
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.seq_decay = seq_decay
        self.engine_wide = Acceptance(global_decay)
        self.sequences: dict[str, Acceptance] = {}
        self.verify = LinearCost(*verify_cost, 0.0)  # a + b·tokens + c·(tokens past VERIFY_KNEE)
        self.widest = 0  # the most tokens of a target forward the line was fitted to (a round's or a prefill's)
        self.draft_prior = (*draft_cost, 0.0)[:3]
        self.drafts: dict[str, LinearCost] = {}
        self.overhead = 0.0  # the engine's own seconds a round, outside the calls (EMA)
        # A plain round's cost as served: result to result against the batch, everything included (a
        # pipelined round hides its round trip, but not all of the replica's work: a call's duration
        # alone would make plain decoding look cheaper than it is and speculation flap on and off).
        self.plain = LinearCost(*verify_cost)
        self.plain_rounds = 0
        # What a draft takes to read tokens it is behind on before it drafts (its prefill of a sequence handed
        # over, the tokens of a plain stretch): past what the round was predicted to take without them.
        self.catch_up = LinearCost(*catch_up_cost)

    # ---- learning ----------------------------------------------------------------------------
    def observe(self, result: VerifyResult) -> None:
        """A round's outcome: each row's drafts and accepted count (the engine-wide counts decay once
        a round, each sequence's once per round it is in)."""
        drafted, accepted = result.num_draft_tokens.tolist(), result.num_accepted.tolist()
        for seq_id, d, a in zip(result.seq_ids, drafted, accepted, strict=True):
            self.record(seq_id, d, a, engine_wide=False)
        self.engine_wide.record(0, 0)
        for d, a in zip(drafted, accepted, strict=True):
            if d:
                self.engine_wide.add(d, a)

    def record(self, seq_id: str, drafted: int, accepted: int, engine_wide: bool = True) -> None:
        self.sequences.setdefault(seq_id, Acceptance(self.seq_decay)).record(drafted, accepted)
        if engine_wide:
            self.engine_wide.record(drafted, accepted)

    def record_costs(self, costs: RoundCosts) -> None:
        """One real round's costs: the lines. A plain round is a target call too: its tokens and seconds
        teach the target's line what a token costs at batch sizes no round drafted at (drafting rounds
        alone, all at one stream and one k, would leave it flat)."""
        self.record_forward(costs.tokens, costs.verify_s)
        if costs.catch_up is not None:
            read, took = costs.catch_up
            predicted = self.seconds(costs.batch, costs.tokens, dict.fromkeys(costs.draft_rows, costs.k),
                                     rows=costs.draft_rows)
            self.catch_up.add(read, max(took - predicted, 0.0))
        if costs.tokens == costs.batch:  # a plain round
            if costs.interval_s is not None:
                self.plain.add(costs.batch, costs.interval_s)
                self.plain_rounds += 1
            return
        for method, (steps, seconds) in costs.draft_s.items():
            rows = costs.draft_rows.get(method, 1)
            self.drafts.setdefault(method, LinearCost(*self.draft_prior)).add((steps, steps * (rows - 1)), seconds)
        if costs.overhead_s is not None:
            self.overhead = 0.9 * self.overhead + 0.1 * costs.overhead_s

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """Not learned from: alone, the model never tries a k it predicts to lose, and a target priced by its
        prefill before any round drafted would be weighed against the draft's prior line (with tiny models,
        dearer than the target: it never drafted). ``speculation.realized`` feeds it (``record_forward``)."""

    def record_forward(self, tokens: int, seconds: float) -> None:
        """A target forward of ``tokens`` tokens (a round's, or a prompt's prefill)."""
        self.verify.add(forward_features(tokens), seconds)
        self.widest = max(self.widest, tokens)

    def fitted(self, rows: Sequence[Row], ks: Sequence[int]) -> bool:
        """Whether its lines were fitted to the calls of a round drafting ``ks`` for ``rows``: each drafting
        proposer's, and target forwards of at least as many tokens as the round verifies."""
        drafting = {r.method for r, k in zip(rows, ks, strict=True) if k}
        return all(m in self.drafts for m in drafting) and self.widest >= len(rows) + sum(ks)

    def forget(self, seq_id: str) -> None:
        self.sequences.pop(seq_id, None)

    def _draft_cost(self, method: str) -> LinearCost:
        """The learned line of a proposer, or the prior line until it has drafted (not stored: a query)."""
        return self.drafts.get(method) or LinearCost(*self.draft_prior)

    # ---- the choice --------------------------------------------------------------------------
    def alphas(self, seq_id: str, n: int) -> list[float]:
        """The sequence's conditional acceptance at positions 0..n-1."""
        mine = self.sequences.get(seq_id)
        out = []
        for j in range(n):
            prior = self.engine_wide.rate(j, self.prior_alpha, self.prior_weight)
            out.append(prior if mine is None else mine.rate(j, prior, self.prior_weight))
        return out

    def would_draft(self, rows: Sequence[Row]) -> bool:
        return any(self.choose(rows))

    def hand_over_pays(self, rows: Sequence[Row], remaining: int, read: int) -> bool:
        ks, rate, plain_rate = self.best(rows)
        return any(ks) and remaining * (1 / plain_rate - 1 / rate) > self.catch_up(read)

    def explore_pays(self, rows: Sequence[Row], read: int) -> bool:
        return False  # its lines hold at every batch size; ``speculation.realized`` judges them by what rounds realize

    def choose(self, rows: Sequence[Row], plain_overhead_hidden: bool = False) -> list[int]:
        """k for each row, to maximise expected tokens per second of this round. A pure query."""
        return self.best(rows, plain_overhead_hidden)[0]

    def best(self, rows: Sequence[Row], plain_overhead_hidden: bool = False) -> tuple[list[int], float, float]:
        """(``choose``'s k per row, its predicted tokens per second, plain decoding's)."""
        batch = len(rows)
        plain_rate = batch / max(self.seconds(batch, batch, {}, plain_overhead_hidden), 1e-9)
        best, best_rate = [0] * batch, plain_rate
        top = min(self.max_k, max((r.cap for r in rows), default=0))
        if top <= 0:
            return best, best_rate, plain_rate
        gains = self.gains(rows, top)
        for longest in range(1, top + 1):
            candidates = sorted(((g[j], i) for i, g in enumerate(gains) for j in range(min(longest, len(g)))),
                                reverse=True)
            ks, steps = [0] * batch, dict.fromkeys({r.method for r in rows}, 0)
            drafting = dict.fromkeys(steps, 0)
            tokens, gained = batch, 0.0
            for gain, i in candidates:  # every prefix of the greedy order, the best one kept
                method = rows[i].method
                drafting[method] += ks[i] == 0
                ks[i] += 1
                tokens += 1
                gained += gain
                steps[method] = max(steps[method], ks[i])
                rate = (batch + gained) / max(self.seconds(batch, tokens, steps, plain_overhead_hidden, drafting), 1e-9)
                if rate > best_rate:
                    best, best_rate = list(ks), rate
        return best, best_rate, plain_rate

    def gains(self, rows: Sequence[Row], top: int) -> list[list[float]]:
        """``gains[i][j]``: P(row i's first j + 1 drafts are all accepted), non-increasing in j; j < its cap."""
        out = []
        for r in rows:
            g, p = [], 1.0
            for a in self.alphas(r.seq_id, min(r.cap, top)):
                p *= a
                g.append(p)
            out.append(g)
        return out

    def seconds(self, batch: float, tokens: float, steps: Mapping[str, int], plain_overhead_hidden: bool = False,
                rows: Mapping[str, float] | None = None) -> float:
        """A round's predicted time: the target verifying ``tokens``, each proposer's longest block
        ``steps[method]`` for its ``rows[method]`` drafting rows (default 1), the engine's overhead; a
        plain round (tokens == batch) as plain rounds took."""
        if tokens == batch:
            return self.plain(batch) if self.plain_rounds >= 8 else \
                self.verify_s(batch) + (0.0 if plain_overhead_hidden else self.overhead)
        rows = rows or {}
        return self.overhead + self.verify_s(tokens) + sum(
            self._draft_cost(m)(n, n * (max(rows.get(m, 1), 1) - 1)) for m, n in steps.items() if n)

    def verify_s(self, tokens: float) -> float:
        """The target's predicted seconds for a forward of ``tokens`` tokens."""
        return self.verify(*forward_features(tokens))

    def snapshot(self) -> dict:
        """What the policy sees now (for metrics, logs and the planner)."""
        return {
            "acceptance_per_position": [None if (a := self.engine_wide.measured(j)) is None else round(a, 4)
                                        for j in range(len(self.engine_wide.reached))],  # None: never reached
            "verify_s": {"fixed": round(self.verify.a, 6), "per_token": round(self.verify.b, 6),
                         "per_token_past_knee": round(self.verify.slopes[1], 6)},
            "draft_s": {m: {"fixed": round(c.a, 6), "per_step": round(c.b, 6), "per_row_step": round(c.slopes[1], 6)}
                        for m, c in self.drafts.items()},
            "catch_up_s": {"fixed": round(self.catch_up.a, 6), "per_token": round(self.catch_up.b, 6)},
            "overhead_s": round(self.overhead, 6),
            "plain_round_s": {"fixed": round(self.plain.a, 6), "per_sequence": round(self.plain.b, 6)},
        }
