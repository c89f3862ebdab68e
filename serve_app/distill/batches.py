"""Training batches for ``distill``: teacher items padded into tensors, and an EAGLE head's drafting
steps unrolled over them (shared by the loss in ``train.py`` and the measurements in ``evaluate.py``)."""

from __future__ import annotations

import torch

from serve_app.distill.eagle import unrolled


def padded_inputs(items, to_draft: torch.Tensor, n_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft-vocabulary inputs [b, T] (every token but the last) and their attention mask."""
    T = max(len(it["ids"]) - 1 for it in items)
    inputs = torch.full((len(items), T), n_vocab, dtype=torch.long)
    mask = torch.zeros(len(items), T, dtype=torch.long)
    for i, it in enumerate(items):
        n = len(it["ids"]) - 1
        inputs[i, :n], mask[i, :n] = to_draft[it["ids"][:-1]], 1
    return inputs, mask


def padded_features(feats: list[torch.Tensor], T: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE inputs (the features before each position, zeros at 0) and targets (each position's own
    final state: the last ``hidden`` columns, after any tapped streams)."""
    inputs, targets = torch.zeros(len(feats), T, feats[0].shape[-1]), torch.zeros(len(feats), T, hidden)
    for i, f in enumerate(feats):
        targets[i, : len(f)] = f[:, -hidden:].float()
        inputs[i, 1: len(f)] = f[:-1].float()
    return inputs, targets


def eagle_steps(draft, items, feats, to_draft: torch.Tensor, n_vocab: int, steps: int, noise: float = 0.0):
    """The head's drafting steps unrolled over a batch (``unrolled``): ([(features, logits)], the
    target's features, the padding mask)."""
    inputs, mask = padded_inputs(items, to_draft, n_vocab)
    f_in, f_target = padded_features(feats, inputs.shape[1], draft.lm.config.hidden_size)
    if noise:
        f_in = f_in + (torch.rand_like(f_in) - 0.5) * noise
    return unrolled(draft, inputs, f_in, steps), f_target, mask
