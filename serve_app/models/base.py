"""What every model runner shares: its configuration, its load error, and the ``Runner`` protocol the
verifier and the proposers program against (``ModelRunner`` on torch, ``NeuronModelRunner`` on NxDI).

A runner owns one model and the KV state of the sequences it serves. It knows nothing of
speculation: callers append tokens to sequences and read logits back; rolling a sequence back is
``truncate``, a length change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from transformers import PreTrainedTokenizerBase

from serve_app.models.dtype import DType
from serve_app.models.neuron.spec import NeuronSpec

DTYPES: dict[DType, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """A model folder that cannot be served: unsupported architecture, missing or corrupt weights."""


@dataclass(frozen=True)
class RunnerConfig:
    """The slice of configuration a runner needs."""

    dtype: DType = "float32"
    max_batch_size: int = 8
    max_seq_len: int = 2048  # cached tokens per sequence (the KV cache capacity)
    device: str = "cpu"
    neuron: NeuronSpec | None = None  # set: the NxDI runner (backend: neuron) with this compiled model
    weights: Literal["model", "int8"] = "model"  # int8: linears with int8 weights (a draft's; models.avx2_linear)


@runtime_checkable
class Runner(Protocol):
    """The runner interface of the speculation layer. (The torch runner adds what an EAGLE head and
    its target need: ``prefill`` with features and taps, ``forward_hidden`` and ``hf_config``.)"""

    path: Path
    vocab_size: int
    weight_bytes: int  # what its weights hold (0 where torch's CPU threads do not compute its forward)

    @property
    def free_slots(self) -> int: ...

    def add(self, seq_id: str) -> None: ...

    def release(self, seq_id: str) -> None: ...

    def length(self, seq_id: str) -> int: ...

    def truncate(self, seq_id: str, length: int) -> None: ...

    def load_tokenizer(self) -> PreTrainedTokenizerBase: ...

    def prefill(self, seq_id: str, tokens: Sequence[int]) -> torch.Tensor | None: ...

    def forward(self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]],
                logits: Literal["last", "all"] = "last") -> torch.Tensor: ...


@runtime_checkable
class FeatureRunner(Runner, Protocol):
    """A runner that also returns hidden states: an EAGLE head, and the target it reads (torch only).
    ``taps``: the layers whose residual streams precede the final state (an EAGLE-3 head fuses them)."""

    hf_config: Any

    def prefill(self, seq_id: str, tokens: Sequence[int], features: torch.Tensor | None = None,
                taps: tuple[int, ...] = ()) -> torch.Tensor: ...

    def forward_hidden(self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]],
                       logits: Literal["last", "all"] = "last", features: torch.Tensor | None = None,
                       taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]: ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor: ...
