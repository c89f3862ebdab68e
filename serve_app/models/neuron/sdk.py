"""The boundary with the Neuron SDK: the only module that imports it, and only when asked.

Followed: ``examples/generation_demo.py`` of aws-neuron/neuronx-distributed-inference (build the
``InferenceConfig`` from a ``NeuronConfig`` and ``load_pretrained_config(model_path)``, then
``model.compile(path)`` / ``model.load(path)``) and ``models/application_base.py``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol

from serve_app.models.base import ModelLoadError
from serve_app.models.neuron.spec import NeuronSpec

INSTALL_HINT = (
    "The Neuron backend needs the AWS Neuron SDK, which runs only on Trainium/Inferentia instances. "
    "Use the image built from kuberay/Dockerfile.trn2 (AWS's Neuron inference image), or a Neuron DLAMI "
    "environment, or install it with: pip install neuronx-distributed-inference "
    "--extra-index-url=https://pip.repos.neuron.amazonaws.com . Elsewhere set engine.backend: torch."
)

# HF model_type -> (module, NxDI causal-LM class); its InferenceConfig is cls.get_config_cls().
MODEL_CLASSES = {
    "llama": ("neuronx_distributed_inference.models.llama.modeling_llama", "NeuronLlamaForCausalLM"),
    "qwen2": ("neuronx_distributed_inference.models.qwen2.modeling_qwen2", "NeuronQwen2ForCausalLM"),
    "qwen3": ("neuronx_distributed_inference.models.qwen3.modeling_qwen3", "NeuronQwen3ForCausalLM"),
    "mistral": ("neuronx_distributed_inference.models.mistral.modeling_mistral", "NeuronMistralForCausalLM"),
}


class NeuronSDKMissing(ModelLoadError):
    """``backend: neuron`` chosen where the Neuron SDK is not installed."""


class NeuronModel(Protocol):
    """What the runner needs of an NxDI ``NeuronBaseForCausalLM``."""

    def compile(self, compiled_model_path: str) -> None: ...

    def load(self, compiled_model_path: str) -> None: ...

    def forward(self, input_ids: Any, seq_ids: Any = None, attention_mask: Any = None,
                position_ids: Any = None) -> Any: ...


class NxDI:
    """Builds NxDI models; tests substitute a fake at exactly this boundary."""

    def __init__(self) -> None:
        try:
            self.hf_adapter = importlib.import_module("neuronx_distributed_inference.utils.hf_adapter")
        except ImportError as e:
            raise NeuronSDKMissing(f"{INSTALL_HINT} (import failed: {e})") from e

    def build(self, model_path: Path, model_type: str, spec: NeuronSpec) -> NeuronModel:
        if model_type not in MODEL_CLASSES:
            raise ModelLoadError(f"{model_path}: model_type {model_type!r} has no NxDI class here; "
                                 f"supported on Neuron: {', '.join(MODEL_CLASSES)}")
        module, name = MODEL_CLASSES[model_type]
        model_cls = getattr(importlib.import_module(module), name)
        config_cls = model_cls.get_config_cls()
        neuron_config = config_cls.get_neuron_config_cls()(**spec.neuron_config_kwargs())
        config = config_cls(neuron_config, load_config=self.hf_adapter.load_pretrained_config(str(model_path)))
        return model_cls(str(model_path), config)
