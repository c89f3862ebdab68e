"""A draft's mean acceptance length in the engine (greedy), on larger prompt sets than bench_draft's.

How well a distilled draft drafts depends on how far the prompts are from those it trained on, so
this reports three suites, none trained on:

- ``open``: the four hand-written open-ended prompts of ``prompts.py`` (bench_draft's "open");
- ``heldout``: distill's 48 held-out chat prompts (12 topics x 4 instructions that training never used);
- ``self``: 96 prompts the target wrote itself, as distill makes its training prompts (Magpie) but
  from other seeds, none within word-Jaccard 0.5 of a training prompt (``self_prompts.json``).

Requests run 8 at a time without a draft token budget (greedy acceptance does not depend on the
batch, up to bf16 rounding); k is fixed, no stop, no n-gram lookup. Besides the mean acceptance
length at k it estimates it for every smaller k from the share of rounds accepted at each position
(1 + the shares before it: a smaller k would start its rounds elsewhere, so this is an estimate).

    python -m benchmarks.bench_acceptance [--draft smollm2-135m-instruct-eagle] [--k 4] [--dtype bfloat16]
    # any target and draft, on your own prompts (a JSON list of strings, or one prompt per line):
    python -m benchmarks.bench_acceptance --model SRC --draft SRC --prompts my_prompts.txt --k 8
    # the self suite, regenerated against a distill run's training prompts:
    python -m benchmarks.bench_acceptance --write-self-prompts --exclude-data DIR/data.pt

Prints a table, writes benchmarks/results/acceptance.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.prompts import OPEN_ENDED, chat_ids
from serve_app.config import EngineConfig, SpeculationConfig
from serve_app.distill.prompts import chat_prompts, usable_prompts
from serve_app.engine.factory import build_engine
from serve_app.engine.request import GenerationParams
from serve_app.engine.stats import SpecStats

SELF_PROMPTS = Path(__file__).parent / "self_prompts.json"


def write_self_prompts(data_path: Path, n: int, seed: int) -> None:
    """Prompts the target writes itself, none near a training prompt of the distill run in data_path."""
    from serve_app.distill.train import synthesize_prompts

    engine = build_engine(EngineConfig(dtype="bfloat16", max_batch_size=64, max_seq_len=512,
                                       speculation=SpeculationConfig(draft="none")))
    tok = engine.tokenizer
    data = torch.load(data_path, weights_only=False)
    # the user's message inside each chat-templated training prompt
    seen = [tok.decode(p, skip_special_tokens=True).split("\nuser\n", 1)[-1].rsplit("\nassistant\n", 1)[0]
            for p, _, _ in data["train"]]
    candidates = synthesize_prompts(engine, 2 * n, seed, exclude=chat_prompts("heldout"))
    kept = usable_prompts(candidates, exclude=seen)[:n]
    SELF_PROMPTS.write_text(json.dumps({"seed": seed, "candidates": len(candidates), "excluded_prompts": len(seen),
                                        "prompts": kept}, indent=1))
    print(f"wrote {len(kept)} prompts to {SELF_PROMPTS} ({len(candidates)} candidates, seed {seed})")


def suites(path: Path | None) -> dict[str, list[str]]:
    if path is not None:  # the user's own prompts
        text = path.read_text()
        prompts = json.loads(text) if text.lstrip().startswith("[") else [ln for ln in text.splitlines() if ln.strip()]
        return {path.stem: prompts}
    return {"open": OPEN_ENDED, "heldout": chat_prompts("heldout"),
            "self": json.loads(SELF_PROMPTS.read_text())["prompts"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target source (default: the embedded model)")
    ap.add_argument("--draft", default="smollm2-135m-instruct-eagle")
    ap.add_argument("--prompts", type=Path, help="your prompts instead of the three suites (JSON list or lines)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write-self-prompts", action="store_true")
    ap.add_argument("--exclude-data", type=Path, help="a distill run's data.pt (with --write-self-prompts)")
    ap.add_argument("--seed", type=int, default=100_000, help="first seed of --write-self-prompts")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "acceptance.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.write_self_prompts:
        if args.exclude_data is None:
            ap.error("--write-self-prompts needs --exclude-data DIR/data.pt (the training prompts to stay away from)")
        write_self_prompts(args.exclude_data, 96, args.seed)
        return
    model = {} if args.model is None else {"model": args.model}
    engine = build_engine(EngineConfig(**model, dtype=args.dtype, max_batch_size=8, max_seq_len=1024, speculation=
                                       SpeculationConfig(draft=args.draft, num_speculative_tokens=args.k)))
    rows = []
    for name, texts in suites(args.prompts).items():
        stats = SpecStats()
        prompts = [chat_ids(engine.tokenizer, t) for t in texts]
        for out in engine.generate(prompts, GenerationParams(max_tokens=args.max_tokens)):
            stats.merge(out.stats)
        rounds = stats.num_drafts
        shares = [n / rounds for n in stats.accepted_per_position] + [0.0] * args.k
        rows.append({"suite": name, "prompts": len(texts), "rounds": rounds,
                     "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
                     "accepted_per_position": [round(s, 4) for s in shares[: args.k]],
                     "estimated_length_by_k": {k: round(1 + sum(shares[:k]), 3) for k in range(1, args.k + 1)}})
    print(f"\ndraft={args.draft}, k={args.k}, greedy, {args.dtype}, {args.max_tokens} tokens")
    print(f"{'suite':10} {'prompts':>7} {'rounds':>7} {'mean acc len':>12}  accepted at 1..k (share of rounds)"
          "  estimated length at k = 1..k")
    for r in rows:
        shares = " / ".join(f"{s:.3f}" for s in r["accepted_per_position"])
        by_k = " / ".join(f"{v:.2f}" for v in r["estimated_length_by_k"].values())
        print(f"{r['suite']:10} {r['prompts']:>7} {r['rounds']:>7} {r['mean_acceptance_length']:>12.3f}  "
              f"{shares}  {by_k}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
