"""Linear layers with weights packed once at load time, on CPU (bfloat16, and float32).

Two kernels, by what the CPU does natively (``linear_kernel``):
- ``onednn``: where it converts bfloat16 natively (AVX-512 BW/VL/DQ or AVX-NE-CONVERT). ``F.linear``
  reorders a bfloat16 weight into oneDNN's blocked layout on every call; a decode step is a few hundred
  small matmuls, so that reorder is much of its cost. Packing each weight once (what vLLM's CPU backend
  and inductor's ``freezing`` do) halves a batch-1 matmul (lm_head 1.9 -> 1.0 ms, gate_up 80 -> 36 us
  on such a CPU) and gives bit-identical results: the same kernel runs, only the layout changes.
- ``avx2``: an AVX2-only CPU, where oneDNN refuses bfloat16 (``models.avx2_linear``).

Where the CPU has both, a forward of fewer than ``WIDE_FROM_ROWS`` rows (a decode step or a verified
block at one or two streams) runs on the AVX2 kernel and one of more (a prefill, a large batch) on oneDNN
(``SplitLinear``). Measured (AMD Zen 4; one process, the two layouts' forwards interleaved): SmolLM2-135M
at 1 to 6 rows in 0.75-0.83x oneDNN's time, on one thread or two; the 1.5 B target on two threads in
0.76x at 1-2 rows, level at 3-6. Where the CPU has AVX-512 BF16 too, our kernel packs bfloat16 weights in
pairs (``avx2_linear``) and keeps forwards of up to ``WIDE_FROM_ROWS_PAIRS`` - 1 rows: against the AVX2
layout 0.89-0.94x the forward's time at 1-5 rows (SmolLM2), 0.88x at 5 rows (the 1.5 B target); against
oneDNN at 8-16 rows 0.81-0.95x (SmolLM2) and 0.93-1.02x (1.5 B); oneDNN is the faster from 32 rows on
the 1.5 B target (1.11x) and from about 64 on SmolLM2. Our kernel's per-call cost is the lower, and its
sums do not depend on the rows batched together, so a block of fewer rows scores each token with the
bits of its own decode step (oneDNN's vary with the row count; ``batch_invariant_rows``). The cost: both
layouts of every weight in memory. int8 weights (a draft's) split the same way: the int8 kernel reads half
the bytes of a decode step; on the AVX2 layout it is compute-bound from a few rows, where oneDNN's bfloat16
runs about twice as fast. On the AVX-512 VNNI layout (x rounded to int8 too) it is ahead of oneDNN's
bfloat16 at every row count measured (1 to 300 rows, the 0.5 B draft's layers: 0.7x its time at 150), so
such a weight keeps that layout alone, and no bfloat16 copy.
float32 runs on our kernel where AVX2 is the CPU's widest (``avx2_only``: AMD Zen 1-3), at every row count:
there ``F.linear`` runs float32 on MKL's slow path for an AMD CPU, and oneDNN's packed float32 costs
1.6-1.75x a one-row step for 2-5 rows, where ours streams the weights once for up to six (measured, Zen 3, two
threads, a forward's linears and lm_head with random weights of each model's shapes, ours / oneDNN: the
1.5 B target 236 / 277 ms at one row, 230-252 / 438-484 at 2-5, 455 / 812 at 16, 5095 / 5915 at 256; the
0.5 B draft 0.51-0.54x oneDNN's time at 2-16 rows, 0.98x at 256; SmolLM2-135M 0.33-0.46x at 2-16, 0.80x at
256). On a CPU with AVX-512 float32 packs into oneDNN's layout (``onednn_fp32``; not measured against ours
there). Either way float32 matches Hugging Face's tokens, not its bits (the tests compare greedy tokens with
transformers: our fused q/k/v and gate/up projections never matched its bits either); on ours a row's sums
do not depend on the rows batched with it, as in bfloat16.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from serve_app.models.avx2_linear import Avx2Linear, Weights, avx512_bf16, extension, widest_layout

LinearKernel = Literal["onednn", "avx2"]
WIDE_FROM_ROWS = 8  # a forward of this many rows or more runs on oneDNN (``SplitLinear``)...
WIDE_FROM_ROWS_PAIRS = 24  # ...or this many where our kernel has the AVX-512 BF16 layout


def avx2_only() -> bool:
    """An x86 CPU whose widest vectors are AVX2 (AMD Zen 1-3, Intel without AVX-512)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def onednn_fp32() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_bf16() -> bool:
    return onednn_fp32() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def linear_kernel(dtype: torch.dtype, device: str | torch.device) -> LinearKernel | None:
    """The packed kernel for a model of this dtype on this device; None: keep ``F.linear``."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if dtype == torch.float32:
        if avx2_only() and extension() is not None:
            return "avx2"
        return "onednn" if onednn_fp32() else None
    if onednn_bf16():
        return "onednn"
    return "avx2" if extension() is not None else None


def batch_invariant_rows() -> int:
    """The most rows a bfloat16 forward on this CPU may have for each row's result not to depend on
    the rows batched with it: every count on the AVX2 kernel alone, those below the switch to oneDNN
    where the CPU has both, none on ``F.linear`` or oneDNN alone."""
    kernel = linear_kernel(torch.bfloat16, "cpu")
    if kernel == "avx2":
        return 1 << 30
    if kernel == "onednn" and extension() is not None:
        return (WIDE_FROM_ROWS_PAIRS if avx512_bf16() else WIDE_FROM_ROWS) - 1
    return 0


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


class SplitLinear(nn.Module):
    """Few rows on the AVX2 kernel (bfloat16 or int8 weights), many on oneDNN in bfloat16 (``WIDE_FROM_ROWS``).

    Measured for int8 (AMD Zen 4, 2 threads, the 0.5 B draft's 151936 x 896 output layer, int8 / bfloat16
    ms): 6.1 / 10.3 at 1 row, 8.5 / 9.5 at 4, 18.9 / 14.6 at 8, 260 / 123 at 150; the draft's prefill of
    150 tokens 642 / 348 ms, its decode step 29.7 / 56.0. (Where the CPU has AVX-512 VNNI, int8 weights
    take that layout alone: ``pack_linears``.) Holds both layouts of the weight."""

    def __init__(self, linear: nn.Linear, weights: Weights = "model"):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.narrow, self.wide = Avx2Linear(linear, weights), PackedLinear(linear)
        self.wide_from = WIDE_FROM_ROWS_PAIRS if self.narrow.layout == "pairs" else WIDE_FROM_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.wide if x.numel() >= self.wide_from * self.in_features else self.narrow)(x)


def pack_linears(model: nn.Module, kernel: LinearKernel = "onednn", weights: Weights = "model") -> int:
    """Replace every ``nn.Linear`` of an inference model by a packed one: bfloat16 (or int8) weights on
    the AVX2 kernel for few rows and oneDNN for many where the CPU has both (``SplitLinear``), else on
    the one it has; int8 weights on the AVX-512 VNNI layout at every row count; float32 on the one
    ``linear_kernel`` names (ours where AVX2 is the CPU's widest, else oneDNN).
    Returns how many."""
    def packed(linear: nn.Linear) -> nn.Module:
        if kernel == "onednn" and (linear.weight.dtype != torch.bfloat16 or extension() is None):
            return PackedLinear(linear)
        if (kernel == "avx2" and not (weights == "int8" and onednn_bf16())) or \
                (weights == "int8" and widest_layout(weights, linear.in_features) == "quads"):
            return Avx2Linear(linear, weights)
        return SplitLinear(linear, weights)

    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, packed(child))
                count += 1
    return count
