"""The trained draft against plain decoding and n-gram lookup, on the embedded model, in one run.

Prompts: open-ended chat prompts the draft never trained on, and input-grounded ones (repeat or edit
given text); greedy and temperature 0.7; one request at a time unless ``--batch``. Also the cost of
one draft step relative to one target step (batch 1, one token, after a 256-token context). Rows
marked "stop" draft up to k but stop a block after a token the draft gave less than ``--stop-below``
(``draft_stop_below``); "bgt=B" rows cap the draft tokens of a round at B over the batch
(``draft_token_budget``: B // requests each).

    python -m benchmarks.bench_draft [--draft smollm2-135m-instruct-eagle] [--ks 1,2,3,4] [--stop-below 0.5]
        [--batch 1]  # --batch 4: each suite's four prompts decoded together; --batch 8: each twice
        [--budgets 4,8]  # add hybrid k=4 stop rows with these draft token budgets

Prints a table, writes benchmarks/results/draft.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.prompts import SUITES, chat_ids
from serve_app.config import EngineConfig, SpeculationConfig
from serve_app.engine.factory import build_engine
from serve_app.engine.request import GenerationParams
from serve_app.engine.stats import SpecStats
from serve_app.models.base import RunnerConfig
from serve_app.models.eagle import EagleHead
from serve_app.models.runner import ModelRunner
from serve_app.speculation.proposers.hybrid import HybridProposer
from serve_app.speculation.proposers.ngram import NgramProposer
from serve_app.speculation.types import SamplingParams


def step_ms(path: Path, dtype: str) -> float:
    runner = ModelRunner(path, RunnerConfig(dtype=dtype, max_batch_size=1, max_seq_len=512))
    eagle = isinstance(runner.model, EagleHead)  # it reads a target feature with every token

    def features(n: int) -> torch.Tensor | None:
        return torch.randn(1, n, runner.model.feature_size) if eagle else None

    runner.add("s")
    runner.forward(["s"], [list(range(256))], features=features(256))
    times, one = [], features(1)
    for _ in range(30):
        start = time.perf_counter()
        runner.forward(["s"], [[5]], features=one)
        times.append(time.perf_counter() - start)
        runner.truncate("s", 256)
    return statistics.median(times) * 1e3


def run(engine, prompts, method: str, k: int, sampling: SamplingParams, max_tokens: int, batch: int = 1) -> dict:
    stats, tokens = SpecStats(), 0
    start = time.perf_counter()
    for lo in range(0, len(prompts), batch):  # `batch` requests at once
        params = [GenerationParams(max_tokens=max_tokens, method=method, num_speculative_tokens=k, sampling=
                                   sampling if sampling.greedy else SamplingParams(sampling.temperature, seed=lo + i))
                  for i in range(len(prompts[lo: lo + batch]))]
        for out in engine.generate(prompts[lo: lo + batch], params):
            stats.merge(out.stats)
            tokens += len(out.token_ids)
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "tok_s": tokens / elapsed, "mean_acceptance_length": stats.mean_acceptance_length,
            "acceptance_rate": stats.acceptance_rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="smollm2-135m-instruct-eagle")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--stop-below", type=float, default=0.5, help="draft_stop_below of the 'stop' rows")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together (tok/s is their total)")
    ap.add_argument("--budgets", default="", help="draft token budgets of extra 'hybrid k=4 stop' rows")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "draft.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_engine(EngineConfig(dtype=args.dtype, max_batch_size=args.batch, max_seq_len=1024, speculation=
                                       SpeculationConfig(draft=args.draft, num_speculative_tokens=4)))
    target_ms = step_ms(engine.verifier.runner.path, args.dtype)
    draft_ms = step_ms(engine.proposers["draft"].runner.path, args.dtype)  # type: ignore[attr-defined]
    suites = {name: [chat_ids(engine.tokenizer, p) for p in texts] for name, texts in SUITES.items()}
    # a batch larger than a suite repeats its prompts (sampled rows still differ: each has its own seed)
    suites = {name: (ids * -(-args.batch // len(ids)))[: max(args.batch, len(ids))] for name, ids in suites.items()}
    engine.generate([suites["open"][0]], GenerationParams(max_tokens=8))  # warm-up

    stop = args.stop_below
    # (name, method, k, draft_stop_below, draft_token_budget)
    configs = [("plain", "none", 0, 0.0, None), ("ngram k=4", "ngram", 4, 0.0, None)] + [
        (f"draft k={k}", "draft", k, 0.0, None) for k in map(int, args.ks.split(","))]
    configs.append(("draft k=4 stop", "draft", 4, stop, None))
    draft = engine.proposers["draft"]
    hybrid = HybridProposer(NgramProposer(), draft)
    # n-gram where the context matches, the draft elsewhere
    configs += [("hybrid k=4", "hybrid", 4, 0.0, None), ("hybrid k=4 stop", "hybrid", 4, stop, None)]
    configs += [(f"hybrid stop bgt={b}", "hybrid", 4, stop, int(b)) for b in args.budgets.split(",") if b]
    rows = []
    for decoding, sampling in (("greedy", SamplingParams()), ("T=0.7", SamplingParams(temperature=0.7))):
        for suite, prompts in suites.items():
            base = None
            for name, method, k, stop_below, budget in configs:
                engine.proposers["draft"] = hybrid if method == "hybrid" else draft
                draft.stop_below = stop_below  # type: ignore[attr-defined]
                engine.sizer.draft_token_budget = budget
                method = "draft" if method == "hybrid" else method
                r = run(engine, prompts, method, k, sampling, args.max_tokens, args.batch)
                base = base or r["tok_s"]
                rows.append({"decoding": decoding, "suite": suite, "config": name, **{
                    key: round(v, 3) for key, v in r.items()}, "ratio_vs_plain": round(r["tok_s"] / base, 3)})
    # mixed = both suites together, as the defaults are chosen on
    mixed = {}
    for r in rows:
        key = (r["decoding"], r["config"])
        mixed.setdefault(key, []).append(r["tok_s"])

    print(f"\ndraft={args.draft}: one draft step {draft_ms:.2f} ms = {draft_ms / target_ms:.1%} of a target step "
          f"({target_ms:.2f} ms), {args.dtype}, {args.threads} threads, {args.max_tokens} tokens, batch {args.batch}")
    print(f"{'decoding':8} {'suite':9} {'config':18} {'tok/s':>7} {'x plain':>8} {'mean acc len':>12} {'acc rate':>8}")
    for r in rows:
        print(f"{r['decoding']:8} {r['suite']:9} {r['config']:18} {r['tok_s']:>7.1f} {r['ratio_vs_plain']:>8.2f} "
              f"{r['mean_acceptance_length']:>12.2f} {r['acceptance_rate']:>8.2f}")
    print("\nmixed prompts (mean tok/s over both suites):")
    for (decoding, name), values in mixed.items():
        print(f"  {decoding:8} {name:18} {statistics.mean(values):7.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "draft_step_ms": draft_ms, "target_step_ms": target_ms,
                               "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
