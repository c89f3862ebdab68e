"""bfloat16 linear layers for CPUs without native bfloat16 arithmetic (AVX2 + FMA only: AMD Zen 1-3,
Intel before Cooper Lake), a small C++ kernel built once on first use; and int8 weights for a draft.
Where oneDNN has bfloat16 too, the same kernel runs forwards of few rows (``models.packed``).

Why our own kernel: on such a CPU oneDNN (torch's, and vLLM's own build) and zentorch refuse bfloat16
matmuls, and torch falls back to a generic kernel that is fine for one row but runs far under the
memory bound for more (measured here, AMD EPYC Zen 3, 2 threads, a 1536 x 17920 weight: 1.9 ms for
1 row, 8.6 ms for 5, 28 ms for 16, 100 ms for 64). Verifying a block of k + 1 tokens is exactly such
a matmul, so speculation could not pay there. ``avx2_linear.cpp`` packs each weight once
(blocks of 16 output columns) and runs a 6 x 16 register-tiled micro-kernel (the BLIS / ggml AVX2
shape) converting bfloat16 in registers: the same weight in 2.1 / 3.4 / 7.0 / 23 ms, 1 row at the
memory bound and 64 near the FMA peak.

Each output is one float32 sum in k order, so a row's result does not depend on how many rows share
the call: scoring a block gives each token the bits of a one-token step.

``weights="int8"`` stores each weight as int8 with a float32 scale per output column (symmetric,
rounded to nearest): half the bytes a decode step reads. Only for a draft: its tokens are proposals the
target verifies, so a draft's rounding changes how many are accepted, never the output. On the AVX2
layout each int8 weight is converted to float32 in registers, and that conversion, not memory, bounds a
decode step (the 0.5 B draft: 53 ms a step on one thread, 34 on two, for 0.5 GB of weights). Where the
CPU has AVX-512 VNNI (Intel from Cascade Lake, AMD Zen 4 on), the ``quads`` layout quantizes x too, each
row in blocks of 32 values with a float32 scale a block (as llama.cpp's q8_0 does its activations), and
multiplies 4 int8 pairs per 32-bit lane in one instruction, exact in int32 (``avx2_linear.cpp``).

A float32 model's linears run on the same tiles (``weights="model"`` with a float32 weight: x, weight,
bias and y in float32, 64 bytes of weights a k step, nothing converted) where AVX2 is the CPU's widest
(``models.packed``). Six rows of FMAs per 64 bytes keep up with memory there, so a verified block of a few
tokens costs what a one-token step does (measured, AMD EPYC Zen 3, 2 threads, a forward's linears and
lm_head of the 1.5 B target: 230-252 ms at 1-5 rows, 323 at 8, against oneDNN's float32 at 277-484 and 608).

The build needs a C++ compiler and ninja (a dependency); without them, or on another CPU, the model
keeps ``F.linear`` and the log says why once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch
from torch import nn

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("avx2_linear.cpp")
SHARED = Path(__file__).with_name("share.h")  # included by the kernels: how they spread work over threads


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def build(name: str, source: Path, fallback: str) -> ModuleType | None:
    """A C++ kernel for an AVX2 + FMA CPU, built into torch's extension cache on first use (under its
    file lock), or None where it cannot run or build; ``fallback`` says in the log what runs instead."""
    if not cpu_has_avx2():
        return None
    try:
        from torch.utils.cpp_extension import load

        # -fopenmp: at::parallel_for runs on torch's threads (without it, on one). torch rebuilds when a
        # source or a flag changes, not a header: the shared header's digest goes in as a flag
        shared = hashlib.sha256(SHARED.read_bytes()).hexdigest()[:16]
        return load(name=name, sources=[str(source)], verbose=False,
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp", f"-DSERVE_APP_SHARED_H={shared}"])
    except Exception as e:  # noqa: BLE001 - a missing compiler or ninja: keep torch's kernels
        log.warning("%s not built (%s: %s); %s", source.name, type(e).__name__, e, fallback)
        return None


@functools.cache
def extension() -> ModuleType | None:
    """The compiled linear kernel, or None where it cannot run or build."""
    return build("serve_app_avx2_linear", SOURCE,
                 "bfloat16 linears use F.linear, several times slower for more than one row on this CPU")


Weights = Literal["model", "int8"]  # the model's own (bfloat16 or float32), or int8
Layout = Literal["avx2", "pairs", "quads"]
QUAD_BLOCK = 32  # x values per quantization block of the ``quads`` layout: its input features a multiple of it


def avx512_bf16() -> bool:
    """Whether this CPU runs the AVX-512 BF16 layout (``layout="pairs"``), the kernel built."""
    ext = extension()
    return ext is not None and ext.has_avx512_bf16()


def avx512_vnni() -> bool:
    """Whether this CPU runs the AVX-512 VNNI layout of int8 weights (``layout="quads"``), the kernel built."""
    ext = extension()
    return ext is not None and ext.has_avx512_vnni()


def widest_layout(weights: Weights, in_features: int) -> Layout:
    """The layout this CPU runs fastest for such weights: bfloat16 in AVX-512 BF16 pairs, int8 in AVX-512
    VNNI quads (``in_features`` a multiple of ``QUAD_BLOCK``), else AVX2."""
    if weights == "model":
        return "pairs" if avx512_bf16() else "avx2"
    return "quads" if in_features % QUAD_BLOCK == 0 and avx512_vnni() else "avx2"


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q [N, K] int8, scale [N] float32), weight ~= q * scale[:, None]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Avx2Linear(nn.Module):
    """Inference-only stand-in for a bfloat16 or float32 ``nn.Linear`` (same ``in_features``/``out_features``)."""

    def __init__(self, linear: nn.Linear, weights: Weights = "model", layout: Layout | None = None):
        """``weights``: the linear's own (bfloat16 or float32: its x and y the same) or int8 (bfloat16 x and y).
        ``layout``: None, the widest this CPU runs for these weights (``widest_layout``; float32: AVX2 only)."""
        super().__init__()
        ext = extension()
        if ext is None:
            raise RuntimeError("the AVX2 linear kernel is not available on this machine")
        float32 = weights == "model" and linear.weight.dtype == torch.float32
        layout = layout or ("avx2" if float32 else widest_layout(weights, linear.in_features))
        if ((layout == "pairs") != (weights == "model") and layout != "avx2") or (float32 and layout != "avx2"):
            raise ValueError(f"the {layout} layout does not take {weights} weights of {linear.weight.dtype} "
                             "(pairs: bfloat16, quads: int8, avx2: any)")
        self.ext, self.layout = ext, layout
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            if layout == "pairs":
                self.packed = nn.Buffer(ext.pack_pairs(linear.weight.detach().to(torch.bfloat16)), persistent=False)
                self.scale = None
            elif weights == "int8":
                q, scale = quantize_int8(linear.weight)
                self.packed = nn.Buffer(ext.pack_quads(q) if layout == "quads" else ext.pack(q), persistent=False)
                self.scale: torch.Tensor | None = nn.Buffer(scale, persistent=False)
            else:
                own = torch.float32 if float32 else torch.bfloat16
                self.packed = nn.Buffer(ext.pack(linear.weight.detach().to(own)), persistent=False)
                self.scale = None
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float32 if float32 else torch.bfloat16)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "pairs":
            return self.ext.linear_pairs(x, self.packed, self.out_features, self.bias)
        if self.layout == "quads":
            return self.ext.linear_quads(x, self.packed, self.out_features, self.scale, self.bias)
        return self.ext.linear(x, self.packed, self.out_features, self.scale, self.bias)
