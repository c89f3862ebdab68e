"""Packed linears (bfloat16 on CPU): oneDNN's gives the same numbers as ``F.linear``; our few-row kernel
(``models.avx2_linear``: AVX2 FMAs, or AVX-512 BF16 dot products where the CPU has them) gives float32
sums of the bfloat16 products rounded once, independent of the rows batched together; the runner uses
the kernel the CPU has, and both where it has both (few rows on ours, many on oneDNN)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from serve_app.models.avx2_linear import Avx2Linear, avx512_bf16, cpu_has_avx2, extension, quantize_int8
from serve_app.models.base import RunnerConfig
from serve_app.models.packed import (
    WIDE_FROM_ROWS,
    WIDE_FROM_ROWS_PAIRS,
    PackedLinear,
    linear_kernel,
    onednn_bf16,
    pack_linears,
)
from serve_app.models.runner import ModelRunner

needs_onednn = pytest.mark.skipif(not onednn_bf16(), reason="no oneDNN bfloat16 on this CPU or in this torch build")
needs_avx2 = pytest.mark.skipif(not cpu_has_avx2(), reason="the AVX2 kernel needs an AVX2 + FMA CPU")
# the bfloat16 weight layouts of our kernel this CPU runs: AVX2 FMAs everywhere, AVX-512 BF16 pairs where it can
LAYOUTS = ["avx2", *(["pairs"] if cpu_has_avx2() and avx512_bf16() else [])]


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (16, 64), (4, 5, 64), (1, 130, 64)])
def test_a_packed_linear_gives_the_same_bits_as_f_linear(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(PackedLinear(linear)(x), linear(x))


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


@needs_avx2
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rows_result_does_not_depend_on_the_rows_it_is_batched_with(layout):
    torch.manual_seed(1)
    linear = Avx2Linear(nn.Linear(700, 130, bias=True).to(torch.bfloat16), layout=layout)
    x = torch.randn(23, 700, dtype=torch.bfloat16)
    with torch.no_grad():
        together = linear(x)
        for rows in (1, 2, 5, 6, 7, 8, 13, 16, 20):  # panels split evenly: 16 rows as 6, 5, 5
            assert torch.equal(torch.cat([linear(x[i:i + rows]) for i in range(0, 23, rows)]), together)


@needs_avx2
@pytest.mark.parametrize("layout", [*LAYOUTS, "int8"])
@pytest.mark.parametrize("out_features", [16, 200, 1030])
def test_the_result_does_not_depend_on_how_many_threads_share_the_work(layout, out_features):
    # the blocks go to whichever thread is free (a thread the OS preempts holds up only the run it is on):
    # every block computed once, by one thread, in the same order of sums, whatever the thread count
    torch.manual_seed(2)
    linear = nn.Linear(300, out_features, bias=True).to(torch.bfloat16)
    int8 = layout == "int8"
    kernel = Avx2Linear(linear, weights="int8" if int8 else "bfloat16", layout="avx2" if int8 else layout)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 5, 16):
            x = torch.randn(rows, 300, dtype=torch.bfloat16)
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
def test_bfloat16_weights_take_the_cpus_widest_layout_and_int8_the_avx2_one():
    # AVX-512 BF16 multiplies two bfloat16 pairs per float32 lane in one instruction: a block of a few
    # rows costs about what one row does; int8 weights (a draft's) keep the AVX2 kernel everywhere
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    assert Avx2Linear(linear).layout == LAYOUTS[-1]
    assert Avx2Linear(linear, "int8").layout == "avx2"
    with pytest.raises(ValueError, match="int8"):
        Avx2Linear(linear, "int8", layout="pairs")


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
    # a decode step (few rows) reads half the bytes on the int8 kernel; a prefill or a large batch is
    # compute-bound there, and oneDNN's bfloat16 kernel runs it about twice as fast (models.packed)
    torch.manual_seed(3)
    linear = nn.Linear(300, 50, bias=True).to(torch.bfloat16)
    model = nn.Sequential(linear)
    assert pack_linears(model, "avx2", "int8") == 1
    x = torch.randn(1, 2 * WIDE_FROM_ROWS, 300, dtype=torch.bfloat16)
    few, many = x[:, :WIDE_FROM_ROWS - 1], x[:, :WIDE_FROM_ROWS]
    with torch.no_grad():
        assert torch.equal(model(few), Avx2Linear(linear, "int8")(few))
        assert torch.equal(model(many), PackedLinear(linear)(many))
        assert torch.equal(model(x), PackedLinear(linear)(x))


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


def test_the_runner_packs_bfloat16_models_with_the_cpus_kernel_and_leaves_float32_alone(tiny_models):
    def linears(runner):
        kinds = (nn.Linear, PackedLinear, Avx2Linear)
        return {type(m).__name__ for m in runner.model.modules() if isinstance(m, kinds)}

    bf16 = ModelRunner(tiny_models["llama"], RunnerConfig(dtype="bfloat16", max_batch_size=1, max_seq_len=32))
    fp32 = ModelRunner(tiny_models["llama"], RunnerConfig(dtype="float32", max_batch_size=1, max_seq_len=32))
    kernel = linear_kernel(torch.bfloat16, "cpu")
    expected = {"onednn": {"PackedLinear", "Avx2Linear"} if extension() is not None else {"PackedLinear"},
                "avx2": {"Avx2Linear"}, None: {"Linear"}}[kernel]
    assert linears(bf16) == expected
    assert linears(fp32) == {"Linear"}
    assert pack_linears(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "onednn") == 1  # float32 packs everywhere
