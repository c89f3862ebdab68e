"""FAKE NxDI Llama classes (see the package docstring)."""

from neuronx_distributed_inference.models.config import InferenceConfig
from neuronx_distributed_inference.models.fake_model import FakeNeuronCausalLM


class LlamaInferenceConfig(InferenceConfig):
    pass


class NeuronLlamaForCausalLM(FakeNeuronCausalLM):
    _config_cls = LlamaInferenceConfig
