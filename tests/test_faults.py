"""Faults on the real Ray cluster (``pytest -m faults`` runs them alone): a worker SIGKILLed mid-stream,
clients that hang up, overload, missing or wrong API keys, and what error bodies may say.

Each test brings up its own app on the module's cluster (tests/serve_cluster.py) with tiny models.
``benchmarks/bench_soak.py`` is the long-running counterpart (concurrent streams for minutes).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
from ray import serve

from serve_app.builder import ConfigError, build_app, parse_config
from serve_app.serving import metrics
from tests.serve_cluster import BASE, MODEL, PROMPTS, app_args, complete, metric_value, scraped_when, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

STREAMS = 8
LEAKS = re.compile(r"actor|pid|\bip\b|\d+\.\d+\.\d+\.\d+|Traceback|File \"|node", re.IGNORECASE)


@pytest.fixture(scope="module")
def server(cluster, tiny_models):
    """Eight KV slots, so eight streams run in one batch."""
    args = app_args(tiny_models)
    args["engine"] = {**args["engine"], "max_batch_size": STREAMS, "max_seq_len": 512}
    serve.run(build_app(args), name="faults", route_prefix="/")
    yield serve.get_app_handle("faults")
    serve.delete("faults")


def stream_completion(prompt: str, events: list, max_tokens: int) -> None:
    """Stream one completion; append (arrival time, event) for every server-sent event."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append((time.monotonic(), json.loads(line[len("data: "):])))


