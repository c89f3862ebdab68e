"""Attention of a few queries a sequence (a decode step, a verified block) over the bfloat16 KV cache,
in one C++ kernel (``decode_attention.cpp``) on an AVX2 + FMA CPU.

Why: in bfloat16, ``attend``'s torch path converts each layer's cached keys and values to float32,
multiplies with ``baddbmm`` / ``bmm`` (batched matmuls of a few rows each, far from their peak) and
copies between them; at 16 sequences of 250 cached tokens that was about 20 ms of a 1.5 B target's
decode step and half of SmolLM2-135M's. The kernel reads each sequence's cache once per kv head, in
float32 from then on, and writes the output in the layout the output projection reads.

Each query row is computed alone, in an order that does not depend on the rows, keys or sequences
batched with it (see the .cpp), so a verified block gives each token the bits of its own decode step.
Used for blocks of up to ``MAX_QUERIES`` tokens a sequence and head dims that are multiples of 64; a
prefill keeps torch's matmuls, which are at their best there.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from serve_app.models.avx2_linear import build

SOURCE = Path(__file__).with_name("decode_attention.cpp")
MAX_QUERIES = 16  # query tokens a sequence: a decode step or a verified block of up to 15 drafts


@functools.cache
def extension() -> ModuleType | None:
    return build("serve_app_decode_attention", SOURCE, "bfloat16 attention uses torch's batched matmuls")


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel runs this attention: q ``[batch, heads, T, head_dim]`` in bfloat16 on the CPU."""
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[2] <= MAX_QUERIES
            and q.shape[3] % 64 == 0 and extension() is not None)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q ``[batch, heads, T, d]``, keys and values ``[batch, kv_heads, L, d]`` (bfloat16), mask ``[batch, 1,
    T, L]`` (bool: query t sees key l). Returns ``[batch, heads, T, d]``, a view of ``[batch, T, heads, d]``."""
    ext = extension()
    assert ext is not None
    return ext.attend(q, keys, values, mask[:, 0], q.shape[-1] ** -0.5).transpose(1, 2)
