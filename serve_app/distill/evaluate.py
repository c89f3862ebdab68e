"""How well a draft in training will draft: agreement with the target's greedy tokens, and the mean
acceptance length greedy decoding would see, on held-out responses and on as many training ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serve_app.distill.batches import eagle_steps, padded_inputs

# training agreement this far above held-out at the end of a run: say that data, not steps, limits the draft
OVERFIT_GAP = 0.1


@torch.inference_mode()
def acceptance(draft, items, feats, to_draft: torch.Tensor, to_target: torch.Tensor, n_vocab: int,
               k: int = 4) -> tuple[float, float]:
    """On greedy responses: (P(draft argmax == target's greedy token) at the first drafting step, mean
    acceptance length at k, i.e. tokens per target pass as greedy decoding would see them). An EAGLE
    head's k steps are unrolled as it drafts, from every position, and ``decoding_walk`` picks the
    positions where decoding begins a draft; for a decoder, whose steps read only tokens, the length
    is estimated from the agreement a as 1 + a + ... + a^k."""
    hits = total = tokens = passes = 0
    for lo in range(0, len(items), 16):
        chunk = items[lo: lo + 16]
        if feats is None:
            inputs, mask = padded_inputs(chunk, to_draft, n_vocab)
            steps = [draft(input_ids=inputs, attention_mask=mask).logits]
        else:
            steps = [logits for _, logits in eagle_steps(draft, chunk, feats[lo: lo + 16], to_draft, n_vocab, k)[0]]
        guesses = [to_target[logits[..., :n_vocab].argmax(-1)] for logits in steps]
        for i, it in enumerate(chunk):
            n, first = len(it["ids"]) - 1, it["first"]
            match = torch.stack([g[i, first:n] == it["greedy"] for g in guesses]).float()  # [steps, positions]
            hits += int(match[0].sum())
            total += n - first
            if feats is not None:  # row s moved s places back: column j = a draft begun at j
                runs = torch.stack([F.pad(m[s:], (0, s)) for s, m in enumerate(match)]).cumprod(0)
                t, p = decoding_walk(1 + runs.sum(0))
                tokens, passes = tokens + t, passes + p
    agreement = hits / max(total, 1)
    return agreement, tokens / passes if passes else expected_length(agreement, k)


def decoding_walk(lengths: torch.Tensor) -> tuple[int, int]:
    """(tokens, target passes) of greedy decoding along a response, given the tokens one pass yields
    with a draft begun at each position: decoding begins its next draft where the last pass ended,
    so it skips the easy positions inside accepted runs that a mean over positions counts."""
    at = tokens = passes = 0
    while at < len(lengths):
        step = int(lengths[at])
        tokens, passes, at = tokens + step, passes + 1, at + step
    return tokens, passes


def data_note(train_agreement: float, heldout_agreement: float) -> str | None:
    """What to do next when the draft fits the responses it trained on far better than held-out ones."""
    if train_agreement - heldout_agreement <= OVERFIT_GAP:
        return None
    return (f"the draft agrees {train_agreement:.2f} with the target on responses it trained on, "
            f"{heldout_agreement:.2f} on held-out ones: it is short of data more than of steps; "
            "more prompts (--synth-prompts) will help more than more --minutes")


def expected_length(agreement: float, k: int = 4) -> float:
    return sum(agreement ** j for j in range(k + 1))
