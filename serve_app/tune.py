"""``python -m serve_app tune CONFIG``: what the block-size policy sees, measured on your prompts.

In-process, on the config's target and draft (torch backend), it
1. measures acceptance per draft position at the config's largest k (conditional: P(draft j accepted |
   drafts before it accepted), counted over the positions the target actually looked at);
2. runs every fixed k from 0 to that largest one at each batch size and times it (measured tok/s),
   fitting the cost lines the policy learns online from the same rounds: a target round against the
   tokens it verifies, a draft call against its steps, the engine's overhead between rounds;
3. projects tok/s against k from (1) and (2), sequential and with the draft overlapped behind the
   verify (a round then costs the longer of the two), recommends k per batch size and overlap on/off,
   and runs the config's own k policy at each batch size: its tok/s against the best fixed k, the k it
   chose and what each k realized under it;
4. projects another machine from per-component costs you give (default: the Trainium2 reference
   pair, see ``Projection.trn2_reference``) with the acceptance measured here, or one you give.

It prints a table, writes ``tune.json`` and, with matplotlib installed (``pip install -e ".[bench]"``;
without it, one line says so), ``acceptance.png``, ``throughput.png``, ``costs.png`` and ``policy.png``. A draft
position the target never looked at (every block rejected before it) is reported as never reached
(null in the JSON) and counts as never accepted in the projections.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from serve_app.config import EngineConfig
from serve_app.engine.engine import Engine
from serve_app.engine.request import GenerationParams
from serve_app.speculation.arms import bucket
from serve_app.speculation.policy import Acceptance, KPolicy, LinearCost
from serve_app.speculation.realized import policy_for

OVERLAP_MIN_DRAFT_SHARE = 0.2  # below this the draft's time is not worth hiding (issue 14's bar)


@dataclass(frozen=True)
class Projection:
    """Per-component costs of another machine (seconds): a target round is ``verify_fixed`` +
    ``verify_per_token`` × tokens, a draft step ``draft_step``, a hop between the actors ``exchange``."""

    name: str
    verify_fixed: float
    verify_per_token: float
    draft_step: float
    exchange: float
    source: str

    @classmethod
    def trn2_reference(cls) -> Projection:
        # DESIGN.md, Trainium2 facts: Qwen3-32B (TP 32) with Qwen3-1.7B drafting k = 7, batch 4, fused
        # on the same cores: ~45 ms a token on open-ended prompts (nothing accepted: one round = 7 draft
        # steps + 1 verify) and ~15 ms on structured ones. Assuming a draft step costs 0.25 of a target
        # step (a 1.7 B model on the same 32 cores is launch-bound, not 1/19 as its size), 45 ms =
        # V (1 + 7 × 0.25): V ≈ 16 ms per verify, 4 ms per draft step; the verify is taken as flat in
        # tokens up to 8 × 4 (accelerators are memory-bound there: 0.1 ms a token more); a hop between
        # two actors on one node ≈ 1 ms (Ray actor call over shared memory).
        return cls("trn2: Qwen3-32B TP32 + Qwen3-1.7B draft, batch 4 (assumed)", 0.016, 0.0001, 0.004, 0.001,
                   "derived from the reference ITLs in DESIGN.md under the assumptions in Projection.trn2_reference")


@dataclass
class TuneReport:
    max_k: int
    batches: list[int]
    acceptance_per_position: list[float | None]  # None: a position drafted but never looked at
    measured: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> k -> tok/s
    expected: dict[int, dict[int, float]] = field(default_factory=dict)
    expected_overlapped: dict[int, dict[int, float]] = field(default_factory=dict)
    draft_share: dict[int, dict[int, float]] = field(default_factory=dict)  # of a sequential round
    recommended_k: dict[int, int] = field(default_factory=dict)
    overlap: dict[int, bool] = field(default_factory=dict)
    costs: dict = field(default_factory=dict)
    projection: dict = field(default_factory=dict)
    # the config's own k policy at each batch: its tok/s, the k its last round drafted, and what each k
    # realized under it (tokens per second; None: not tried lately)
    policy: dict[int, dict] = field(default_factory=dict)


def expected_tokens(alphas: Sequence[float], k: int) -> float:
    """Tokens a row gains in a round drafting k: 1 + sum_j prod_{m<=j} alpha[m]."""
    total, p = 1.0, 1.0
    for a in list(alphas)[:k]:
        p *= a
        total += p
    return total


def round_rates(alphas: Sequence[float], batch: int, k: int, verify: LinearCost, draft_s: float,
                overhead: float, exchange: float = 0.0) -> tuple[float, float]:
    """(sequential, overlapped) tok/s of rounds of ``batch`` rows drafting k each; ``draft_s``: the
    draft call of k steps (0 when k = 0)."""
    tokens = batch * expected_tokens(alphas, k)
    v = verify(batch * (1 + k)) + exchange
    return tokens / (v + draft_s + overhead), tokens / (max(v, draft_s) + overhead)


class Planner:
    def __init__(self, engine: Engine, prompts: Sequence[Sequence[int]], max_k: int, max_tokens: int = 64,
                 policy: Callable[[], KPolicy] | None = None):
        """``policy``: makes the config's own k policy, run after the fixed k's at each batch."""
        self.engine, self.prompts, self.max_k, self.max_tokens = engine, list(prompts), max_k, max_tokens
        self.policy = policy
        self.acceptance = Acceptance(decay=1.0)
        self.verify = LinearCost(0.0, 0.0, decay=1.0, stiffness=0.0)
        self.draft: dict[str, LinearCost] = {}
        self.overheads: list[float] = []
        self.samples: dict[str, list[tuple[float, float]]] = {"verify": [], "draft": []}
        engine.on_round = self._on_round

    def _on_round(self, result, seconds: float) -> None:
        for d, a in zip(result.num_draft_tokens.tolist(), result.num_accepted.tolist(), strict=True):
            if d:
                self.acceptance.add(d, a)
        costs = self.engine.last_costs
        if costs is None:
            return
        self.verify.add(costs.tokens, costs.verify_s)
        self.samples["verify"].append((costs.tokens, costs.verify_s))
        for method, (steps, s) in costs.draft_s.items():
            self.draft.setdefault(method, LinearCost(0.0, 0.0, decay=1.0, stiffness=0.0)).add(steps, s)
            self.samples["draft"].append((steps, s))
        if costs.overhead_s is not None:
            self.overheads.append(costs.overhead_s)

    def run(self, k: int, batch: int) -> float:
        """Decode the prompts (cycled to at least ``batch``) with k fixed, ``batch`` at a time; tok/s."""
        prompts = (self.prompts * (batch // len(self.prompts) + 1))[: max(batch, len(self.prompts))]
        params = GenerationParams(max_tokens=self.max_tokens, num_speculative_tokens=k, ignore_eos=True)
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(prompts), batch):
            tokens += sum(len(o.token_ids) for o in self.engine.generate(prompts[i:i + batch], params))
        return tokens / (time.perf_counter() - start)

    def draft_seconds(self, k: int) -> float:
        if k == 0 or not self.draft:
            return 0.0
        return sum(cost(k) for cost in self.draft.values()) / len(self.draft)  # the methods' mean call

    def plan(self, batches: Sequence[int], projection: Projection | None = None,
             projection_alphas: Sequence[float] | None = None) -> TuneReport:
        self.run(self.max_k, 1)  # warm-up, and acceptance at the largest k
        report = TuneReport(self.max_k, list(batches), [])
        fixed = self.engine.policy
        for b in batches:
            report.measured[b] = {k: round(self.run(k, b), 2) for k in range(self.max_k + 1)}
            if self.policy is not None:
                self.engine.policy = self.policy()
                rate = self.run(self.max_k, b)
                realized = self.engine.policy.snapshot().get("realized", {}).get(str(bucket(b)), {})
                report.policy[b] = {"tok_s": round(rate, 2), "k": realized.get("k"),
                                    "realized_tok_s": realized.get("tokens_per_second")}
                self.engine.policy = fixed
        measured = [self.acceptance.measured(j) for j in range(len(self.acceptance.reached))]
        report.acceptance_per_position = [None if a is None else round(a, 4) for a in measured]
        alphas = [0.0 if a is None else a for a in measured]  # never reached: counted as never accepted
        overhead = sorted(self.overheads)[len(self.overheads) // 2] if self.overheads else 0.0
        for b in batches:
            seq, ovl, share = {}, {}, {}
            for k in range(self.max_k + 1):
                d = self.draft_seconds(k)
                seq[k], ovl[k] = (round(r, 2) for r in round_rates(alphas, b, k, self.verify, d, overhead))
                share[k] = round(d / (d + self.verify(b * (1 + k)) + overhead), 3)
            report.expected[b], report.expected_overlapped[b], report.draft_share[b] = seq, ovl, share
            best = max(report.measured[b], key=report.measured[b].get)
            report.recommended_k[b] = best
            report.overlap[b] = best > 0 and share[best] >= OVERLAP_MIN_DRAFT_SHARE
        report.costs = {
            "verify_s": {"fixed": round(self.verify.a, 6), "per_token": round(self.verify.b, 6)},
            "draft_s": {m: {"fixed": round(c.a, 6), "per_step": round(c.b, 6)} for m, c in self.draft.items()},
            "overhead_s": round(overhead, 6),
        }
        if projection is not None:
            report.projection = project(projection, list(projection_alphas or alphas), self.max_k)
        return report


def project(p: Projection, alphas: Sequence[float], max_k: int, batch: int = 4) -> dict:
    verify = LinearCost(p.verify_fixed, p.verify_per_token)
    base = round_rates(alphas, batch, 0, verify, 0.0, 0.0, p.exchange)[0]
    rows = {}
    for k in range(max(max_k, 1) + 1):
        seq, ovl = round_rates(alphas, batch, k, verify, k * p.draft_step + p.exchange * (k > 0), 0.0, p.exchange)
        rows[k] = {"sequential_x_plain": round(seq / base, 3), "overlapped_x_plain": round(ovl / base, 3)}
    return {"machine": asdict(p), "batch": batch, "acceptance_per_position": [round(a, 4) for a in alphas],
            "by_k": rows,
            "best_sequential_k": max(rows, key=lambda k: rows[k]["sequential_x_plain"]),
            "best_overlapped_k": max(rows, key=lambda k: rows[k]["overlapped_x_plain"])}


def format_report(r: TuneReport) -> str:
    shown = ["never reached" if a is None else a for a in r.acceptance_per_position]
    lines = [f"acceptance per draft position (conditional): {shown}",
             f"costs: {json.dumps(r.costs)}", ""]
    for b in r.batches:
        lines += [f"batch {b}: k | measured tok/s | expected (sequential) | expected (draft overlapped) | draft share",
                  "---|---|---|---|---"]
        for k in range(r.max_k + 1):
            lines.append(f"{k} | {r.measured[b][k]} | {r.expected[b][k]} | {r.expected_overlapped[b][k]} | "
                         f"{r.draft_share[b][k]:.0%}")
        if b in r.policy:
            p = r.policy[b]
            best = max(r.measured[b].values())
            lines.append(f"the config's k policy: {p['tok_s']} tok/s ({p['tok_s'] / best:.2f}x the best fixed k), "
                         f"last drafted k = {p['k']}; realized per k: {p['realized_tok_s']}")
        lines.append(f"recommended: num_speculative_tokens {r.recommended_k[b]}, overlap "
                     f"{'on' if r.overlap[b] else 'off'} (the draft is {r.draft_share[b][r.recommended_k[b]]:.0%} "
                     f"of a round; overlap pays from {OVERLAP_MIN_DRAFT_SHARE:.0%} with the draft on cores of its own)")
        lines.append("")
    if r.projection:
        p = r.projection
        lines.append(f"projection: {p['machine']['name']} ({p['machine']['source']})")
        lines.append("k | sequential x plain | overlapped x plain")
        lines.append("---|---|---")
        for k, row in p["by_k"].items():
            lines.append(f"{k} | {row['sequential_x_plain']} | {row['overlapped_x_plain']}")
        lines.append(f"best k: {p['best_sequential_k']} sequential, {p['best_overlapped_k']} overlapped")
    return "\n".join(lines)


PLOTS = ("acceptance.png", "throughput.png", "costs.png", "policy.png")
NO_PLOTS = f'no plots: pip install -e ".[bench]" adds matplotlib, for {", ".join(PLOTS)}'


def write_report(r: TuneReport, planner: Planner, out: Path, say=print) -> list[Path]:
    """``tune.json``, and the plots where matplotlib is installed (else one line saying how to get them)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(asdict(r), indent=2))
    written = [out / "tune.json"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say(NO_PLOTS)
        return written
    fig, ax = plt.subplots(figsize=(5, 3.5))
    positions = range(1, len(r.acceptance_per_position) + 1)
    ax.bar(positions, [a or 0.0 for a in r.acceptance_per_position])
    for x, a in zip(positions, r.acceptance_per_position, strict=True):
        if a is None:
            ax.text(x, 0.02, "never\nreached", ha="center", fontsize=7)
    ax.set(xlabel="draft position", ylabel="P(accepted | earlier accepted)", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(out / "acceptance.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for b in r.batches:
        ks = list(range(r.max_k + 1))
        line, = ax.plot(ks, [r.measured[b][k] for k in ks], "o-", label=f"batch {b} measured")
        ax.plot(ks, [r.expected[b][k] for k in ks], "--", color=line.get_color(), label=f"batch {b} expected")
        ax.plot(ks, [r.expected_overlapped[b][k] for k in ks], ":", color=line.get_color(),
                label=f"batch {b} overlapped")
    ax.set(xlabel="num_speculative_tokens k", ylabel="tok/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput.png")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, ax, cost in (("verify", a1, planner.verify), ("draft", a2, None)):
        xs = [x for x, _ in planner.samples[name]]
        ax.scatter(xs, [t * 1000 for _, t in planner.samples[name]], s=4, alpha=0.4)
        if xs and cost is not None:
            ax.plot([min(xs), max(xs)], [cost(min(xs)) * 1000, cost(max(xs)) * 1000], "r-")
        ax.set(xlabel="tokens verified" if name == "verify" else "draft steps", ylabel="ms", title=f"{name} call")
    fig.tight_layout()
    fig.savefig(out / "costs.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for b, p in r.policy.items():
        rates = p["realized_tok_s"] or []
        ks = [k for k, v in enumerate(rates) if v is not None]
        line, = ax.plot(ks, [rates[k] for k in ks], "o-", label=f"batch {b}: realized under the policy")
        if p["k"] is not None and p["k"] < len(rates) and rates[p["k"]] is not None:
            ax.plot([p["k"]], [rates[p["k"]]], "*", ms=14, color=line.get_color(), label=f"batch {b}: its choice")
        ax.plot(list(r.measured[b]), list(r.measured[b].values()), ":", color=line.get_color(),
                label=f"batch {b}: fixed k")
    ax.set(xlabel="k", ylabel="tok/s", title="the k policy: what each k realized, what it chose")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "policy.png")
    plt.close("all")
    return written + [out / name for name in PLOTS]


def tune(config: EngineConfig, prompts: Sequence[str], *, chat: bool, max_tokens: int, batches: Sequence[int],
         out: Path, projection: Projection | None, projection_alphas: Sequence[float] | None = None,
         say=print) -> TuneReport:
    from serve_app.engine.factory import build_engine

    engine_cfg = config.model_copy(update={
        "max_batch_size": max(max(batches), config.max_batch_size),
        "speculation": config.speculation.model_copy(update={"k_policy": "fixed", "draft_token_budget": None}),
    })
    own = config.speculation.model_copy(update={"draft_token_budget": None})
    max_k = engine_cfg.speculation.num_speculative_tokens
    if engine_cfg.speculation.method == "none" or max_k == 0:
        raise ValueError("the config does not speculate (speculation.draft: none or num_speculative_tokens: 0)")
    say(f"building the engine: {engine_cfg.model} + {engine_cfg.speculation.draft} ({engine_cfg.dtype})")
    engine = build_engine(engine_cfg)
    tok = engine.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) if chat else tok.encode(p) for p in prompts]
    planner = Planner(engine, ids, max_k, max_tokens, lambda: policy_for(own))
    say(f"measuring k = 0..{max_k} at batch {list(batches)} on {len(ids)} prompts x {max_tokens} tokens")
    report = planner.plan(batches, projection, projection_alphas)
    say(format_report(report))
    for path in write_report(report, planner, out, say):
        say(f"wrote {path}")
    return report
