"""A request's parameters, its running state, and what the engine reports back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from serve_app.config import SpeculationMethod
from serve_app.engine.stats import SpecStats
from serve_app.speculation.types import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class RequestError(ValueError):
    """A request the engine cannot take (too long, unknown method, ...); a client error. ``param``:
    the request field it is about (the OpenAI error body names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    method: SpeculationMethod | None = None  # None: the engine's configured proposer
    num_speculative_tokens: int | None = None  # None: the engine's default; 0: plain decoding


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only (an EOS that ended the request included)
    text: str
    finish_reason: FinishReason | None
    stats: SpecStats
    elapsed_s: float
    new_text: str = ""  # text added since the previous output of this request (for streaming)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": {**self.stats.as_dict(), "tokens_per_second": round(self.tokens_per_second, 2)},
        }


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    method: SpeculationMethod
    num_speculative_tokens: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_text_len: int = 0
    finish_reason: FinishReason | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None
    prefilled: int = 0  # context tokens cached on the target (chunked prefill)
    # Incremental detokenization (vLLM's prefix/read offsets): text is extended by decoding only the
    # tokens since ``prefix_offset``, never the whole output again.
    prefix_offset: int = 0  # decoding starts here, at the previous round's tokens, so the window decodes in context
    read_offset: int = 0  # tokens up to here are in ``text``

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def context_ids(self) -> list[int]:
        """What the target caches at admission: the prompt, plus the tokens generated before a
        target restart made the request start over (``Engine.requeue_admitted``)."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    def append(self, tokens: list[int], eos_ids: frozenset[int], tokenizer: PreTrainedTokenizerBase) -> None:
        """Take a round's new tokens one by one until a stop condition; later ones are dropped."""
        for token in tokens:
            self.output_ids.append(token)
            if not self.params.ignore_eos and token in eos_ids:
                self._finish("stop")
                break
            if self.params.stop and self._hit_stop_string(tokenizer):
                self._finish("stop")
                return  # text already cut before the stop string
            if len(self.output_ids) >= self.params.max_tokens:
                self._finish("length")
                break
        self._detokenize(tokenizer, final=self.finish_reason is not None)

    def _detokenize(self, tokenizer: PreTrainedTokenizerBase, final: bool = False) -> None:
        """Extend ``text`` by the tokens not decoded yet. A window that ends inside a multi-byte
        character decodes to a trailing U+FFFD: it waits for the next token unless ``final``."""
        if self.read_offset == len(self.output_ids):
            return
        before = str(tokenizer.decode(self.output_ids[self.prefix_offset: self.read_offset], skip_special_tokens=True))
        window = str(tokenizer.decode(self.output_ids[self.prefix_offset:], skip_special_tokens=True))
        if window.endswith("\ufffd") and not final:
            return
        self.text += window[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.output_ids)

    def _hit_stop_string(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        checked = len(self.text)
        self._detokenize(tokenizer)
        # Only the tail can hold a new match: the new text plus the longest stop string before it.
        tail_from = max(0, checked - max(len(s) for s in self.params.stop) + 1)
        for stop in self.params.stop:
            at = self.text.find(stop, tail_from)
            if at >= 0:
                self.text = self.text[:at]
                return True
        return False

    def _finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.finished_at = time.perf_counter()

    def abort(self) -> None:
        if self.finish_reason is None:
            self._finish("abort")

    def take_output(self) -> RequestOutput:
        new_text = self.text[self.emitted_text_len:]
        self.emitted_text_len = max(self.emitted_text_len, len(self.text))
        end = self.finished_at or time.perf_counter()
        return RequestOutput(
            self.request_id, self.prompt_ids, list(self.output_ids), self.text, self.finish_reason,
            self.stats, end - self.arrival, new_text,
        )
