"""Linear layers with weights packed once at load time, for bfloat16 on CPU.

Two kernels, by what the CPU does natively (``linear_kernel``):
- ``onednn``: where it converts bfloat16 natively (AVX-512 BW/VL/DQ or AVX-NE-CONVERT). ``F.linear``
  reorders a bfloat16 weight into oneDNN's blocked layout on every call; a decode step is a few hundred
  small matmuls, so that reorder is much of its cost. Packing each weight once (what vLLM's CPU backend
  and inductor's ``freezing`` do) halves a batch-1 matmul (lm_head 1.9 -> 1.0 ms, gate_up 80 -> 36 us
  on such a CPU) and gives bit-identical results: the same kernel runs, only the layout changes.
- ``avx2``: an AVX2-only CPU, where oneDNN refuses bfloat16 (``models.avx2_linear``).
int8 weights (a draft's) run on the AVX2 kernel: a decode step reads half the bytes. Where the CPU
also has oneDNN bfloat16, a forward of ``WIDE_FROM_ROWS`` rows or more (a prefill, a catch-up, a large
batch) runs there on a bfloat16 copy instead (``Int8Linear``): the int8 kernel converts in registers and
is compute-bound at many rows.
float32 is left alone: its packed kernel rounds differently from ``F.linear``, and float32 is the
dtype tests compare bit for bit with Hugging Face.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from serve_app.models.avx2_linear import Avx2Linear, Weights, extension

LinearKernel = Literal["onednn", "avx2"]
WIDE_FROM_ROWS = 8  # int8 weights: a forward of this many rows or more runs on oneDNN (``Int8Linear``)


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


class Int8Linear(nn.Module):
    """int8 weights on a CPU with oneDNN bfloat16: few rows on the AVX2 int8 kernel, many on oneDNN.

    Measured (AMD Zen 4, 2 threads, the 0.5 B draft's 151936 x 896 output layer, int8 / bfloat16 ms):
    6.1 / 10.3 at 1 row, 8.5 / 9.5 at 4, 18.9 / 14.6 at 8, 260 / 123 at 150; the draft's prefill of 150
    tokens 642 / 348 ms, its decode step 29.7 / 56.0. Costs the bfloat16 weights' memory besides the int8."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.narrow, self.wide = Avx2Linear(linear, "int8"), PackedLinear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.wide if x.numel() >= WIDE_FROM_ROWS * self.in_features else self.narrow)(x)


def pack_linears(model: nn.Module, kernel: LinearKernel = "onednn", weights: Weights = "bfloat16") -> int:
    """Replace every ``nn.Linear`` of an inference model by a packed one (int8 weights: the AVX2 kernel's,
    and oneDNN's for many rows where the CPU has it); returns how many."""
    def packed(linear: nn.Linear) -> nn.Module:
        if kernel == "onednn":
            return PackedLinear(linear)
        return Int8Linear(linear) if weights == "int8" and onednn_bf16() else Avx2Linear(linear, weights)

    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, packed(child))
                count += 1
    return count
