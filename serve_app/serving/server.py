"""The Serve deployment: a thin FastAPI ingress over the replica's engine loop.

Routes: POST /v1/completions, POST /v1/chat/completions (``stream: true`` = server-sent events
ending with ``data: [DONE]``), GET /v1/models, GET /health. Python callers use the deployment
handle's ``generate`` / ``generate_stream`` / ``workers`` methods (see README).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from serve_app.serving import openai_api as oa
from serve_app.serving.config import API_KEY_ENV, AppConfig
from serve_app.serving.engine_loop import EngineDeadError, EngineLoop
from serve_app.serving.frontend import OpenAIFrontend
from serve_app.serving.metrics import ServingMetrics
from serve_app.serving.replica import build_replica_engine

log = logging.getLogger(__name__)
app = FastAPI(title="serve_app: speculative decoding on Ray Serve")
RETRY_AFTER_S = 5  # busy, or a replica being replaced: worth trying again in a few seconds


@app.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    error = exc.errors()[0]
    if error.get("type") == "json_invalid":
        return JSONResponse(oa.error_body(f"malformed JSON body: {error.get('msg')}"), status_code=400)
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return JSONResponse(oa.error_body(f"{where}: {error.get('msg')}", param), status_code=400)


@app.exception_handler(oa.OpenAIError)
async def _openai_error(request: Request, exc: oa.OpenAIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _unavailable(exc: EngineDeadError) -> dict[str, Any]:
    body = oa.error_body(str(exc), type_="service_unavailable", code="service_unavailable")
    body["error"]["request_id"] = exc.request_id  # the key to the details in the replica's log
    return body


@app.exception_handler(EngineDeadError)
async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
    # Serve sets its own x-request-id header (its access log's key); the body names ours (the engine log's)
    return JSONResponse(_unavailable(exc), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except EngineDeadError as e:  # headers are sent: report in-band, then end the stream
        yield f"data: {json.dumps(_unavailable(e))}\n\n"
    yield "data: [DONE]\n\n"


def _streaming(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    return StreamingResponse(_sse(chunks), media_type="text/event-stream")


@serve.deployment(name="SpeculativeLLMServer")
@serve.ingress(app)
class SpeculativeLLMServer:
    def __init__(self, config: dict[str, Any]):
        self.config = AppConfig.model_validate(config)
        model_id = self.config.served_model_id
        self.metrics = ServingMetrics(model_id)
        self.replica = build_replica_engine(self.config, self.metrics)
        self.loop = EngineLoop(self.replica.engine, self.metrics, resume=self.replica.resume)
        self.api = OpenAIFrontend(self.loop, self.replica.tokenizer, model_id, self.config.engine.max_seq_len,
                                  self.config.deployment.max_queued_requests)
        key = self.config.api_key or os.environ.get(API_KEY_ENV) or None
        self.api_key = None if key is None else key.encode()

    def _authorize(self, authorization: str | None) -> None:
        """/v1 routes: the configured key as a bearer token (compared in constant time), else a 401."""
        if self.api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
            raise oa.OpenAIError(401, "invalid or missing API key: send it as 'Authorization: Bearer <key>'",
                                 type_="invalid_request_error", code="invalid_api_key")

    # ---- HTTP ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        if not self.loop.healthy:  # the cause is in the replica's log, not for whoever can reach the port
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        draft = self.replica.draft
        return JSONResponse({"status": "ok", "draft_available": draft.available if draft else None})

    @app.get("/v1/models")
    async def models(self, authorization: str | None = Header(None)) -> dict[str, Any]:
        self._authorize(authorization)
        return oa.models_body(self.config.served_model_id)

    @app.post("/v1/completions")
    async def completions(self, body: oa.CompletionRequest, authorization: str | None = Header(None)) -> Any:
        self._authorize(authorization)
        if body.stream:
            return _streaming(self.api.completion_stream(body))
        return await self.api.completion(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: oa.ChatCompletionRequest, authorization: str | None = Header(None)) -> Any:
        self._authorize(authorization)
        if body.stream:
            return _streaming(self.api.chat_stream(body))
        return await self.api.chat(body)

    # ---- Python handle callers ----------------------------------------------------------------
    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """A completion (``prompt``) or chat completion (``messages``) body -> the response body."""
        if "messages" in request:
            return await self.api.chat(oa.ChatCompletionRequest.model_validate(request))
        return await self.api.completion(oa.CompletionRequest.model_validate(request))

    async def generate_stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The same, streamed: yields the chunks an HTTP client would get as events."""
        if "messages" in request:
            chunks = self.api.chat_stream(oa.ChatCompletionRequest.model_validate(request))
        else:
            chunks = self.api.completion_stream(oa.CompletionRequest.model_validate(request))
        async for chunk in chunks:
            yield chunk

    async def workers(self) -> dict[str, dict[str, Any]]:
        """Where this replica's workers run now (pid, node, NeuronCores), asked of the live actors."""
        actors = {"target": self.replica.target}
        if self.replica.draft is not None and self.replica.draft.available:
            actors["draft"] = self.replica.draft.actor
        return {role: asdict(await actor.info.remote()) for role, actor in actors.items()}

    def check_health(self) -> None:
        if not self.loop.healthy:
            raise RuntimeError(f"engine failed: {self.loop.error}")
