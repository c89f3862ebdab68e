"""``serve run configs/local.yaml`` as a user runs it: on a fresh cluster it starts itself, and joining
a running cluster that emulates NeuronCores (``--address auto``). Real HTTP, the embedded model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300, check=check)


def stop_everything() -> None:
    sh(str(BIN / "serve"), "shutdown", "-y", check=False)
    sh(str(BIN / "ray"), "stop", "--force", check=False)


@pytest.fixture
def clean_machine():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    stop_everything()
    yield
    stop_everything()


def healthy() -> bool:
    return httpx.get("http://127.0.0.1:8000/health", timeout=2).json().get("status") == "ok"


def serve_run(*extra: str, config: str = "configs/local.yaml", ready=healthy,
              timeout_s: float = 240) -> tuple[subprocess.Popen, float]:
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)  # noqa: SIM115 - kept for the process
    start = time.monotonic()
    proc = subprocess.Popen([str(BIN / "serve"), "run", *extra, config], cwd=ROOT, env=ENV,
                            stdout=log, stderr=subprocess.STDOUT)
    while time.monotonic() < start + timeout_s:
        assert proc.poll() is None, Path(log.name).read_text()[-3000:]
        try:
            if ready():
                return proc, time.monotonic() - start
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    proc.terminate()
    tail = Path(log.name).read_text()[-3000:]
    raise AssertionError(f"serve run {config} was not ready in {timeout_s:.0f} s:\n{tail}")


def ask() -> dict:
    body = {"model": "smollm2-135m-instruct", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Repeat exactly: alpha beta gamma delta"}]}
    r = httpx.post("http://127.0.0.1:8000/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_serve_run_on_a_fresh_machine(clean_machine):
    """The README's quick start: HAProxy ingress, requests go straight to the replica's own HTTP server."""
    ENV["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    try:
        proc, seconds = serve_run()
    finally:
        del ENV["RAY_SERVE_ENABLE_HA_PROXY"]
    try:
        print(f"serve run answered /health after {seconds:.0f} s")
        out = ask()
        assert "alpha" in out["choices"][0]["message"]["content"].lower()
        assert out["speculation"]["num_draft_tokens"] > 0
        stop_while_streaming(proc)
    finally:
        proc.terminate()


def stop_while_streaming(proc: subprocess.Popen) -> None:
    """``python -m serve_app stop`` with a stream in flight: the stream completes in full (the replica
    drains), then serve run exits, the port is free and no Ray process is left."""
    import psutil

    events: list[dict] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 200,
                "ignore_eos": True, "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", "http://127.0.0.1:8000/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[len("data: "):]))
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    stopped = sh(sys.executable, "-m", "serve_app", "stop")
    assert f"serve run (pid {proc.pid}): " in stopped.stdout, stopped.stdout + stopped.stderr
    reader.join(timeout=60)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 200  # every token came, none was cut
    assert proc.poll() is not None
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", 8000)) != 0  # nothing listens any more
    left = [p.info["name"] for p in psutil.process_iter(["name"]) if p.info["name"] in ("raylet", "gcs_server")]
    assert not left, left


def test_serve_run_joins_a_cluster_with_emulated_neuron_cores(clean_machine):
    sh(str(BIN / "ray"), "start", "--head", "--num-cpus=4", '--resources={"neuron_cores": 8}', "--disable-usage-stats")
    proc, _ = serve_run("--address", "auto")
    try:
        out = ask()
        assert out["usage"]["completion_tokens"] > 0
        import ray
        from ray.util.state import list_actors

        ray.init(address="auto", logging_level="ERROR")
        try:
            alive = list_actors(filters=[("state", "=", "ALIVE")], detail=True)
            workers = [a for a in alive if a.class_name == "TargetWorker"]
            assert len(workers) == 1
            neuron = {k: v for k, v in workers[0].required_resources.items() if k.startswith("neuron_cores")}
            assert neuron and set(neuron.values()) == {6}  # target_cores in local.yaml, from its bundle
        finally:
            ray.shutdown()
    finally:
        proc.terminate()
