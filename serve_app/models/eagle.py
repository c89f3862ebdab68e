"""An EAGLE draft head (Li et al. 2024, arXiv 2401.15077): a one-layer decoder that reads the target.

At position j it takes the target's final-norm hidden state at j - 1 (the *feature* from which the
target predicted token j) together with the embedding of token j, fuses them with ``fc``, runs one
decoder layer and its norm, and so predicts the target's feature at j, whose ``lm_head`` row gives
the token at j + 1. While drafting it feeds its own predicted feature forward in place of the
target's; each verify result brings the true features back (``VerifyResult.features``).

On disk it is a Llama folder with one layer (the draft's reduced vocabulary, ``draft_vocab.json``,
as for the distilled decoder), ``eagle_feature_size`` in config.json, and ``fc.*`` in
``eagle_fc.safetensors``. The rest of the runner (KV cache, rotary tables, slots) is the Llama one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from serve_app.models.llama import Batch, CausalLM

FEATURE_KEY = "eagle_feature_size"  # config.json: the target hidden size this head reads
FC_FILE = "eagle_fc.safetensors"


def is_eagle(config: PretrainedConfig) -> bool:
    return getattr(config, FEATURE_KEY, None) is not None


def is_eagle_folder(path: str | Path) -> bool:
    """Does this model folder hold an EAGLE head (read from config.json, nothing loaded)?"""
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get(FEATURE_KEY) is not None


class EagleHead(CausalLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.feature_size = int(getattr(config, FEATURE_KEY))
        self.fc = nn.Linear(config.hidden_size + self.feature_size, config.hidden_size, bias=True)

    def hidden_states(self, batch: Batch, features: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted features ``[batch, T, hidden]`` from tokens and the features before them."""
        if features is None:
            raise ValueError("an EAGLE head needs the target's features for every token it is fed")
        x = self.model.embed_tokens(batch.tokens)
        x = self.fc(torch.cat((x, features.to(device=x.device, dtype=x.dtype)), dim=-1))
        return self.run_layers(x, batch)
