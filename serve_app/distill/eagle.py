"""The EAGLE head as trained (Hugging Face modules, no KV cache), saved in the layout the runner
serves (``serve_app.models.eagle``).

Why this architecture for a tiny target: the 2-layer distilled decoder saturated at 0.35 held-out
agreement however much data it saw (``docs/speculation.md``), because two layers cannot
rebuild the context the target's thirty have already read. The EAGLE head starts from the target's
own final hidden state, so one layer only has to look one token further. Training follows EAGLE-1:
teacher-forced true features with uniform noise on the inputs, a smooth-L1 loss on the predicted
feature plus the distillation cross-entropy on its tokens.

Trained on true features alone, the head is accepted far less at the drafting steps after the first,
where it reads its own predictions (92 / 19 / 7 / 1 accepted per position in 286 rounds at k = 4).
``unrolled`` is the training-time test of EAGLE-3 (Li et al. 2025, arXiv 2503.01840): it runs the
head's k drafting steps over every position of a sequence at once, each step reading the previous
step's prediction and attending exactly as the served head's KV cache would (the true entries up to
where the draft began, then the draft's own), so training sees what drafting sees. Each step's loss
(cross-entropy plus the feature loss against the target's feature at the same position) is weighted
0.8^s (``train.STEP_DECAY``).

With fused layers (``fuse_layers``, EAGLE-3) the true features are the target's tapped residual
streams and its final state, folded by ``reduce``; it starts as a pass-through of the final state, so
a head trained on the final state alone can be extended and fine-tuned without losing what it knows.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from serve_app.distill.draft_model import init_draft, save_draft
from serve_app.models.eagle import FC_FILE, FEATURE_KEY, FUSE_KEY, fuse_layers


class EagleDraft(nn.Module):
    def __init__(self, lm: LlamaForCausalLM):
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.reduce: nn.Linear | None = None
        if taps := fuse_layers(lm.config):
            self.add_taps(taps)

    def add_taps(self, taps: tuple[int, ...]) -> None:
        """Read the target's residual streams after these layer counts too, through a ``reduce`` that
        starts as a pass-through of the final state (the head computes what it did before)."""
        hidden = self.lm.config.hidden_size
        self.reduce = nn.Linear((len(taps) + 1) * hidden, hidden, bias=False)
        with torch.no_grad():
            self.reduce.weight.zero_()
            self.reduce.weight[:, -hidden:] = torch.eye(hidden)
        setattr(self.lm.config, FUSE_KEY, list(taps))

    def true_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as the head reads them: its tapped streams and final state folded by
        ``reduce`` when it taps layers (``models.eagle``)."""
        return features if self.reduce is None else self.reduce(features)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted features ``[b, T, hidden]``, logits ``[b, T, vocab]``); features[:, j] is the
        target's feature at position j - 1 (zeros at 0)."""
        features = self.true_features(features)
        x = self.fc(torch.cat((self.lm.model.embed_tokens(input_ids), features), dim=-1))
        hidden = self.lm.model(inputs_embeds=x, attention_mask=attention_mask).last_hidden_state
        return hidden, self.lm.lm_head(hidden)


def _shift(x: torch.Tensor, by: int, dim: int) -> torch.Tensor:
    """x moved ``by`` places to later positions along ``dim``, zeros in front."""
    if by == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, min(by, x.shape[dim])))
    return torch.cat((pad, x.narrow(dim, 0, x.shape[dim] - pad.shape[dim])), dim=dim)


