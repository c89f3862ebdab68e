"""Linear layers with weights packed once at load time, for bfloat16 on CPU.

Two kernels, by what the CPU does natively (``linear_kernel``):
- ``onednn``: where it converts bfloat16 natively (AVX-512 BW/VL/DQ or AVX-NE-CONVERT). ``F.linear``
  reorders a bfloat16 weight into oneDNN's blocked layout on every call; a decode step is a few hundred
  small matmuls, so that reorder is much of its cost. Packing each weight once (what vLLM's CPU backend
  and inductor's ``freezing`` do) halves a batch-1 matmul (lm_head 1.9 -> 1.0 ms, gate_up 80 -> 36 us
  on such a CPU) and gives bit-identical results: the same kernel runs, only the layout changes.
- ``avx2``: an AVX2-only CPU, where oneDNN refuses bfloat16 (``models.avx2_linear``).
float32 is left alone: its packed kernel rounds differently from ``F.linear``, and float32 is the
dtype tests compare bit for bit with Hugging Face.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from serve_app.models.avx2_linear import Avx2Linear, Weights, extension

LinearKernel = Literal["onednn", "avx2"]


def onednn_bf16() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear_kernel(dtype: torch.dtype, device: str | torch.device) -> LinearKernel | None:
    """The packed kernel for a model of this dtype on this device; None: keep ``F.linear``."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return None
    if onednn_bf16():
        return "onednn"
    return "avx2" if extension() is not None else None


def int8_available(dtype: str, device: str) -> bool:
    """int8 weights (a draft's) run on the AVX2 kernel: bfloat16 activations on an x86 CPU."""
    return dtype == "bfloat16" and torch.device(device).type == "cpu" and extension() is not None


class PackedLinear(nn.Module):
    """Inference-only stand-in for an ``nn.Linear`` on oneDNN (same ``in_features``/``out_features``)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = nn.Buffer(torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1),
                                    persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, kernel: LinearKernel = "onednn", weights: Weights = "bfloat16") -> int:
    """Replace every ``nn.Linear`` of an inference model by a packed one (int8 weights: the AVX2 kernel's);
    returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child) if kernel == "onednn" else Avx2Linear(child, weights))
                count += 1
    return count
