"""The Serve deployment: a replica's engine (built by an injectable factory), its engine loop, and
the HTTP app of ``http.py`` over them. Python callers use the deployment handle's ``generate`` /
``generate_stream`` / ``workers`` methods (see docs/api.md).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI
from ray import serve

from serve_app.serving import openai_api as oa
from serve_app.serving.config import AppConfig
from serve_app.serving.engine_loop import EngineLoop
from serve_app.serving.frontend import OpenAIFrontend
from serve_app.serving.http import build_http_app
from serve_app.serving.metrics import ReplicaMetrics, ServingMetrics
from serve_app.serving.replica import ReplicaEngine, build_replica_engine

log = logging.getLogger(__name__)
EngineFactory = Callable[[AppConfig, ReplicaMetrics], ReplicaEngine]


@serve.deployment(name="SpeculativeLLMServer")
@serve.ingress()
class SpeculativeLLMServer:
    def __init__(self, config: dict[str, Any], engine_factory: EngineFactory = build_replica_engine):
        """``engine_factory(config, metrics)``: the replica's workers and engine (Ray Serve LLM's
        pattern: the server takes its engine from a factory); the default starts the draft and target
        actors in the replica's placement group."""
        self.config = AppConfig.model_validate(config)
        model_id = self.config.served_model_id
        self.metrics = ServingMetrics(model_id)
        self.replica = engine_factory(self.config, self.metrics)
        self.loop = EngineLoop(self.replica.engine, self.metrics, resume=self.replica.resume)
        self.api = OpenAIFrontend(self.loop, self.replica.tokenizer, model_id, self.config.engine.max_seq_len,
                                  self.config.deployment.max_queued_requests)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(self.api, self.health, self.config.resolved_api_key())

    def health(self) -> dict[str, Any] | None:
        if not self.loop.healthy:
            return None
        draft = self.replica.draft
        return {"draft_available": draft.available if draft else None}

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
