"""FAKE NxDI Qwen3 classes (see the package docstring)."""

from neuronx_distributed_inference.models.config import InferenceConfig
from neuronx_distributed_inference.models.fake_model import FakeNeuronCausalLM


class Qwen3InferenceConfig(InferenceConfig):
    pass


class NeuronQwen3ForCausalLM(FakeNeuronCausalLM):
    _config_cls = Qwen3InferenceConfig