def test_a_dead_target_worker_pauses_streams_and_every_one_completes_as_if_undisturbed(server, metrics_port):
    """SIGKILL of the target worker with 8 greedy streams in flight: a new target worker starts in the
    same bundle, each request re-prefills its prompt plus what it was sent and goes on; every stream
    completes, token for token the same as the same request undisturbed, and no stream sees an error."""
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(STREAMS)]
    max_tokens = 400
    undisturbed: list[list] = [[] for _ in prompts]
    threads = [threading.Thread(target=stream_completion, args=(p, e, max_tokens))
               for p, e in zip(prompts, undisturbed, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)

    target_pid = server.workers.remote().result()["target"]["pid"]
    disturbed: list[list] = [[] for _ in prompts]
    threads = [threading.Thread(target=stream_completion, args=(p, e, max_tokens))
               for p, e in zip(prompts, disturbed, strict=True)]
    for t in threads:
        t.start()
    wait_for(lambda: all(len(e) >= 2 for e in disturbed), 120, interval=0.01)  # every stream under way
    killed_at = time.monotonic()
    os.kill(target_pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)

    def text(events: list) -> str:
        assert not any("error" in e for _, e in events), [e for _, e in events if "error" in e]
        assert events[-1][1]["choices"][0]["finish_reason"] == "length"
        return "".join(e["choices"][0]["text"] for _, e in events)

    for before, after in zip(undisturbed, disturbed, strict=True):
        assert text(after) == text(before)
    cut_short = sum(any(at > killed_at for at, _ in e) for e in disturbed)
    assert cut_short == STREAMS  # every stream was still going when the worker died
    resume_s = max(max(b - a for (a, _), (b, _) in zip(e, e[1:], strict=False)) for e in disturbed)
    print(f"\ntime to resume (the longest pause a client saw): {resume_s:.2f} s")
    assert server.workers.remote().result()["target"]["pid"] != target_pid
    text_ = wait_for(lambda: scraped_when(
        metrics_port, lambda t: metric_value(t, "ray_serve_app_target_worker_restarts") >= 1), 60)
    assert 'outcome="resumed"' in text_


def test_a_target_that_cannot_come_back_fails_requests_fast_saying_only_what_to_do(cluster, tiny_models):
    """With resuming off (target_restart_timeout_s: 0) a dead target fails its requests at once: a 503
    service_unavailable, Retry-After, the request id, and nothing of the cause; Serve then replaces the
    replica."""
    args = app_args(tiny_models, deployment={"num_replicas": 1, "health_check_period_s": 1,
                                              "target_restart_timeout_s": 0})
    args["engine"] = {**args["engine"], "speculation": {"draft": "none"}}
    args["placement"] = {**args["placement"], "target_cores": 1}
    serve.run(build_app(args), name="fragile", route_prefix="/fragile")
    handle = serve.get_app_handle("fragile")
    try:
        target_pid = handle.workers.remote().result()["target"]["pid"]
        os.kill(target_pid, signal.SIGKILL)
        start = time.monotonic()
        r = httpx.post(f"{BASE}/fragile/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0})
        assert time.monotonic() - start < 60  # never hangs: an error now, or a new replica's answer
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            error = r.json()["error"]
            assert error["type"] == "service_unavailable" and "retry" in error["message"]
            assert r.headers["retry-after"] and error["request_id"].startswith("cmpl-")
            assert not LEAKS.search(r.text) and str(target_pid) not in r.text

        def replaced():
            r = httpx.post(f"{BASE}/fragile/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8})
            return r.status_code == 200 and handle.workers.remote().result()["target"]["pid"] != target_pid

        wait_for(replaced, 120, interval=1)
    finally:
        serve.delete("fragile")


def test_clients_that_hang_up_mid_stream_free_their_slots(server, metrics_port):
    """Eight long streams whose clients leave after a few tokens: the replica aborts them, so nothing
    runs on and the next requests get every slot at once."""
    def leave_early() -> None:
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=120) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    return  # closes the connection mid-stream

    threads = [threading.Thread(target=leave_early) for _ in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    wait_for(lambda: scraped_when(metrics_port, lambda t: "ray_serve_app_num_requests_running" in t
                                  and metric_value(t, "ray_serve_app_num_requests_running") == 0), 30)
    assert all(complete(p, max_tokens=8).status_code == 200 for p in PROMPTS)


def test_no_error_body_names_an_actor_a_pid_an_address_or_a_traceback(server):
    """Every kind of error a client can get, grepped for internals."""
    bodies = [
        complete(PROMPTS[0], max_tokens=0),
        complete(PROMPTS[0], max_tokens=10_000),
        complete(PROMPTS[0], model="other"),
        complete(PROMPTS[0], tools=[{"type": "function", "function": {"name": "f"}}]),
        complete(PROMPTS[0], speculative_method="nope"),
        httpx.post(f"{BASE}/v1/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"}),
        httpx.post(f"{BASE}/v1/chat/completions", json={"model": MODEL, "messages": "hi"}, timeout=60),
    ]
    for r in bodies:
        assert 400 <= r.status_code < 500, r.text
        assert set(r.json()) == {"error"} and not LEAKS.search(r.text), r.text


def test_a_dead_draft_worker_never_fails_a_request(server, metrics_port):
    draft_pid = server.workers.remote().result()["draft"]["pid"]
    os.kill(draft_pid, signal.SIGKILL)
    results = []

    def call(prompt):
        results.append(complete(prompt, max_tokens=20))

    threads = [threading.Thread(target=call, args=(p,)) for p in PROMPTS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 6 and all(r.status_code == 200 for r in results)
    assert all(r.json()["usage"]["completion_tokens"] > 0 for r in results)
    text = wait_for(lambda: scraped_when(
        metrics_port, lambda t: metric_value(t, "ray_serve_app_draft_worker_failures") >= 1), 60)
    assert "ray_serve_app_draft_worker_failures" in text

    def draft_back():  # a restarted draft serves new requests again
        body = complete(PROMPTS[0], max_tokens=12).json()
        return body["speculation"]["num_draft_tokens"] > 0 and httpx.get(f"{BASE}/health").json()["draft_available"]

    wait_for(draft_back, 90, interval=1)
    assert server.workers.remote().result()["draft"]["pid"] != draft_pid


def test_an_api_key_guards_every_v1_route_and_leaves_health_open(cluster, tiny_models, server):
    args = app_args(tiny_models, api_key="s3cret-key-for-tests")
    args["engine"] = {**args["engine"], "speculation": {"draft": "none"}}
    args["placement"] = {**args["placement"], "target_cores": 1}
    serve.run(build_app(args), name="keyed", route_prefix="/keyed")
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong-key-xxxx"}, {"Authorization": "s3cret-key-for-tests"}):
            r = httpx.post(f"{BASE}/keyed/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key" and "s3cret" not in r.text
        assert httpx.get(f"{BASE}/keyed/v1/models", timeout=60).status_code == 401
        good = {"Authorization": "Bearer s3cret-key-for-tests"}
        assert httpx.post(f"{BASE}/keyed/v1/completions", json=body, headers=good, timeout=60).status_code == 200
        assert httpx.get(f"{BASE}/keyed/v1/models", headers=good, timeout=60).status_code == 200
        assert httpx.get(f"{BASE}/keyed/health", timeout=60).status_code == 200  # probes need no key
        assert complete("ok", max_tokens=2).status_code == 200  # an app without a key stays open
    finally:
        serve.delete("keyed")
    with pytest.raises(ConfigError, match="api_key"):
        parse_config({"api_key": "short"})


def test_overload_gets_a_fast_503_with_retry_after(cluster, tiny_models, server):
    """One KV slot and room for one waiting request: of six at once, some are refused at once."""
    args = app_args(tiny_models, deployment={"num_replicas": 1, "max_queued_requests": 1})
    args["engine"] = {**args["engine"], "max_batch_size": 1, "speculation": {"draft": "none"}}
    args["placement"] = {**args["placement"], "target_cores": 1}
    serve.run(build_app(args), name="busy", route_prefix="/busy")
    results = []

    def call() -> None:
        start = time.monotonic()
        r = httpx.post(f"{BASE}/busy/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 48, "ignore_eos": True})
        results.append((r, time.monotonic() - start))

    try:
        threads = [threading.Thread(target=call) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        serve.delete("busy")
    refused = [(r, s) for r, s in results if r.status_code == 503]
    assert len(results) == 6 and refused and any(r.status_code == 200 for r, _ in results)
    for r, _ in results:  # nothing that was accepted is lost
        assert r.status_code in (200, 503), r.text
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 48
    for r, seconds in refused:
        assert r.json()["error"]["code"] == "server_busy" and int(r.headers["retry-after"]) > 0
        assert seconds < 1 and not LEAKS.search(r.text)




def test_every_metric_the_docs_name_is_exported(server, metrics_port):
    """Last in this module: by now a draft and a target worker have died and been replaced here, so
    every metric of ``serving/metrics.py`` has been written at least once."""
    names = set(re.findall(r"``(serve_app_[a-z_]+)``", metrics.__doc__))
    assert len(names) > 12
    complete(PROMPTS[0], max_tokens=8)
    text = wait_for(lambda: scraped_when(metrics_port, lambda t: all(f"ray_{n}" in t for n in names)), 60)
    assert text
