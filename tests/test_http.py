"""The HTTP surface (serving/http.py) on an in-process engine with tiny models: no Ray cluster, so
every route, error body, stream, key and busy answer is checked in seconds. What needs Ray (actors,
placement, worker failures, Serve) is in test_serve_app.py and test_faults.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from serve_app.engine.engine import RequestError
from serve_app.engine.request import GenerationParams
from serve_app.serving import openai_api as oa
from serve_app.serving.engine_loop import EngineLoop
from serve_app.serving.frontend import OpenAIFrontend
from serve_app.serving.http import build_http_app
from serve_app.speculation.policy import FixedPolicy, Row
from tests.helpers import engine_for, hf_greedy

MODEL = "tiny-qwen3"
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef mul(a, b):", "The quick brown fox jumps over", "dog dog dog"]
KEY = "s3cret-key-for-tests"


def make_client(tiny_models, max_queued=None, api_key=None, batch=4) -> TestClient:
    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=batch)
    loop = EngineLoop(engine)
    api = OpenAIFrontend(loop, engine.tokenizer, MODEL, engine.max_seq_len, max_queued)
    return TestClient(build_http_app(api, lambda: {"draft_available": True} if loop.healthy else None, api_key))


@pytest.fixture(scope="module")
def client(tiny_models):
    with make_client(tiny_models) as c:
        yield c


def complete(client, prompt, **kw):
    return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 24,
                                                "temperature": 0, **kw})


def sse_events(response) -> list:
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_greedy_completions_equal_transformers_and_speculation_took_part(client, tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    for prompt in PROMPTS:
        want = hf_greedy(tiny_models["qwen3"], tokenizer.encode(prompt), 24)
        body = complete(client, prompt).json()
        assert body["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == len(want)
        assert body["speculation"]["num_draft_tokens"] > 0
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert client.get("/health").json() == {"status": "ok", "draft_available": True}


def test_streaming_equals_non_streaming(client):
    for prompt in PROMPTS:
        whole = complete(client, prompt).json()
        events = sse_events(complete(client, prompt, stream=True, stream_options={"include_usage": True}))
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert text == whole["choices"][0]["text"]
        assert events[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
        assert events[-1]["usage"] == whole["usage"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 20,
            "temperature": 0}
    whole = client.post("/v1/chat/completions", json=chat).json()
    events = sse_events(client.post("/v1/chat/completions", json={**chat, "stream": True}))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == whole["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "x"}, 400, "model"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x " * 400, "max_tokens": 4}, 400, "prompt"),
        ({"model": "gpt-17", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ({"model": MODEL, "prompt": "x", "n": 3}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "num_speculative_tokens": 99}, 400, "num_speculative_tokens"),
        ({"model": MODEL, "prompt": [1, 2, 10**7]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "x", "suffix": "end"}, 400, "suffix"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client, body, status, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert complete(client, "ok", max_tokens=2).status_code == 200


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("functions", [{"name": "f"}]),
    ("response_format", {"type": "json_object"}),
    ("top_logprobs", 3),
])
def test_openai_features_it_lacks_are_refused_not_ignored(client, field, value):
    """A client asking for a tool call or JSON must not get a 200 and plain text it takes for one."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and "not supported" in r.json()["error"]["message"]
    neutral = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
               "response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "user": "u1"}
    assert client.post("/v1/chat/completions", json=neutral).status_code == 200


