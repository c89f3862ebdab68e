"""The torch runner and our Llama-family forward, against Hugging Face transformers as the oracle."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from serve_app.models.base import RunnerConfig
from serve_app.models.runner import ModelRunner

FAMILIES = ["llama", "qwen3", "qwen2", "mistral"]


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.mark.parametrize("kind", FAMILIES)
def test_prefill_and_block_scoring_match_transformers_fp32(tiny_models, kind):
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(tiny_models[kind], ids)  # [40, vocab]
    runner = ModelRunner(tiny_models[kind], RunnerConfig(max_batch_size=4, max_seq_len=64))
    runner.add("a")
    prefill = runner.forward(["a"], [ids[:30].tolist()], logits="all")[0]
    torch.testing.assert_close(prefill, ref[:30], rtol=1e-4, atol=1e-4)
    block = runner.forward(["a"], [ids[30:35].tolist()], logits="all")[0]  # a k + 1 = 5 block
    torch.testing.assert_close(block, ref[30:35], rtol=1e-4, atol=1e-4)
    decode = runner.forward(["a"], [[int(ids[35])]])[0]
    torch.testing.assert_close(decode, ref[35], rtol=1e-4, atol=1e-4)
    assert runner.length("a") == 36


def test_ragged_batch_each_sequence_at_its_own_position(tiny_models):
    gen = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(0, 300, (n,), generator=gen) for n in (25, 9, 17))
    refs = [hf_logits(tiny_models["qwen3"], x) for x in (a, b, c)]
    runner = ModelRunner(tiny_models["qwen3"], RunnerConfig(max_batch_size=3, max_seq_len=32))
    for s in "abc":
        runner.add(s)
    first = runner.forward(["a", "b", "c"], [a[:20].tolist(), b[:3].tolist(), c[:11].tolist()], logits="all")
    torch.testing.assert_close(first[0, :20], refs[0][:20], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(first[1, :3], refs[1][:3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(first[2, :11], refs[2][:11], rtol=1e-4, atol=1e-4)
    # second call: different block lengths per sequence, written at each sequence's own positions
    second = runner.forward(["c", "a", "b"], [c[11:17].tolist(), a[20:25].tolist(), b[3:9].tolist()], logits="all")
    torch.testing.assert_close(second[0, :6], refs[2][11:17], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second[1, :5], refs[0][20:25], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second[2, :6], refs[1][3:9], rtol=1e-4, atol=1e-4)
    last = runner.forward(["a", "b"], [[1, 2], [3]])  # "last" logits: one row per sequence
    assert last.shape == (2, runner.vocab_size)


def test_a_ragged_batch_computes_only_its_real_tokens(tiny_models):
    """A block of one drafting row among plain ones is padded to the block's length; the projections,
    the MLPs and the output head must not compute the padding. Served on the embedded model at 16
    streams, one row drafting k = 1 made the target's forward 1.45-1.6x a plain round's, as long as
    every row drafting (the layers ran 32 rows instead of 17)."""
    runner = ModelRunner(tiny_models["qwen2"], RunnerConfig(max_batch_size=4, max_seq_len=32))
    seen: dict[str, list[int]] = {"mlp": [], "qkv": [], "head": []}
    model = runner.model
    layer = model.model.layers[0]

    def rows(name):  # how many token rows a linear computes
        return lambda module, args, out: seen[name].append(args[0].numel() // args[0].shape[-1])

    hooks = [layer.mlp.gate_up_proj.register_forward_hook(rows("mlp")),
             layer.self_attn.qkv_proj.register_forward_hook(rows("qkv")),
             model.lm_head.register_forward_hook(rows("head"))]
    for s in "abcd":
        runner.add(s)
        runner.prefill(s, list(range(10, 20)))
    for v in seen.values():
        v.clear()
    logits = runner.forward(list("abcd"), [[1, 2, 3, 4, 5], [6], [7], [8]], logits="all")
    assert logits.shape[:2] == (4, 5)
    assert seen == {"mlp": [8], "qkv": [8], "head": [8]}  # 5 + 1 + 1 + 1 tokens, not 4 x 5
    for h in hooks:
        h.remove()


def test_rollback_is_a_length_change_and_later_writes_overwrite(tiny_models):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (30,), generator=gen)
    ref = hf_logits(tiny_models["llama"], ids)
    runner = ModelRunner(tiny_models["llama"], RunnerConfig(max_batch_size=1, max_seq_len=40))
    runner.add("s")
    runner.forward(["s"], [ids[:20].tolist()])
    runner.forward(["s"], [[7, 7, 7, 7]])  # rejected speculation
    runner.truncate("s", 20)
    assert runner.length("s") == 20
    out = runner.forward(["s"], [ids[20:30].tolist()], logits="all")[0]
    torch.testing.assert_close(out, ref[20:30], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cannot truncate"):
        runner.truncate("s", 31)


def test_bfloat16_is_close_to_fp32(tiny_models):
    ids = torch.randint(0, 300, (16,), generator=torch.Generator().manual_seed(3))
    ref = hf_logits(tiny_models["llama"], ids)
    runner = ModelRunner(tiny_models["llama"], RunnerConfig(dtype="bfloat16", max_batch_size=1, max_seq_len=32))
    runner.add("s")
    out = runner.forward(["s"], [ids.tolist()], logits="all")[0]
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_slots_are_reused_and_capacity_is_enforced(tiny_models):
    runner = ModelRunner(tiny_models["llama"], RunnerConfig(max_batch_size=2, max_seq_len=8))
    runner.add("a")
    runner.add("b")
    with pytest.raises(RuntimeError, match="no free KV-cache slot"):
        runner.add("c")
    runner.release("a")
    runner.add("c")
    with pytest.raises(ValueError, match="max_seq_len"):
        runner.forward(["c"], [list(range(9))])


@pytest.mark.slow
def test_embedded_model_logits_match_transformers(smollm2_path):
    ids = torch.randint(0, 49152, (64,), generator=torch.Generator().manual_seed(4))
    ref = hf_logits(smollm2_path, ids)
    runner = ModelRunner(smollm2_path, RunnerConfig(max_batch_size=1, max_seq_len=128))
    runner.add("s")
    out = torch.cat([
        runner.forward(["s"], [ids[:56].tolist()], logits="all")[0],
        runner.forward(["s"], [ids[56:].tolist()], logits="all")[0],
    ])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)


def test_bfloat16_attention_outside_sdpa_matches_sdpa():
    """``attend`` with a score bias (the bfloat16 path) computes what SDPA computes, grouped heads and
    the mask included, for decode blocks and a prefill."""
    from serve_app.models.llama import Batch, attend, score_bias

    gen = torch.Generator().manual_seed(4)
    for B, T, L in ((1, 1, 20), (3, 5, 40), (2, 24, 24)):
        q = torch.randn(B, 6, T, 16, generator=gen)  # 6 heads reading 2 kv heads
        k, v = torch.randn(B, 2, L, 16, generator=gen), torch.randn(B, 2, L, 16, generator=gen)
        mask = torch.ones(B, 1, T, L, dtype=torch.bool).tril(L - T)
        if L - T >= 3:
            mask[0, :, :, :3] = False  # a sequence that must not see its first entries (every query sees some)
        batch = Batch(torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long),
                      torch.arange(B), mask, L)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        bf = [t.to(torch.bfloat16) for t in (q, k, v)]
        out = attend(*bf, replace(batch, score_bias=score_bias(mask, 2, 3)))
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref, rtol=0.03, atol=0.03)
