"""The HTTP surface: a FastAPI app over a replica's OpenAI frontend, built without Ray, so its routes
are tested on an in-process engine (``tests/test_http.py``) and served by the Serve deployment
(``server.py``) alike.

Routes: POST /v1/completions, POST /v1/chat/completions (``stream: true`` = server-sent events
ending with ``data: [DONE]``), GET /v1/models, GET /health.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from serve_app.serving import openai_api as oa
from serve_app.serving.engine_loop import EngineDeadError
from serve_app.serving.frontend import OpenAIFrontend

RETRY_AFTER_S = 5  # busy, or a replica being replaced: worth trying again in a few seconds


def unavailable_body(exc: EngineDeadError) -> dict[str, Any]:
    body = oa.error_body(str(exc), type_="service_unavailable", code="service_unavailable")
    body["error"]["request_id"] = exc.request_id  # the key to the details in the replica's log
    return body


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except EngineDeadError as e:  # headers are sent: report in-band, then end the stream
        yield f"data: {json.dumps(unavailable_body(e))}\n\n"
    yield "data: [DONE]\n\n"


def check_api_key(authorization: str | None, key: bytes | None) -> None:
    """The configured key as a bearer token, compared in constant time; ``key`` None: no authentication.
    Raises a 401 ``OpenAIError`` (also used by the vLLM engine's ingress)."""
    if key is None:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
        raise oa.OpenAIError(401, "invalid or missing API key: send it as 'Authorization: Bearer <key>'",
                             type_="invalid_request_error", code="invalid_api_key")


def _streaming(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    return StreamingResponse(_sse(chunks), media_type="text/event-stream")


def build_http_app(api: OpenAIFrontend, health: Callable[[], dict[str, Any] | None],
                   api_key: str | None = None) -> FastAPI:
    """``health()``: the /health body, or None when the replica is unhealthy (503, cause in the log).
    ``api_key``: every /v1 route wants it as a bearer token (401 otherwise); None: no authentication."""
    app = FastAPI(title="serve_app: speculative decoding on Ray Serve")
    key = None if api_key is None else api_key.encode()

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

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        # Serve sets its own x-request-id header (its access log's key); the body names ours (the engine log's)
        return JSONResponse(unavailable_body(exc), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/health")
    async def health_route() -> JSONResponse:
        body = health()
        if body is None:  # the cause is in the replica's log, not for whoever can reach the port
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok", **body})

    @app.get("/v1/models")
    async def models(authorization: str | None = Header(None)) -> dict[str, Any]:
        check_api_key(authorization, key)
        return oa.models_body(api.model_id)

    @app.post("/v1/completions")
    async def completions(body: oa.CompletionRequest, authorization: str | None = Header(None)) -> Any:
        check_api_key(authorization, key)
        if body.stream:
            return _streaming(api.completion_stream(body))
        return await api.completion(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: oa.ChatCompletionRequest, authorization: str | None = Header(None)) -> Any:
        check_api_key(authorization, key)
        if body.stream:
            return _streaming(api.chat_stream(body))
        return await api.chat(body)

    return app
