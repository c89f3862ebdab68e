"""Soak: concurrent streams against `serve run` for minutes, optionally killing workers meanwhile.

Starts ``RAY_SERVE_ENABLE_HA_PROXY=1 serve run CONFIG`` (a cluster of its own), keeps
``--concurrency`` streaming chat requests in flight for ``--minutes`` (mixed prompts, max_tokens
drawn from 16..``--max-tokens``, greedy), and with ``--kill-target-every S`` / ``--kill-draft-every S``
SIGKILLs the replica's target / draft worker every S seconds. Every request ends as one of:

- ``served``: HTTP 200 and a complete stream (a finish_reason, then ``[DONE]``, no in-band error);
- ``refused``: a 503 before anything was accepted (the queue bound; the client may retry);
- ``lost``: accepted, then an in-band error, a cut stream or a connection error: what must be 0.

    python -m benchmarks.bench_soak [--config configs/local.yaml] [--minutes 3] [--concurrency 16]
        [--kill-target-every 60] [--kill-draft-every 0]

Prints a table (requests per outcome, p50/p99 request latency and time to first token, output
tok/s, the longest pause inside a stream) and writes ``benchmarks/results/soak.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness import HERE, PORT, chat_prompts, ensure_down, model_folder, serve_run, stop, wait_ready


async def one_request(client: httpx.AsyncClient, model_id: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model_id, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    start_t = time.monotonic()
    row = {"outcome": "lost", "tokens": 0, "ttft": None, "latency": None, "pause": 0.0, "error": None}
    last = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code == 503:
                await r.aread()
                row["outcome"] = "refused"
                return row
            if r.status_code != 200:
                row["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return row
            finished, done = False, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    row["error"] = event["error"].get("code") or event["error"].get("type")
                    continue
                now = time.monotonic()
                if row["ttft"] is None:
                    row["ttft"] = now - start_t
                if last is not None:
                    row["pause"] = max(row["pause"], now - last)
                last = now
                choice = event["choices"][0]
                row["tokens"] += bool(choice["delta"].get("content"))
                finished = finished or choice.get("finish_reason") is not None
            if finished and done and row["error"] is None:
                row["outcome"] = "served"
    except httpx.HTTPError as e:
        row["error"] = f"{type(e).__name__}: {e}"
    row["latency"] = time.monotonic() - start_t
    return row


async def load(model_id: str, prompts: list[str], concurrency: int, seconds: float, max_tokens: int) -> list[dict]:
    rows: list[dict] = []
    deadline = time.monotonic() + seconds
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=600) as client:
        async def stream_forever(i: int) -> None:
            while time.monotonic() < deadline:
                prompt = prompts[rng.randrange(len(prompts))]
                row = await one_request(client, model_id, prompt, rng.randint(16, max_tokens))
                rows.append(row)
                if row["outcome"] == "refused":
                    await asyncio.sleep(1.0)  # what Retry-After asks, shortened

        await asyncio.gather(*(stream_forever(i) for i in range(concurrency)))
    return rows


async def killer(role: str, every_s: float, seconds: float, kills: list[dict]) -> None:
    """SIGKILL the replica's ``role`` worker every ``every_s`` seconds."""
    import ray
    from ray.util.state import list_actors

    cls = {"target": "TargetWorker", "draft": "DraftWorker"}[role]
    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() + every_s < deadline:
            await asyncio.sleep(every_s)
            alive = list_actors(filters=[("class_name", "=", cls), ("state", "=", "ALIVE")], detail=True)
            for actor in alive:
                os.kill(actor.pid, signal.SIGKILL)
                at_s = round(seconds - (deadline - time.monotonic()), 1)
                kills.append({"role": role, "pid": actor.pid, "at_s": at_s})
    finally:
        ray.shutdown()


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarize(rows: list[dict], seconds: float) -> dict:
    served = [r for r in rows if r["outcome"] == "served"]
    lat = [r["latency"] for r in served]
    ttft = [r["ttft"] for r in served if r["ttft"] is not None]
    return {
        "requests": len(rows), "served": len(served), "refused": sum(r["outcome"] == "refused" for r in rows),
        "lost": sum(r["outcome"] == "lost" for r in rows),
        "lost_errors": sorted({str(r["error"]) for r in rows if r["outcome"] == "lost"})[:10],
        "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "output_tok_s": sum(r["tokens"] for r in served) / seconds,
        "longest_pause_s": max((r["pause"] for r in served), default=0.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=HERE.parent / "configs/local.yaml")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--kill-target-every", type=float, default=0.0, help="seconds between target kills (0: none)")
    ap.add_argument("--kill-draft-every", type=float, default=0.0, help="seconds between draft kills (0: none)")
    ap.add_argument("--out", type=Path, default=HERE / "results/soak.json")
    args = ap.parse_args()

    ensure_down()
    model_id, _, _ = model_folder(args.config)
    workdir = Path(tempfile.mkdtemp(prefix="bench_soak_"))
    log = workdir / "serve.log"
    proc = serve_run(args.config, log)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    seconds = args.minutes * 60
    kills: list[dict] = []
    try:
        print(f"serve run ready after {wait_ready(proc, log, 300):.0f} s; log {log}", flush=True)

        async def run() -> list[dict]:
            tasks = [killer(role, every, seconds, kills) for role, every in
                     (("target", args.kill_target_every), ("draft", args.kill_draft_every)) if every > 0]
            rows, *_ = await asyncio.gather(load(model_id, chat_prompts(64), args.concurrency, seconds,
                                                 args.max_tokens), *tasks)
            return rows

        rows = asyncio.run(run())
    finally:
        stop(proc, True)
    summary = {"config": str(args.config), "minutes": args.minutes, "concurrency": args.concurrency,
               "kills": kills, **summarize(rows, seconds), "date": time.strftime("%Y-%m-%d %H:%M")}
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print("| requests | served | refused | lost | latency p50 / p99 s | TTFT p50 / p99 s | out tok/s | "
          "longest pause s | kills |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {summary['requests']} | {summary['served']} | {summary['refused']} | {summary['lost']} | "
          f"{fmt(summary['latency_p50_s'])} / {fmt(summary['latency_p99_s'])} | {fmt(summary['ttft_p50_s'])} / "
          f"{fmt(summary['ttft_p99_s'])} | {summary['output_tok_s']:.1f} | {summary['longest_pause_s']:.2f} | "
          f"{len(kills)} |")
    if summary["lost"]:
        print("lost:", summary["lost_errors"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
