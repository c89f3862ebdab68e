"""Turn logits into the distributions that speculation compares: temperature, top-k, top-p.

The same transform is applied to the target's logits (giving p) and to the draft's (giving q before
truncation), so a good draft's q is close to p. Pure functions on tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_app.speculation.types import PAD_TOKEN, SamplingParams


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Per-row sampling distribution. logits: [batch, T, vocab] float32 -> probs of the same shape.

    Rows must be non-greedy (temperature > 0); greedy rows are decided by argmax elsewhere.
    """
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None, None]
    logits = logits / temperature
    if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
        logits = _filter_top_k_top_p(logits, params)
    return torch.softmax(logits, dim=-1)


def _filter_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    # logits: [batch, T, vocab]; one sort serves both filters.
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])[:, None, None]
    ranks = torch.arange(vocab)
    drop = ranks >= top_k  # [batch, 1, vocab] broadcast over T
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)[:, None, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = drop | (mass_before >= top_p)  # keep the smallest prefix whose mass reaches top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def truncate_top(probs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``width`` most likely tokens and renormalise: q' for the wire.

    probs: [batch, vocab] -> (ids [batch, width] int64, probs [batch, width] float32). Ids of
    zero-probability entries are PAD_TOKEN so a receiver never scatters mass onto them.
    """
    top_probs, top_ids = probs.topk(min(width, probs.shape[-1]), dim=-1)
    top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
    top_ids = top_ids.masked_fill(top_probs == 0, PAD_TOKEN)
    return top_ids, top_probs


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One draw per row, each from its own generator: [batch, vocab] (unnormalised is fine) -> [batch] int64.

    Inverse transform: a uniform draw per row against the row's cumulative mass, both in float64.
    ``torch.multinomial`` took 1.1 ms a row on this project's CPUs at a 49 k vocabulary and 3.3 ms at 152 k
    (17 ms of a 16-row round of SmolLM2 that takes about 65; 53 ms of the 1.5 B target's ~200), this 0.1
    and 0.25. A token without mass is never drawn: its cumulative sum equals the one before it."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
    stray = probs.gather(1, picks[:, None])[:, 0] <= 0  # u * total rounded up to the total: past the last mass
    if stray.any():
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        picks = torch.where(stray, last, picks)
    return picks
