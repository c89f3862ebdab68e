"""Packed linears on CPU: in bfloat16 oneDNN's gives the same numbers as ``F.linear`` (in float32, the same to
float32 rounding); our few-row kernel (``models.avx2_linear``: AVX2 FMAs, or AVX-512 BF16 dot products where
the CPU has them) gives float32 sums of the bfloat16 products rounded once, independent of the rows batched
together; the runner uses the kernel the CPU has, and both where it has both (few rows on ours, many on
oneDNN)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from serve_app.models.avx2_linear import (
    QUAD_BLOCK,
    Avx2Linear,
    avx512_bf16,
    avx512_vnni,
    cpu_has_avx2,
    extension,
    quantize_int8,
)
from serve_app.models.base import RunnerConfig
from serve_app.models.packed import (
    WIDE_FROM_ROWS,
    WIDE_FROM_ROWS_PAIRS,
    PackedLinear,
    avx2_only,
    linear_kernel,
    onednn_bf16,
    onednn_fp32,
    pack_linears,
)
from serve_app.models.runner import ModelRunner

needs_onednn = pytest.mark.skipif(not onednn_bf16(), reason="no oneDNN bfloat16 on this CPU or in this torch build")
needs_avx2 = pytest.mark.skipif(not cpu_has_avx2(), reason="the AVX2 kernel needs an AVX2 + FMA CPU")
# the bfloat16 weight layouts of our kernel this CPU runs: AVX2 FMAs everywhere, AVX-512 BF16 pairs where it can
LAYOUTS = ["avx2", *(["pairs"] if cpu_has_avx2() and avx512_bf16() else [])]
# and of int8 weights: AVX2 everywhere, AVX-512 VNNI quads (x quantized too) where it can
INT8_LAYOUTS = ["avx2", *(["quads"] if cpu_has_avx2() and avx512_vnni() else [])]
needs_vnni = pytest.mark.skipif(not (cpu_has_avx2() and avx512_vnni()), reason="the quads layout needs AVX-512 VNNI")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (16, 64), (4, 5, 64), (1, 130, 64)])
def test_a_packed_linear_gives_the_same_bits_as_f_linear(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(PackedLinear(linear)(x), linear(x))


@pytest.mark.skipif(not onednn_fp32(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 300), (5, 300), (3, 7, 300), (1, 130, 300)])
def test_a_float32_packed_linear_computes_f_linear_to_float32_rounding(shape, bias):
    # oneDNN's float32 sums are ordered differently from MKL's: the same values to a few float32 ulps
    torch.manual_seed(1)
    linear = nn.Linear(300, 96, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        packed, reference = PackedLinear(linear)(x), linear(x)
    assert packed.dtype == torch.float32 and packed.shape == reference.shape
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-5)
    assert not torch.equal(packed, torch.zeros_like(packed))


@needs_avx2
def test_the_avx2_kernel_builds_on_an_avx2_cpu():
    assert extension() is not None, "a C++ compiler and ninja are dependencies of the bfloat16 path"


@needs_avx2
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 40), (2, 40), (5, 41), (7, 300), (3, 13, 40), (1, 70, 301)])
@pytest.mark.parametrize("out_features", [16, 50, 96])
def test_the_avx2_kernel_rounds_the_float32_sum_once(shape, bias, out_features, layout):
    torch.manual_seed(0)
    linear = nn.Linear(shape[-1], out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    with torch.no_grad():
        got = Avx2Linear(linear, layout=layout)(x)
        exact = x.double() @ linear.weight.double().T + (0 if linear.bias is None else linear.bias.double())
    assert got.shape == (*shape[:-1], out_features) and got.dtype == torch.bfloat16
    # float32 sums of exact bf16 products: within float32 rounding of the exact result, then one bf16 rounding
    tolerance = exact.abs().max() * 2**-8 + 1e-6
    assert (got.double() - exact).abs().max() <= tolerance
    # and the same as torch's own bf16 linear to bfloat16's precision
    torch.testing.assert_close(got, linear(x), rtol=2**-7, atol=1e-2)


# every weight format of our kernel this CPU runs: bfloat16 in its layouts, int8 in its, float32 (AVX2)
KINDS = [*LAYOUTS, *(f"int8-{lay}" for lay in INT8_LAYOUTS), "float32"]


def kernel_of(linear: nn.Linear, kind: str) -> tuple[Avx2Linear, torch.dtype]:
    """Our kernel for a float32 ``linear`` in one of ``KINDS``, and the dtype of its x."""
    if kind == "float32":
        return Avx2Linear(linear), torch.float32
    weights, layout = ("int8", kind[5:]) if kind.startswith("int8-") else ("model", kind)
    return Avx2Linear(linear.to(torch.bfloat16), weights, layout=layout), torch.bfloat16


@needs_avx2
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 40), (2, 40), (5, 41), (7, 300), (3, 13, 40), (1, 70, 301), (6, 4096)])
@pytest.mark.parametrize("out_features", [16, 50, 96])
def test_the_avx2_kernel_computes_a_float32_linear_to_float32_rounding(shape, bias, out_features):
    # a float32 model's weights stream from the same tiles as bfloat16's, 64 bytes a k step, nothing converted
    torch.manual_seed(6)
    linear = nn.Linear(shape[-1], out_features, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        got = Avx2Linear(linear)(x)
        exact = x.double() @ linear.weight.double().T + (0 if linear.bias is None else linear.bias.double())
        reference = linear(x)
    assert got.dtype == torch.float32 and got.shape == (*shape[:-1], out_features)
    # one float32 sum in k order: its rounding grows with K, far under bfloat16's
    scale = (x.double().abs() @ linear.weight.double().abs().T).max()
    assert (got.double() - exact).abs().max() <= scale * shape[-1] * 2**-24 + 1e-6
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5 * shape[-1] ** 0.5)


@needs_avx2
@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_rows_it_is_batched_with(kind):
    torch.manual_seed(1)
    linear, dtype = kernel_of(nn.Linear(704, 130, bias=True), kind)
    x = torch.randn(23, 704, dtype=dtype)
    with torch.no_grad():
        together = linear(x)
        for rows in (1, 2, 5, 6, 7, 8, 13, 16, 20):  # panels split evenly: 16 rows as 6, 5, 5
            assert torch.equal(torch.cat([linear(x[i:i + rows]) for i in range(0, 23, rows)]), together)


@needs_avx2
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("out_features", [16, 200, 1030])
def test_the_result_does_not_depend_on_how_many_threads_share_the_work(kind, out_features):
    # the blocks go to whichever thread is free (a thread the OS preempts holds up only the run it is on):
    # every block computed once, by one thread, in the same order of sums, whatever the thread count
    torch.manual_seed(2)
    kernel, dtype = kernel_of(nn.Linear(320, out_features, bias=True), kind)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 5, 16):
            x = torch.randn(rows, 320, dtype=dtype)
            results = []
            for n in (1, 2, 3, 7):
                torch.set_num_threads(n)
                with torch.no_grad():
                    results.append(kernel(x))
            assert all(torch.equal(r, results[0]) for r in results[1:])
            assert (results[0] != 0).any(dim=0).all()  # no column left unwritten
    finally:
        torch.set_num_threads(threads)


@needs_avx2
def test_each_kind_of_weights_takes_the_cpus_widest_layout_for_it():
    # AVX-512 BF16 multiplies two bfloat16 pairs per float32 lane in one instruction: a block of a few
    # rows costs about what one row does; AVX-512 VNNI four int8 pairs per int32 lane, where the AVX2
    # path converts every int8 weight to float32 first (which, not memory, bounded a draft's step)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    assert Avx2Linear(linear).layout == LAYOUTS[-1]
    assert Avx2Linear(linear, "int8").layout == INT8_LAYOUTS[-1]
    assert Avx2Linear(nn.Linear(40, 32).to(torch.bfloat16), "int8").layout == "avx2"  # not whole blocks of 32
    with pytest.raises(ValueError, match="pairs layout does not take int8"):
        Avx2Linear(linear, "int8", layout="pairs")
    with pytest.raises(ValueError, match="quads layout does not take model"):
        Avx2Linear(linear, layout="quads")
    assert Avx2Linear(nn.Linear(64, 32)).layout == "avx2"  # float32: the AVX2 layout on every CPU
    with pytest.raises(ValueError, match="pairs layout does not take model weights of torch.float32"):
        Avx2Linear(nn.Linear(64, 32), layout="pairs")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the quads layout does to x: each row in blocks of 32, a block's largest magnitude over 127 its
    scale, each value times 127 over that magnitude (float32) rounded to nearest even. (q [.., K], d [.., K / 32])"""
    blocks = x.float().unflatten(-1, (-1, QUAD_BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (blocks * inv).round().flatten(-2), (amax / 127).squeeze(-1)


@needs_vnni
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (5, 320), (2, 9, 64), (7, 4864)])
def test_int8_quads_compute_the_quantized_x_by_the_quantized_weight(shape, bias):
    # x rounded to int8 in blocks of 32 (a draft's proposals only: the target verifies them), then every
    # block's integer sum exact, scaled by its block's and its column's scales, in k order
    torch.manual_seed(5)
    linear = nn.Linear(shape[-1], 50, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    x[..., 3] *= 40  # an outlier: its block's values round coarser, the other blocks' do not
    q, scale = quantize_int8(linear.weight)
    xq, d = quantize_rows(x)
    with torch.no_grad():
        got = Avx2Linear(linear, "int8", layout="quads")(x)
    sums = (xq.double().unflatten(-1, (-1, QUAD_BLOCK)).unsqueeze(-3)
            * q.double().unflatten(-1, (-1, QUAD_BLOCK))).sum(-1)  # [..., N, K / 32], exact integers
    exact = (sums * d.double().unsqueeze(-2)).sum(-1) * scale.double() \
        + (0 if linear.bias is None else linear.bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], 50)
    assert (got.double() - exact).abs().max() <= exact.abs().max() * 2**-8 + 1e-6
    # and within int8 rounding of the same int8 weight on the AVX2 layout, which keeps x in bfloat16
    avx2 = Avx2Linear(linear, "int8", layout="avx2")(x).double()
    assert (got.double() - avx2).abs().max() <= 0.05 * avx2.abs().max()


