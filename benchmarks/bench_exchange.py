"""Time of a speculation round spent outside model compute: the exchange between the engine and
the draft and target worker actors.

The same requests run three ways in one process, on a local Ray cluster:
  in-process   draft and target runners in the engine's own process (no exchange at all);
  actor calls  draft and target as Ray actors, one ordinary actor call to each per round;
  compiled     the same actors, each round call through a Ray Compiled Graph.
For the actor runs, the workers time their own round calls (model compute, sampling, rollback),
and exchange = round wall time - draft compute - target compute.

    python -m benchmarks.bench_exchange [--batch 1,4] [--max-tokens 64] [--k 4]

Target: the embedded model; draft: its first 2 layers (a stand-in with the real vocabulary and
message sizes; acceptance does not matter here). Prints a table, writes results/exchange.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

from benchmarks.prompts import SUITES, chat_ids
from serve_app.config import EngineConfig, SpeculationConfig
from serve_app.engine.factory import build_engine
from serve_app.engine.plan import model_folder
from serve_app.engine.request import GenerationParams
from serve_app.speculation.types import ProposalBlock, SamplingParams, VerifyResult


def truncated_draft(target: Path, layers: int, out: Path) -> Path:
    """A draft made of the target's first ``layers`` layers (same vocabulary and tokenizer)."""
    config = AutoConfig.from_pretrained(target)
    config.num_hidden_layers = layers
    config.save_pretrained(out)
    state = {k: v for k, v in load_file(target / "model.safetensors").items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    return out


class Echo:
    """A worker that does no compute: what is left of a round is the pure exchange."""

    def propose(self, request):
        return ECHO_BLOCK

    def verify(self, block):
        return ECHO_RESULT


ECHO_BLOCK = ECHO_RESULT = None


def echo_exchange(block, result, compiled: bool, n: int = 300) -> float:
    """ms per round for real messages through two no-compute actors (draft hop + target hop)."""
    import ray

    from serve_app.workers.remote import RoundChannel

    global ECHO_BLOCK, ECHO_RESULT
    ECHO_BLOCK, ECHO_RESULT = block, result
    draft, target = ray.remote(Echo).remote(), ray.remote(Echo).remote()
    channels = RoundChannel(draft, "propose", compiled), RoundChannel(target, "verify", compiled)
    request = ((result,), block.seq_ids, tuple(block.num_draft_tokens.tolist()))
    for _ in range(20):
        channels[1](channels[0](request))
    start = time.perf_counter()
    for _ in range(n):
        channels[1](channels[0](request))
    elapsed = (time.perf_counter() - start) / n * 1e3
    for c in channels:
        c.close()
    return elapsed


def messages(batch: int, k: int, width: int) -> tuple[ProposalBlock, VerifyResult]:
    """A sampled round's messages at full size: k drafts with a width-K sparse q per sequence."""
    seq_ids = tuple(f"cmpl-{i:024d}" for i in range(batch))
    block = ProposalBlock(seq_ids, torch.randint(0, 49152, (batch, k)), torch.full((batch,), k),
                          torch.randint(0, 49152, (batch, k, width)), torch.rand(batch, k, width))
    result = VerifyResult(seq_ids, torch.full((batch,), k), torch.full((batch,), 2),
                          torch.randint(0, 49152, (batch, k + 1)))
    return block, result


def run(engine, prompts, params) -> tuple[list[float], list[list[int]]]:
    rounds: list[float] = []
    engine.on_round = lambda result, seconds: rounds.append(seconds)
    outs = engine.generate(prompts, params)
    return rounds, [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (and in-process)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "exchange.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from serve_app.serving.config import AppConfig
    from serve_app.serving.replica import build_replica_engine

    target = model_folder("smollm2-135m-instruct")
    draft = truncated_draft(target, 2, Path(tempfile.mkdtemp()))
    engine_cfg = EngineConfig(model=str(target), dtype="bfloat16", max_batch_size=8, max_seq_len=1024,
                              num_threads=args.threads,
                              speculation=SpeculationConfig(draft=str(draft), num_speculative_tokens=args.k))
    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = SUITES["grounded"] + SUITES["open"]
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    torch.set_num_threads(args.threads)
    local = build_engine(engine_cfg)
    remotes = {mode: build_replica_engine(AppConfig(engine=engine_cfg, exchange=mode))
               for mode in ("actor_calls", "compiled_graph")}

    rows = []
    for batch in map(int, args.batch.split(",")):
        prompts = [chat_ids(tokenizer, t) for t in texts[:batch]]
        for sampling in (SamplingParams(), SamplingParams(temperature=0.7, seed=1)):
            params = GenerationParams(max_tokens=args.max_tokens, sampling=sampling, ignore_eos=True)
            run(local, prompts, GenerationParams(max_tokens=4))  # warm-up
            local_rounds, _ = run(local, prompts, params)
            row = {"batch": batch, "decoding": "greedy" if sampling.greedy else "T=0.7",
                   "in_process_round_ms": statistics.median(local_rounds) * 1e3}
            for mode, replica in remotes.items():
                run(replica.engine, prompts, GenerationParams(max_tokens=4))
                workers = [replica.target, replica.draft.actor]
                ray.get([w.compute_stats.remote() for w in workers])  # reset
                start = time.perf_counter()
                rounds, _ = run(replica.engine, prompts, params)
                wall = time.perf_counter() - start
                (t_busy, t_calls), (d_busy, _) = ray.get([w.compute_stats.remote() for w in workers])
                round_ms = sum(rounds) / len(rounds) * 1e3
                compute_ms = (t_busy + d_busy) / t_calls * 1e3
                row[f"{mode}_round_ms"] = round_ms
                row[f"{mode}_compute_ms"] = compute_ms
                row[f"{mode}_exchange_ms"] = round_ms - compute_ms
                row[f"{mode}_rounds"] = len(rounds)
                row[f"{mode}_tok_s"] = batch * args.max_tokens / wall
            rows.append(row)
        block, result = messages(batch, args.k, engine_cfg.speculation.draft_top_k)
        for mode in ("actor_calls", "compiled_graph"):
            for row in rows[-2:]:
                row[f"{mode}_echo_ms"] = echo_exchange(block, result, compiled=mode == "compiled_graph")

    print(f"\nembedded target + 2-layer draft, bf16, k={args.k}, {args.max_tokens} tokens per request, "
          f"{args.threads} torch thread(s) per worker; ms per round (mean; in-process: median)")
    print("exchange = round - worker compute; echo = the same messages through two no-compute actors")
    print(f"{'batch':>5} {'decoding':8} {'in-proc':>8} | {'actor calls: round':>18} {'compute':>8} {'exchange':>9}"
          f" {'echo':>6} | {'compiled: round':>16} {'compute':>8} {'exchange':>9} {'echo':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['decoding']:8} {r['in_process_round_ms']:>8.2f} | "
              f"{r['actor_calls_round_ms']:>18.2f} {r['actor_calls_compute_ms']:>8.2f} "
              f"{r['actor_calls_exchange_ms']:>9.2f} {r['actor_calls_echo_ms']:>6.2f} | "
              f"{r['compiled_graph_round_ms']:>16.2f} {r['compiled_graph_compute_ms']:>8.2f} "
              f"{r['compiled_graph_exchange_ms']:>9.2f} {r['compiled_graph_echo_ms']:>6.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"\nwrote {out}")
    for replica in remotes.values():
        replica.close()
    ray.shutdown()


if __name__ == "__main__":
    main()
