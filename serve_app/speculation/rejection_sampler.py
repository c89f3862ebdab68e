"""The verifier: which draft tokens to keep, and the one token the target adds.

Pure functions of tensors, no model or actor inside. Follows Leviathan et al. 2023
(arXiv 2211.17192), Algorithm 1, and Chen et al. 2023 (arXiv 2302.01318):

    for j in 1..k:  accept draft token x_j with probability min(1, p_j(x_j) / q_j(x_j))
    at the first rejection j:  emit a *recovered* token ~ norm(max(0, p_j - q_j)), stop
    if all k accepted:         emit a *bonus* token ~ p_{k+1}

The output is distributed exactly as p, for any q the draft tokens were really drawn from. Greedy
decoding is the limit where p and q are one-hot at their argmax: accept while the draft equals the
target's argmax, then emit the target's argmax.

Rows may have fewer than k draft tokens (``num_draft_tokens``); positions past a row's own count
are treated as rejected, and its last token is then a bonus from p at that position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_app.speculation.sampling import sample_rows
from serve_app.speculation.types import PAD_TOKEN


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    # accept: [batch, k] bool -> [batch] length of the all-True prefix
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def _output(tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    # tokens: [batch, k + 1]; keep positions 0..n (n accepted + the target's own token)
    keep = torch.arange(tokens.shape[1]) <= num_accepted[:, None]
    return tokens.masked_fill(~keep, PAD_TOKEN)


def greedy_verify(
    draft_tokens: torch.Tensor,  # [batch, k] int64, PAD_TOKEN past num_draft_tokens
    num_draft_tokens: torch.Tensor,  # [batch] int64
    target_argmax: torch.Tensor,  # [batch, k + 1] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification -> (output_tokens [batch, k + 1], num_accepted [batch])."""
    k = draft_tokens.shape[1]
    valid = torch.arange(k) < num_draft_tokens[:, None]
    num_accepted = _accepted_prefix((draft_tokens == target_argmax[:, :k]) & valid)
    # Accepted drafts equal the argmax, so the argmax row is the output up to position n.
    return _output(target_argmax, num_accepted), num_accepted


def rejection_sample(
    draft_tokens: torch.Tensor,  # [batch, k] int64, PAD_TOKEN past num_draft_tokens
    num_draft_tokens: torch.Tensor,  # [batch] int64
    q_ids: torch.Tensor,  # [batch, k, K] int64: support of the draft distribution q, PAD_TOKEN unused
    q_probs: torch.Tensor,  # [batch, k, K] float32: q on that support (sums to 1 per valid position)
    p: torch.Tensor,  # [batch, k + 1, vocab] float32: target distribution
    generators: Sequence[torch.Generator],  # one per row, so each request is reproducible alone
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling -> (output_tokens [batch, k + 1], num_accepted [batch])."""
    batch, k = draft_tokens.shape
    valid = torch.arange(k) < num_draft_tokens[:, None]  # [batch, k]
    drafts = draft_tokens.clamp(min=0)
    p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # [batch, k]
    q_draft = ((q_ids == drafts[..., None]) * q_probs).sum(-1)  # [batch, k]
    # Each row draws exactly its own count, so its random stream never depends on batch neighbours.
    uniform = torch.ones(batch, k)
    for i, (n, g) in enumerate(zip(num_draft_tokens.tolist(), generators, strict=True)):
        uniform[i, :n] = torch.rand(n, generator=g)
    # u < p/q, written without the division; q_draft > 0 for every token the draft really drew.
    num_accepted = _accepted_prefix((uniform * q_draft < p_draft) & valid)

    tokens = torch.full((batch, k + 1), PAD_TOKEN, dtype=torch.long)
    tokens[:, :k] = draft_tokens
    rows = torch.arange(batch)
    p_at = p[rows, num_accepted]  # [batch, vocab]: p where the target adds its own token
    rejected = num_accepted < num_draft_tokens
    for i in rows[rejected].tolist():
        n = int(num_accepted[i])
        support = q_ids[i, n] >= 0
        q_dense = torch.zeros_like(p_at[i]).index_add_(0, q_ids[i, n][support], q_probs[i, n][support])
        residual = (p_at[i] - q_dense).clamp(min=0)
        # An all-zero residual means p <= q everywhere, i.e. p == q, where rejection has
        # probability 0; it is reachable only through rounding, and then p is the right answer.
        p_at[i] = residual if residual.sum() > 0 else p_at[i]
    tokens[rows, num_accepted] = sample_rows(p_at, generators)
    return _output(tokens, num_accepted), num_accepted
