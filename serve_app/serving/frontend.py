"""The OpenAI surface of a replica, independent of HTTP: requests in, response bodies or chunk
streams out. The Serve deployment maps routes onto it; Python handle callers use it too."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from transformers import PreTrainedTokenizerBase

from serve_app.engine.engine import RequestError
from serve_app.engine.request import RequestOutput
from serve_app.serving import openai_api as oa
from serve_app.serving.engine_loop import EngineLoop


class OpenAIFrontend:
    def __init__(self, loop: EngineLoop, tokenizer: PreTrainedTokenizerBase, model_id: str, max_seq_len: int,
                 max_queued: int | None = None):
        self.loop, self.tokenizer, self.model_id, self.max_seq_len = loop, tokenizer, model_id, max_seq_len
        self.max_queued = max_queued

    def _check_model(self, model: str) -> None:
        if model != self.model_id:
            raise oa.OpenAIError(404, f"model {model!r} does not exist; this server serves {self.model_id!r}",
                                 "model", code="model_not_found")

    def _submit(self, request_id: str, prompt_ids: list[int], req: oa.SamplingFields, max_tokens: int | None,
                ) -> AsyncIterator[RequestOutput]:
        if len(prompt_ids) >= self.max_seq_len:
            raise oa.OpenAIError(400, f"the prompt has {len(prompt_ids)} tokens; the context is "
                                 f"{self.max_seq_len} tokens", "prompt" if isinstance(req, oa.CompletionRequest)
                                 else "messages", code="context_length_exceeded")
        if max_tokens is None:  # chat default: the rest of the context
            max_tokens = self.max_seq_len - len(prompt_ids)
        if self.max_queued is not None and self.loop.num_waiting >= self.max_queued:
            raise oa.OpenAIError(503, f"this replica is busy ({self.loop.num_waiting} requests waiting); retry shortly",
                                 type_="service_unavailable", code="server_busy")
        try:
            return self.loop.submit(prompt_ids, req.generation_params(max_tokens), request_id)
        except RequestError as e:
            chat = not isinstance(req, oa.CompletionRequest)
            raise oa.OpenAIError(400, str(e), "messages" if chat and e.param == "prompt" else e.param) from e

    # ---- completions --------------------------------------------------------------------------
    def _completion_ids(self, req: oa.CompletionRequest) -> list[int]:
        self._check_model(req.model)
        if isinstance(req.prompt, str):
            return self.tokenizer.encode(req.prompt)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in req.prompt):
            raise oa.OpenAIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(req.prompt)

    async def completion(self, req: oa.CompletionRequest) -> dict[str, Any]:
        request_id = oa.new_id("cmpl")
        out = await _last(self._submit(request_id, self._completion_ids(req), req, req.max_tokens))
        return oa.completion_body(request_id, self.model_id, out)

    def completion_stream(self, req: oa.CompletionRequest) -> AsyncIterator[dict[str, Any]]:
        request_id = oa.new_id("cmpl")
        outputs = self._submit(request_id, self._completion_ids(req), req, req.max_tokens)
        return self._completion_chunks(request_id, outputs, req)

    async def _completion_chunks(self, request_id: str, outputs: AsyncIterator[RequestOutput],
                                 req: oa.CompletionRequest) -> AsyncIterator[dict[str, Any]]:
        async for out in outputs:
            if out.new_text or out.finished:
                yield oa.completion_chunk(request_id, self.model_id, out.new_text, out.finish_reason)
            if out.finished and req.stream_options and req.stream_options.include_usage:
                yield oa.usage_chunk(request_id, self.model_id, "text_completion", out)

    # ---- chat ---------------------------------------------------------------------------------
    def _chat_ids(self, req: oa.ChatCompletionRequest) -> list[int]:
        self._check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        if self.tokenizer.chat_template is None:
            raise oa.OpenAIError(400, "this model has no chat template; use /v1/completions", "messages")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    async def chat(self, req: oa.ChatCompletionRequest) -> dict[str, Any]:
        request_id = oa.new_id("chatcmpl")
        out = await _last(self._submit(request_id, self._chat_ids(req), req, req.requested_max_tokens()))
        return oa.chat_body(request_id, self.model_id, out)

    def chat_stream(self, req: oa.ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        request_id = oa.new_id("chatcmpl")
        outputs = self._submit(request_id, self._chat_ids(req), req, req.requested_max_tokens())
        return self._chat_chunks(request_id, outputs, req)

    async def _chat_chunks(self, request_id: str, outputs: AsyncIterator[RequestOutput],
                           req: oa.ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        # The role goes with the first text, as vLLM sends it: the first chunk is the first token, so a
        # client's time to first token is true.
        role: dict[str, str] = {"role": "assistant"}
        async for out in outputs:
            if out.new_text or (role and out.finished):
                yield oa.chat_chunk(request_id, self.model_id, {**role, "content": out.new_text}, None)
                role = {}
            if out.finished:
                yield oa.chat_chunk(request_id, self.model_id, {}, out.finish_reason)
                if req.stream_options and req.stream_options.include_usage:
                    yield oa.usage_chunk(request_id, self.model_id, "chat.completion.chunk", out)


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in outputs:
        last = out
    assert last is not None, "a request ends with a finished output"
    return last
