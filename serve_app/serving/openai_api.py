"""OpenAI-compatible request and response bodies (completions, chat completions, models, errors).

Requests are validated by pydantic; what we cannot honour (n > 1, logprobs, penalties) is refused
with a 400 naming the field instead of being silently ignored. Extensions, as in vLLM:
``top_k``, ``ignore_eos``, ``num_speculative_tokens`` (0 = plain decoding for this request) and
``speculative_method``; responses carry per-request speculation stats in ``speculation``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from serve_app.config import MAX_SPECULATIVE_TOKENS, SpeculationMethod
from serve_app.engine.request import GenerationParams, RequestOutput
from serve_app.speculation.types import SamplingParams


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.param, self.type, self.code)


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI fields this server does not implement, with the values that ask for nothing: any other value
# is refused with a 400 naming the field, so that a client asking for JSON, a tool call or log
# probabilities never believes it got one.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
    "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "top_logprobs": (None, 0),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "suffix": (None, ""),
}


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored, as OpenAI clients send extras
    (``user``, ``metadata``); the OpenAI features in ``NEUTRAL`` are refused unless neutral."""

    model_config = ConfigDict(extra="ignore")

    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logit_bias: Any = None
    top_logprobs: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    suffix: Any = None

    @field_validator(*NEUTRAL, mode="before")
    @classmethod
    def _not_implemented(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in NEUTRAL[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported by this server (it generates plain text: no "
                             "tool calls, no JSON mode, no log probabilities); omit it")
        return v

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="extension; 0 or -1 = off")
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: must be 0")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: must be 0")
    ignore_eos: bool = False
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    speculative_method: SpeculationMethod | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    def generation_params(self, max_tokens: int) -> GenerationParams:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return GenerationParams(
            max_tokens=max_tokens,
            sampling=SamplingParams(self.temperature, self.top_p, max(self.top_k, 0), self.seed),
            stop=stops,
            ignore_eos=self.ignore_eos,
            method=self.speculative_method,
            num_speculative_tokens=self.num_speculative_tokens,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(..., min_length=1)
    max_tokens: int = Field(16, ge=1)
    logprobs: None = None
    echo: Literal[False] = False
    best_of: int | None = Field(None, ge=1, le=1)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(400, "only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Literal[False] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses ----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(out: RequestOutput) -> dict[str, int]:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculation(out: RequestOutput) -> dict[str, Any]:
    return {**out.stats.as_dict(), "tokens_per_second": round(out.tokens_per_second, 2)}


def completion_body(request_id: str, model: str, out: RequestOutput) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": None}],
        "usage": usage(out), "speculation": speculation(out),
    }


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }


def chat_body(request_id: str, model: str, out: RequestOutput) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                     "finish_reason": out.finish_reason, "logprobs": None}],
        "usage": usage(out), "speculation": speculation(out),
    }


def chat_chunk(request_id: str, model: str, delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


def usage_chunk(request_id: str, model: str, obj: str, out: RequestOutput) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(out), "speculation": speculation(out)}


def models_body(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "serve_app"}]}
