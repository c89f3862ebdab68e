"""Plain vs speculative decoding on the embedded model, and plain decoding vs transformers' generate.

Single stream, greedy, every configuration measured in the same run and reported as ratios to this
engine's plain decoding (these machines are noisy: compare within a run, not across runs).

    python -m benchmarks.bench_decode [--max-tokens 128] [--dtype bfloat16] [--threads 2]

Prints a table and writes benchmarks/results/decode.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.prompts import SUITES, chat_ids
from serve_app.config import EngineConfig, SpeculationConfig
from serve_app.engine.factory import build_engine
from serve_app.engine.request import GenerationParams
from serve_app.engine.stats import SpecStats


def run_engine(engine, prompts, method: str, k: int, max_tokens: int) -> dict:
    stats, tokens, outputs = SpecStats(), 0, []
    start = time.perf_counter()
    for ids in prompts:  # one at a time: single-stream latency
        out = engine.generate([ids], GenerationParams(max_tokens=max_tokens, method=method,
                                                      num_speculative_tokens=k))[0]
        stats.merge(out.stats)
        tokens += len(out.token_ids)
        outputs.append(out.token_ids)
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "outputs": outputs,
            "mean_acceptance_length": stats.mean_acceptance_length, "acceptance_rate": stats.acceptance_rate}


def run_hf(model, prompts, max_tokens: int, eos: int) -> dict:
    tokens, outputs = 0, []
    start = time.perf_counter()
    for ids in prompts:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)
        new = out[0, len(ids):].tolist()
        tokens += len(new)
        outputs.append(new)
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    engine = build_engine(EngineConfig(model=args.model, dtype=args.dtype, max_batch_size=1, max_seq_len=1024,
                                       speculation=SpeculationConfig(draft="ngram", num_speculative_tokens=8)))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(engine.verifier.runner.path, dtype=getattr(torch, args.dtype)).eval()
    suites = {name: [chat_ids(engine.tokenizer, p) for p in texts] for name, texts in SUITES.items()}
    eos = engine.tokenizer.eos_token_id
    engine.generate([suites["open"][0]], GenerationParams(max_tokens=8))  # warm-up
    run_hf(hf, [suites["open"][0]], 8, eos)

    configs = [("plain", "none", 0)] + [(f"ngram k={k}", "ngram", k) for k in map(int, args.ks.split(","))]
    rows = []
    for suite, prompts in suites.items():
        results = {name: run_engine(engine, prompts, method, k, args.max_tokens) for name, method, k in configs}
        results["hf generate"] = run_hf(hf, prompts, args.max_tokens, eos)
        base = results["plain"]
        for name, r in results.items():
            rows.append({
                "suite": suite, "config": name, "tokens": r["tokens"], "tok_s": round(r["tok_s"], 2),
                "ratio_vs_plain": round(r["tok_s"] / base["tok_s"], 3),
                "mean_acceptance_length": round(r.get("mean_acceptance_length", 1.0), 3),
                "acceptance_rate": round(r.get("acceptance_rate", 0.0), 3),
                "same_tokens_as_plain": r["outputs"] == base["outputs"],
            })

    header = f"{'suite':9} {'config':12} {'tokens':>6} {'tok/s':>7} {'x plain':>8} {'mean acc len':>12} " \
             f"{'acc rate':>8}  same-as-plain"
    print(f"\nmodel={args.model} dtype={args.dtype} threads={args.threads} max_tokens={args.max_tokens} "
          f"greedy, batch 1")
    print(header)
    for r in rows:
        print(f"{r['suite']:9} {r['config']:12} {r['tokens']:>6} {r['tok_s']:>7.1f} {r['ratio_vs_plain']:>8.2f} "
              f"{r['mean_acceptance_length']:>12.2f} {r['acceptance_rate']:>8.2f}  {r['same_tokens_as_plain']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
