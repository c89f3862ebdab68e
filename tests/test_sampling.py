"""Temperature, top-k and top-p turn logits into p (and the draft's q) the same way."""

from __future__ import annotations

import torch

from serve_app.speculation.sampling import probabilities, sample_rows, truncate_top
from serve_app.speculation.types import PAD_TOKEN, SamplingParams

LOGITS = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))[None, None]  # [1, 1, 4]


def probs(**kw) -> list[float]:
    return [round(x, 4) for x in probabilities(LOGITS, [SamplingParams(**kw)])[0, 0].tolist()]


def test_temperature_one_is_softmax():
    assert probs(temperature=1.0) == [0.4, 0.3, 0.2, 0.1]


def test_temperature_sharpens_and_flattens():
    cold, hot = probs(temperature=0.5), probs(temperature=2.0)
    assert cold[0] > 0.4 > hot[0]


def test_top_k_keeps_k_most_likely():
    assert probs(temperature=1.0, top_k=2) == [round(0.4 / 0.7, 4), round(0.3 / 0.7, 4), 0.0, 0.0]


def test_top_p_keeps_smallest_prefix_reaching_p():
    assert probs(temperature=1.0, top_p=0.7) == [round(0.4 / 0.7, 4), round(0.3 / 0.7, 4), 0.0, 0.0]
    assert probs(temperature=1.0, top_p=0.75) == [round(x / 0.9, 4) for x in (0.4, 0.3, 0.2)] + [0.0]
    assert probs(temperature=1.0, top_p=0.01) == [1.0, 0.0, 0.0, 0.0]


def test_rows_keep_their_own_parameters():
    logits = LOGITS.expand(2, 3, 4)
    out = probabilities(logits, [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0)])
    assert out[0, :, 0].tolist() == [1.0, 1.0, 1.0]
    torch.testing.assert_close(out[1, 2], torch.tensor([0.4, 0.3, 0.2, 0.1]))


def test_truncate_top_renormalises_and_pads_zero_mass():
    ids, q = truncate_top(torch.tensor([[0.1, 0.6, 0.3, 0.0]]), 2)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(q, torch.tensor([[2 / 3, 1 / 3]]))
    ids, q = truncate_top(torch.tensor([[0.0, 1.0, 0.0, 0.0]]), 3)
    assert ids[0, 0] == 1 and (ids[0, 1:] == PAD_TOKEN).all() and q[0, 1:].sum() == 0


def test_sample_rows_uses_each_rows_generator():
    p = torch.full((2, 50), 1 / 50)
    a = sample_rows(p, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    b = sample_rows(p[:1], [torch.Generator().manual_seed(1)])
    assert a[0] == b[0]


def test_sample_rows_draws_each_rows_distribution_and_never_a_token_without_mass():
    """Unnormalised rows (a rejection's residual) too; a token of no mass (cut by top-k or top-p, or
    the vocabulary's tail) is never drawn."""
    p = torch.tensor([[0.0, 2.0, 1.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0, 0.0, 0.5]])
    gens = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    n = 8000
    counts = torch.zeros_like(p)
    for _ in range(n):
        counts[torch.arange(2), sample_rows(p, gens)] += 1
    assert (counts[p == 0] == 0).all()
    for row in range(2):
        mass = p[row] > 0
        expected = p[row][mass] / p[row].sum() * n
        chi2 = float(((counts[row][mass] - expected) ** 2 / expected).sum())
        assert chi2 < 16.3  # chi-square, 3 degrees of freedom at most, p = 0.001
