"""An EAGLE draft head (Li et al. 2024, arXiv 2401.15077): a one-layer decoder that reads the target.

At position j it takes the target's final-norm hidden state at j - 1 (the *feature* from which the
target predicted token j) together with the embedding of token j, fuses them with ``fc``, runs one
decoder layer and its norm, and so predicts the target's feature at j, whose ``lm_head`` row gives
the token at j + 1. While drafting it feeds its own predicted feature forward in place of the
target's; each verify result brings the true features back (``VerifyResult.features``).

With ``eagle_fuse_layers`` in its config (EAGLE-3, Li et al. 2025, arXiv 2503.01840) the target ships
more than its final state: the residual stream after each listed number of its layers too, low and
middle ones, which keep what the final layer, tuned to the next token, has dropped. ``reduce`` folds
them into one feature of the target's width (the target RMS-normalises each tapped stream, as their
scale grows with depth); the head's own predicted features, fed back while drafting, are that width
already.

On disk it is a Llama folder with one layer (the draft's reduced vocabulary, ``draft_vocab.json``,
as for the distilled decoder), ``eagle_feature_size`` (and ``eagle_fuse_layers``) in config.json, and
``fc.*`` (and ``reduce.*``) in ``eagle_fc.safetensors``. The rest of the runner (KV cache, rotary
tables, slots) is the Llama one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from serve_app.models.llama import Batch, CausalLM

FEATURE_KEY = "eagle_feature_size"  # config.json: the target hidden size this head reads
FUSE_KEY = "eagle_fuse_layers"  # config.json: the target's tapped layer counts, fused with its final state
FC_FILE = "eagle_fc.safetensors"


def is_eagle(config: PretrainedConfig) -> bool:
    return getattr(config, FEATURE_KEY, None) is not None


def _folder_config(path: str | Path) -> dict:
    config = Path(path) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def is_eagle_folder(path: str | Path) -> bool:
    """Does this model folder hold an EAGLE head (read from config.json, nothing loaded)?"""
    return _folder_config(path).get(FEATURE_KEY) is not None


def fuse_layers(config: PretrainedConfig | dict) -> tuple[int, ...]:
    """The target layer counts whose residual streams this head fuses (empty: the final state alone)."""
    value = config.get(FUSE_KEY) if isinstance(config, dict) else getattr(config, FUSE_KEY, None)
    return tuple(int(n) for n in value or ())


def folder_fuse_layers(path: str | Path) -> tuple[int, ...]:
    """``fuse_layers`` of the head in this folder, read from config.json: the taps its target ships."""
    return fuse_layers(_folder_config(path))


class EagleHead(CausalLM):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        self.feature_size = int(getattr(config, FEATURE_KEY))
        self.fuse_layers = fuse_layers(config)
        self.fc = nn.Linear(config.hidden_size + self.feature_size, config.hidden_size, bias=True)
        width = (len(self.fuse_layers) + 1) * self.feature_size
        self.reduce = nn.Linear(width, self.feature_size, bias=False) if self.fuse_layers else None

    def hidden_states(self, batch: Batch, features: torch.Tensor | None = None, taps: tuple[int, ...] = (),
                      depth: int | None = None) -> torch.Tensor:
        """Predicted features ``[batch, T, hidden]`` from tokens and the features before them: the
        target's (fused when this head taps its layers) or the head's own predictions."""
        if features is None:
            raise ValueError("an EAGLE head needs the target's features for every token it is fed")
        if taps or depth is not None:
            raise ValueError("an EAGLE head has no layers to tap")
        x = self.model.embed_tokens(batch.tokens)
        features = features.to(device=x.device, dtype=x.dtype)
        if self.reduce is not None and features.shape[-1] != self.feature_size:
            features = self.reduce(features)  # the target's tapped streams and final state, folded
        x = self.fc(torch.cat((x, features), dim=-1))
        return self.run_layers(x, batch)