@needs_avx2
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 40), (5, 300), (2, 9, 40)])
def test_int8_weights_compute_with_the_quantized_weight_and_each_rows_scale(shape, bias):
    torch.manual_seed(2)
    linear = nn.Linear(shape[-1], 50, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    q, scale = quantize_int8(linear.weight)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale.shape == (50,)
    assert (q.float() * scale[:, None] - linear.weight.float()).abs().max() <= scale.max() / 2 * 1.0001
    with torch.no_grad():
        got = Avx2Linear(linear, "int8")(x)
        exact = (x.double() @ q.double().T) * scale.double() + (0 if linear.bias is None else linear.bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], 50)
    assert (got.double() - exact).abs().max() <= exact.abs().max() * 2**-8 + 1e-6


@needs_onednn
@needs_avx2
def test_int8_weights_run_a_forward_of_many_rows_on_onednn_in_bfloat16():
    # a decode step (few rows) reads half the bytes on the AVX2 int8 kernel; a prefill or a large batch is
    # compute-bound there, and oneDNN's bfloat16 kernel runs it about twice as fast (models.packed)
    torch.manual_seed(3)
    linear = nn.Linear(300, 50, bias=True).to(torch.bfloat16)  # 300: not whole blocks of 32, the AVX2 layout
    model = nn.Sequential(linear)
    assert pack_linears(model, "avx2", "int8") == 1
    wide = model[0].wide_from
    assert wide == WIDE_FROM_ROWS
    x = torch.randn(1, 2 * wide, 300, dtype=torch.bfloat16)
    few, many = x[:, :wide - 1], x[:, :wide]
    with torch.no_grad():
        assert torch.equal(model(few), Avx2Linear(linear, "int8")(few))
        assert torch.equal(model(many), PackedLinear(linear)(many))
        assert torch.equal(model(x), PackedLinear(linear)(x))


