"""FAKE NxDI causal LM (see the package docstring). Records every forward in ``calls``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from neuronx_distributed_inference.models.config import InferenceConfig
from serve_app.models.llama import Batch
from serve_app.models.runner import load_causal_lm

COMPILED_FILE = "model.pt"  # NxDI writes its traced graphs here


class FakeNeuronCausalLM:
    _config_cls = InferenceConfig
    calls: list[dict] = []  # every forward of every instance (tests clear it)
    compiles: list[str] = []

    def __init__(self, model_path, config=None):
        self.model_path = Path(model_path)
        self.config = config
        self.nc = config.neuron_config
        self.model = None

    @classmethod
    def get_config_cls(cls):
        return cls._config_cls

    def compile(self, compiled_model_path):
        folder = Path(compiled_model_path)
        (folder / COMPILED_FILE).write_text(json.dumps(vars(self.nc), default=str))
        FakeNeuronCausalLM.compiles.append(str(folder))

    def load(self, compiled_model_path):
        if not (Path(compiled_model_path) / COMPILED_FILE).is_file():
            raise FileNotFoundError(f"{compiled_model_path}/{COMPILED_FILE}")
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[self.nc.torch_dtype]
        self.model = load_causal_lm(self.model_path, dtype)
        self.model.setup_caches(self.nc.batch_size, self.nc.seq_len, dtype)

    def forward(self, input_ids=None, seq_ids=None, attention_mask=None, position_ids=None):
        assert self.model is not None, "forward before load"
        b, n = input_ids.shape
        assert position_ids.shape == (b, n) and seq_ids.shape == (b,)
        assert int(seq_ids.max()) < self.nc.batch_size and len(set(seq_ids.tolist())) == b
        spec = self.nc.speculation_length
        if int(position_ids.min()) == 0:
            graph = "context_encoding"
            assert b == 1 and n <= self.nc.max_context_length  # ctx_batch_size 1
            assert attention_mask.shape == (1, n) and bool(attention_mask.all())
        elif spec and n == spec:
            graph = "speculation"
        elif not spec and n == 1:
            graph = "token_generation"
        else:
            raise RuntimeError(f"no compiled graph takes {n} tokens (speculation_length={spec})")
        starts = position_ids[:, 0]
        assert bool((position_ids == starts[:, None] + torch.arange(n)).all()), "positions must be contiguous"
        assert int(position_ids.max()) < self.nc.seq_len, "write past the compiled sequence length"
        FakeNeuronCausalLM.calls.append({"graph": graph, "input_ids": input_ids.clone(),
                                         "position_ids": position_ids.clone(), "seq_ids": seq_ids.clone(),
                                         "attention_mask": attention_mask.clone()})
        context = int(position_ids.max()) + 1
        keys = torch.arange(context)
        if graph == "context_encoding":
            visible = torch.zeros(b, context, dtype=torch.bool)
        else:  # the cached positions the mask marks
            width = attention_mask.shape[1]
            visible = torch.zeros(b, context, dtype=torch.bool)
            visible[:, : min(width, context)] = attention_mask[:, :context].bool()
        block = (keys[None, None] >= starts[:, None, None]) & (keys[None, None] <= position_ids[:, :, None])
        mask = (visible[:, None] | block)[:, None]  # [b, 1, n, context]
        batch = Batch(input_ids.long(), position_ids.long(), seq_ids.long(), mask, context)
        logits = self.model.lm_head(self.model.hidden_states(batch)).float()
        if graph == "context_encoding":
            logits = logits[:, -1:]  # NxDI returns the last (highest-position) token's logits
        return SimpleNamespace(logits=logits)

    __call__ = forward