def unrolled(draft: EagleDraft, input_ids: torch.Tensor, features: torch.Tensor, steps: int
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(predicted features, logits) of drafting steps 0..steps-1, each ``[b, T, ...]``.

    Step s at position p is the (s+1)-th token of a draft that began at position p - s: step 0 reads
    the target's feature at p - 1 (``features`` as for ``forward``), step s > 0 reads step s - 1's
    prediction at p - 1. Its query attends to step 0's keys at positions <= p - s (the cache entries
    built from true features) and to step r's key at p - s + r for r = 1..s (the draft's own
    entries), as the served head (``serve_app.models.eagle``) does. The tokens are the sequence's own:
    a draft only matters while it is accepted, i.e. equal to them. Right padding is harmless (no
    real position attends to a later one). Step 0 equals ``draft(input_ids, features, ...)``."""
    model, layer = draft.lm.model, draft.lm.model.layers[0]
    attn = layer.self_attn
    b, T = input_ids.shape
    embeds = model.embed_tokens(input_ids)
    cos, sin = model.rotary_emb(embeds, torch.arange(T, device=embeds.device)[None])
    pos = torch.arange(T, device=embeds.device)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    out, feed = [], draft.true_features(features)
    for s in range(steps):
        x = draft.fc(torch.cat((embeds, feed), dim=-1))
        h = layer.input_layernorm(x)
        shape = (b, T, -1, attn.head_dim)
        q = attn.q_proj(h).view(shape).transpose(1, 2)
        k = attn.k_proj(h).view(shape).transpose(1, 2)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(repeat_kv(k, attn.num_key_value_groups))
        values.append(repeat_kv(v, attn.num_key_value_groups))
        scores = (q @ keys[0].transpose(-1, -2)) * attn.scaling  # [b, heads, T, T]
        scores = scores.masked_fill(pos[None, :] > pos[:, None] - s, float("-inf"))
        own_k = [_shift(keys[r], s - r, dim=2) for r in range(1, s + 1)]
        own_v = [_shift(values[r], s - r, dim=2) for r in range(1, s + 1)]
        own = [((q * kr).sum(-1, keepdim=True) * attn.scaling).masked_fill((pos < s - r)[:, None], float("-inf"))
               for r, kr in zip(range(1, s + 1), own_k, strict=True)]
        weights = torch.softmax(torch.cat([scores, *own], dim=-1), dim=-1)
        mixed = weights[..., :T] @ values[0]
        for r, vr in enumerate(own_v):
            mixed = mixed + weights[..., T + r: T + r + 1] * vr
        x = x + attn.o_proj(mixed.transpose(1, 2).reshape(b, T, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = model.norm(x)
        out.append((hidden, draft.lm.lm_head(hidden)))
        feed = _shift(hidden, 1, dim=1)
    return out


def init_eagle(target_path: Path, vocab: list[int], taps: tuple[int, ...] = ()) -> EagleDraft:
    """One layer initialised from the target's last, its final norm, and its embedding rows; reading
    the target's streams after ``taps`` layers too when given."""
    from transformers import AutoConfig

    last = AutoConfig.from_pretrained(target_path).num_hidden_layers - 1
    lm = init_draft(target_path, vocab, layers=(last,))
    setattr(lm.config, FEATURE_KEY, lm.config.hidden_size)
    draft = EagleDraft(lm)
    if taps:
        draft.add_taps(taps)
    return draft


def save_eagle(draft: EagleDraft, vocab: list[int], target_path: Path, out: Path,
               dtype: torch.dtype = torch.bfloat16) -> None:
    save_draft(draft.lm, vocab, target_path, out, dtype)
    parts = {"fc": draft.fc, "reduce": draft.reduce}
    save_file({f"{name}.{k}": v.detach().to(dtype).contiguous()
               for name, part in parts.items() if part is not None for k, v in part.state_dict().items()},
              out / FC_FILE)


def load_eagle(path: Path) -> EagleDraft:
    """A saved head, to train further (``distill --init``)."""
    draft = EagleDraft(LlamaForCausalLM.from_pretrained(path, dtype=torch.float32))
    weights = load_file(path / FC_FILE)
    for name in ("fc", "reduce"):
        part = getattr(draft, name)
        if part is not None:
            part.load_state_dict({k.removeprefix(f"{name}."): v.float() for k, v in weights.items()
                                  if k.startswith(f"{name}.")})
    return draft
