"""Prepacked oneDNN linears (bfloat16 on CPU): the same numbers as ``F.linear``, and the runner uses
them exactly where they are exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from serve_app.models.base import RunnerConfig
from serve_app.models.packed import PackedLinear, can_pack, pack_linears
from serve_app.models.runner import ModelRunner

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"), reason="no oneDNN in this torch build")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (16, 64), (4, 5, 64), (1, 130, 64)])
def test_a_packed_linear_gives_the_same_bits_as_f_linear(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(PackedLinear(linear)(x), linear(x))


def test_the_runner_packs_bfloat16_models_and_leaves_float32_alone(tiny_models):
    def linears(runner):
        return {type(m).__name__ for m in runner.model.modules() if isinstance(m, (nn.Linear, PackedLinear))}

    bf16 = ModelRunner(tiny_models["llama"], RunnerConfig(dtype="bfloat16", max_batch_size=1, max_seq_len=32))
    fp32 = ModelRunner(tiny_models["llama"], RunnerConfig(dtype="float32", max_batch_size=1, max_seq_len=32))
    assert linears(bf16) == {"PackedLinear"} and linears(fp32) == {"Linear"}
    assert pack_linears(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == 1
