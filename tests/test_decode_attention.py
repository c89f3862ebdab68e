"""The fused attention kernel for a few queries a sequence over the bfloat16 KV cache
(``models.decode_attention``): float32 arithmetic, exact to bfloat16 rounding, and each query row's bits
independent of the rows, keys and sequences computed with it."""

from __future__ import annotations

import pytest
import torch

from serve_app.models import decode_attention
from serve_app.models.avx2_linear import cpu_has_avx2

pytestmark = pytest.mark.skipif(not cpu_has_avx2() or decode_attention.extension() is None,
                                reason="the kernel needs an AVX2 + FMA CPU and a C++ compiler")


def case(B, H, kv, T, L, D, seed=0):
    """q [B, H, T, D] and keys / values as views of a cache [B, 2, kv, capacity, D] (bfloat16), each
    sequence's T queries the last T positions of its own length, the mask causal by position."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(torch.bfloat16).transpose(1, 2)
    cache = torch.randn(B, 2, kv, L + 9, D, generator=g).to(torch.bfloat16)
    lengths = torch.randint(T, L + 1, (B,), generator=g)
    lengths[0] = L
    positions = lengths[:, None] - T + torch.arange(T)
    mask = torch.arange(L)[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, L]
    return q, cache[:, 0, :, :L], cache[:, 1, :, :L], mask


def exact(q, keys, values, mask):
    groups = q.shape[1] // keys.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), keys.double().repeat_interleave(groups, 1), values.double().repeat_interleave(groups, 1),
        attn_mask=mask)


@pytest.mark.parametrize("shape", [(1, 12, 2, 1, 251, 128), (16, 9, 3, 1, 40, 64), (4, 12, 2, 5, 100, 128),
                                   (3, 8, 8, 16, 33, 64), (2, 4, 1, 3, 7, 64)])
def test_the_kernel_is_attention_in_float32_rounded_once(shape):
    q, keys, values, mask = case(*shape)
    got = decode_attention.attend(q, keys, values, mask)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    want = exact(q, keys, values, mask)
    # float32 sums of exact products: within a few float32 roundings, then one bfloat16 rounding
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()


def test_a_rows_result_does_not_depend_on_what_it_is_computed_with():
    # a block of T queries gives each the bits of its own one-query step, whatever sequences share the
    # call and however many cache columns the batch reads past a sequence's own (masked: weight 0)
    B, H, kv, T, L, D = 3, 12, 2, 5, 60, 128
    q, keys, values, mask = case(B, H, kv, T, L, D, seed=1)
    together = decode_attention.attend(q, keys, values, mask)
    for b in range(B):
        own = int(mask[b, 0, -1].sum())  # the sequence's length: keys past it are masked
        for t in range(T):
            alone = decode_attention.attend(q[b:b + 1, :, t:t + 1], keys[b:b + 1, :, :own], values[b:b + 1, :, :own],
                                            mask[b:b + 1, :, t:t + 1, :own])
            assert torch.equal(alone[0, :, 0], together[b, :, t])


def test_masked_keys_weigh_exactly_nothing():
    q, keys, values, mask = case(2, 6, 2, 4, 50, 64, seed=2)
    before = decode_attention.attend(q, keys, values, mask)
    noisy = values.clone()
    noisy[~mask[:, 0, 0][:, None, :].expand_as(noisy[..., 0])] = 1e30  # what the first query may not see
    assert torch.equal(decode_attention.attend(q, keys, noisy, mask)[:, :, 0], before[:, :, 0])


def test_the_model_uses_it_for_a_few_queries_and_torch_for_a_prefill():
    q, *_ = case(1, 12, 2, 1, 10, 128)
    assert decode_attention.supports(q)
    assert not decode_attention.supports(case(1, 12, 2, decode_attention.MAX_QUERIES + 1, 40, 128)[0])
    assert not decode_attention.supports(q.float())
    assert not decode_attention.supports(case(1, 4, 2, 1, 10, 80)[0])  # head_dim not a multiple of 64


def test_the_result_does_not_depend_on_how_many_threads_share_the_work():
    # sequences and kv heads go to whichever thread is free: each computed once, the same bits for any count
    q, keys, values, mask = case(16, 12, 2, 3, 90, 128, seed=2)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 7):
            torch.set_num_threads(n)
            results.append(decode_attention.attend(q, keys, values, mask))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])
    want = exact(q, keys, values, mask)
    assert ((results[0].double() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()