@needs_vnni
def test_int8_weights_on_the_vnni_layout_run_every_forward_there_with_no_bfloat16_copy():
    # x rounded to int8 too, the quads layout is ahead of oneDNN's bfloat16 at every row count measured
    # (a prefill included), so an int8 weight it takes keeps that layout alone (models.packed)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(320, 50, bias=True).to(torch.bfloat16))
    assert pack_linears(model, "avx2", "int8") == 1
    assert isinstance(model[0], Avx2Linear) and model[0].layout == "quads"
    x = torch.randn(1, 150, 320, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), torch.cat([model(x[:, i:i + 1]) for i in range(150)], dim=1))


@needs_onednn
@needs_avx2
def test_bfloat16_weights_run_few_rows_on_the_avx2_kernel_and_many_on_onednn():
    # a decode step or a block at one stream reads every weight for a few rows: the AVX2 kernel's per-call
    # cost is lower there than oneDNN's, and its sums do not depend on the rows batched together, so a
    # verified block of fewer than WIDE_FROM_ROWS tokens scores each one as its own step did (oneDNN's
    # sums vary with the row count: a step's bits are not those of the same token in a block)
    # (the AVX-512 BF16 layout up to WIDE_FROM_ROWS_PAIRS rows: it is the faster one to there, measured)
    torch.manual_seed(4)
    linear = nn.Linear(2048, 512, bias=True).to(torch.bfloat16)  # long enough sums for the two kernels' to differ
    model = nn.Sequential(linear)
    assert pack_linears(model, "onednn") == 1
    wide = model[0].wide_from
    assert wide == {"avx2": WIDE_FROM_ROWS, "pairs": WIDE_FROM_ROWS_PAIRS}[LAYOUTS[-1]]
    x = torch.randn(1, 2 * wide, 2048, dtype=torch.bfloat16)
    few, many = x[:, :wide - 1], x[:, :wide]
    with torch.no_grad():
        assert torch.equal(model(few), Avx2Linear(linear)(few))
        for rows in range(1, wide):
            assert torch.equal(model(x[:, :rows]), model(few)[:, :rows])
        assert torch.equal(model(many), PackedLinear(linear)(many))
    float32 = nn.Sequential(nn.Linear(300, 50))
    assert pack_linears(float32, "onednn") == 1 and isinstance(float32[0], PackedLinear)  # float32: oneDNN only


