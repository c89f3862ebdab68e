"""A real local Ray cluster for the Serve tests (no mocks of Ray or Serve), and what they share.

The cluster emulates 8 NeuronCores (``resources={"neuron_cores": 8}``), so the draft and target
workers are placed exactly as on Trainium, and Ray assigns them NEURON_RT_VISIBLE_CORES. The
fixtures are module-scoped: each test module gets a cluster of its own (conftest re-exports them).
"""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest
import ray
from ray import serve

BASE = "http://127.0.0.1:8000"
MODEL = "tiny-qwen3"
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef mul(a, b):", "The quick brown fox jumps over", "dog dog dog"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_args(tiny_models, **over) -> dict:
    args = {
        "model_id": MODEL,
        "engine": {
            "model": str(tiny_models["qwen3"]), "dtype": "float32", "max_batch_size": 4, "max_seq_len": 256,
            "num_threads": 1,
            # fixed k: on tiny models a draft step costs what a target step does, so the default cost
            # model would rightly stop drafting, and these tests are about the draft worker's part
            "speculation": {"draft": str(tiny_models["qwen3_near"]), "num_speculative_tokens": 3,
                            "k_policy": "fixed"},
        },
        "placement": {"accelerator": "neuron_cores", "draft_cores": 1, "target_cores": 3,
                      "worker_cpus": 0.5, "replica_cpus": 0.2},
        "deployment": {"num_replicas": 1, "health_check_period_s": 1},
    }
    args.update(over)
    return args


@pytest.fixture(scope="module")
def metrics_port():
    return free_port()


@pytest.fixture(scope="module")
def cluster(metrics_port):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    os.environ["RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"] = "1"  # a replica that cannot start fails the deploy at once
    ray.init(num_cpus=8, resources={"neuron_cores": 8}, include_dashboard=False,
             _metrics_export_port=metrics_port, logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    yield
    serve.shutdown()
    ray.shutdown()


def complete(prompt, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, **kw}
    return httpx.post(f"{BASE}/v1/completions", json=body, timeout=120)


def sse_events(response: httpx.Response) -> list:
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def scrape(metrics_port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text


def scraped_when(metrics_port: int, condition) -> str | None:
    text = scrape(metrics_port)
    return text if condition(text) else None


def metric_value(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")
