"""The EAGLE head as trained (Hugging Face modules, no KV cache), saved in the layout the runner
serves (``serve_app.models.eagle``).

Why this architecture for a tiny target: the 2-layer distilled decoder saturated at 0.35 held-out
agreement however much data it saw (``serve_app/drafts/README.md``), because two layers cannot
rebuild the context the target's thirty have already read. The EAGLE head starts from the target's
own final hidden state, so one layer only has to look one token further. Training follows EAGLE-1:
teacher-forced true features with uniform noise on the inputs, a smooth-L1 loss on the predicted
feature plus the distillation cross-entropy on its tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaForCausalLM

from serve_app.distill.draft_model import init_draft, save_draft
from serve_app.models.eagle import FC_FILE, FEATURE_KEY


class EagleDraft(nn.Module):
    def __init__(self, lm: LlamaForCausalLM):
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted features ``[b, T, hidden]``, logits ``[b, T, vocab]``); features[:, j] is the
        target's feature at position j - 1 (zeros at 0)."""
        x = self.fc(torch.cat((self.lm.model.embed_tokens(input_ids), features), dim=-1))
        hidden = self.lm.model(inputs_embeds=x, attention_mask=attention_mask).last_hidden_state
        return hidden, self.lm.lm_head(hidden)


def init_eagle(target_path: Path, vocab: list[int]) -> EagleDraft:
    """One layer initialised from the target's last, its final norm, and its embedding rows."""
    from transformers import AutoConfig

    last = AutoConfig.from_pretrained(target_path).num_hidden_layers - 1
    lm = init_draft(target_path, vocab, layers=(last,))
    setattr(lm.config, FEATURE_KEY, lm.config.hidden_size)
    return EagleDraft(lm)


def save_eagle(draft: EagleDraft, vocab: list[int], target_path: Path, out: Path,
               dtype: torch.dtype = torch.bfloat16) -> None:
    save_draft(draft.lm, vocab, target_path, out, dtype)
    save_file({f"fc.{k}": v.detach().to(dtype).contiguous() for k, v in draft.fc.state_dict().items()}, out / FC_FILE)


def load_eagle(path: Path) -> EagleDraft:
    """A saved head, to train further (``distill --init``)."""
    draft = EagleDraft(LlamaForCausalLM.from_pretrained(path, dtype=torch.float32))
    draft.fc.load_state_dict({k.removeprefix("fc."): v.float() for k, v in load_file(path / FC_FILE).items()})
    return draft