def test_the_runner_packs_bfloat16_models_with_the_cpus_kernel_and_float32_on_avx2_or_onednn(tiny_models):
    # float32 on our kernel where AVX2 is the CPU's widest (oneDNN's float32 gains little from a batch of
    # rows there), on oneDNN elsewhere
    def linears(runner):
        kinds = (nn.Linear, PackedLinear, Avx2Linear)
        return {type(m).__name__ for m in runner.model.modules() if isinstance(m, kinds)}

    bf16 = ModelRunner(tiny_models["llama"], RunnerConfig(dtype="bfloat16", max_batch_size=1, max_seq_len=32))
    fp32 = ModelRunner(tiny_models["llama"], RunnerConfig(dtype="float32", max_batch_size=1, max_seq_len=32))
    kernel = linear_kernel(torch.bfloat16, "cpu")
    expected = {"onednn": {"PackedLinear", "Avx2Linear"} if extension() is not None else {"PackedLinear"},
                "avx2": {"Avx2Linear"}, None: {"Linear"}}[kernel]
    assert linears(bf16) == expected
    fp32_kernel = "avx2" if avx2_only() and extension() is not None else "onednn" if onednn_fp32() else None
    assert linear_kernel(torch.float32, "cpu") == fp32_kernel
    assert linears(fp32) == {"avx2": {"Avx2Linear"}, "onednn": {"PackedLinear"}, None: {"Linear"}}[fp32_kernel]
    assert linear_kernel(torch.float32, "cuda") is None and linear_kernel(torch.float16, "cpu") is None
    assert pack_linears(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "onednn") == 1  # float32 packs everywhere