def test_malformed_json_and_bad_chat(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    bad_role = {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}
    r = client.post("/v1/chat/completions", json=bad_role)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert complete(client, "ok", max_tokens=2).status_code == 200




def test_an_api_key_guards_every_v1_route_and_leaves_health_open(tiny_models):
    with make_client(tiny_models, api_key=KEY) as c:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong-key-xxxx"}, {"Authorization": KEY}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key" and KEY not in r.text
        assert c.get("/v1/models").status_code == 401
        good = {"Authorization": f"Bearer {KEY}"}
        assert c.post("/v1/completions", json=body, headers=good).status_code == 200
        assert c.get("/v1/models", headers=good).status_code == 200
        assert c.get("/health").status_code == 200


def test_past_the_queue_bound_a_request_gets_a_fast_503_with_retry_after(tiny_models):
    """One KV slot, no room to wait: while a long stream holds the slot, the next request is refused."""
    long = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with make_client(tiny_models, max_queued=0, batch=1) as c, c.stream("POST", "/v1/completions", json=long) as held:
        next(held.iter_lines())  # it holds the slot now
        r = complete(c, "hi", max_tokens=2)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
        assert int(r.headers["retry-after"]) > 0


def test_a_request_error_names_its_field(tiny_models):
    engine = engine_for(tiny_models["qwen3"], draft="none", k=0, seq_len=64)
    for prompt, params, param in (([], GenerationParams(), "prompt"),
                                  ([1, 2], GenerationParams(max_tokens=0), "max_tokens"),
                                  ([1, 2], GenerationParams(max_tokens=100), "max_tokens"),
                                  ([1, 2], GenerationParams(method="draft"), "speculative_method")):
        with pytest.raises(RequestError) as e:
            engine.validate(prompt, params)
        assert e.value.param == param


def test_error_bodies_have_the_openai_shape():
    body = oa.error_body("bad", "max_tokens")
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens", "code": None}}
    assert set(oa.NEUTRAL) >= {"tools", "tool_choice", "functions", "response_format", "logit_bias"}


class DraftsForTwo(FixedPolicy):
    """Drafts for a batch of at most two (as a CPU's best k falls to 0 as the batch grows)."""

    def choose(self, rows: Sequence[Row], plain_overhead_hidden: bool = False) -> list[int]:
        return [r.cap if len(rows) <= 2 else 0 for r in rows]


def test_requests_sent_during_a_prefill_join_the_batch_its_round_is_decided_for(tiny_models):
    """Requests sent together reach the engine loop one by one, the rest arriving during the first's
    prefill: the loop takes them in before that step's round, so the draft is not handed a sequence for a
    batch that is about to grow past drafting. A client that leaves during the step frees its slot after
    the step (its sequence is in use until then); nothing is lost."""
    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=4)
    engine.policy = DraftsForTwo()
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = GenerationParams(max_tokens=12, ignore_eos=True)
    plain = engine.generate(prompts[:2], GenerationParams(max_tokens=12, method="none", ignore_eos=True))
    drafted: list[dict[str, int]] = []
    engine.on_round = lambda result, seconds: drafted.append(
        dict(zip(result.seq_ids, result.num_draft_tokens.tolist(), strict=True)))
    held_when_admitted: dict[str, bool] = {}
    admit = engine.deferral.admit

    def admitting(ready, running):
        admit(ready, running)
        held_when_admitted.update((r.request_id, r.request_id in engine.deferral.held) for r in ready)

    engine.deferral.admit = admitting
    loop = EngineLoop(engine)

    async def main() -> list[list[int]]:
        events = asyncio.get_running_loop()
        leaving = loop.submit(prompts[2], GenerationParams(max_tokens=200, ignore_eos=True), "leaving")
        await anext(leaving)
        later = []

        async def during_the_prefill() -> None:
            later.append(loop.submit(prompts[1], params, "second"))
            await leaving.aclose()  # its client goes away while the step holds its sequence

        add = engine.verifier.add_sequence

        def adding(seq_id, *args, **kw):
            out = add(seq_id, *args, **kw)
            if seq_id == "first":
                asyncio.run_coroutine_threadsafe(during_the_prefill(), events).result()
            return out

        engine.verifier.add_sequence = adding
        first = [out async for out in loop.submit(prompts[0], params, "first")][-1]
        second = [out async for out in later[0]][-1]
        return [first.token_ids, second.token_ids]

    assert asyncio.run(main()) == [p.token_ids for p in plain]
    assert held_when_admitted["first"]  # three about to run: the draft did not take it
    assert any(r.get("first") for r in drafted)  # the two left drafted
    assert "leaving" not in engine.running and engine.verifier.free_slots == 4
