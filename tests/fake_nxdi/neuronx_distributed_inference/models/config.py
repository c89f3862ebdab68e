"""FAKE ``NeuronConfig`` / ``InferenceConfig`` (see the package docstring)."""

from __future__ import annotations

# Keyword arguments NxDI's NeuronConfig.__init__ pops (a subset of the real list: those a serving
# engine may set). NxDI only logs "Unexpected keyword arguments" for the rest, and a silently ignored
# setting is a wrong compile: the fake raises instead.
KNOWN_KWARGS = {
    "batch_size", "padding_side", "seq_len", "n_active_tokens", "n_positions", "on_cpu", "output_logits",
    "torch_dtype", "max_context_length", "max_new_tokens", "max_length", "fused_qkv", "ctx_batch_size",
    "tkg_batch_size", "max_batch_size", "is_continuous_batching", "on_device_sampling_config",
    "enable_bucketing", "buckets", "context_encoding_buckets", "token_generation_buckets",
    "speculation_length", "spec_batch_size", "enable_fused_speculation", "enable_eagle_speculation",
    "tp_degree", "logical_nc_config", "save_sharded_checkpoint", "apply_seq_ids_mask", "async_mode",
    "sequence_parallel_enabled", "flash_decoding_enabled", "attn_kernel_enabled", "skip_warmup",
}


class NeuronConfig:
    def __init__(self, **kwargs):
        unknown = set(kwargs) - KNOWN_KWARGS
        if unknown:
            raise TypeError(f"NeuronConfig got unexpected arguments {sorted(unknown)}")
        self.batch_size = kwargs.get("batch_size", 1)
        self.seq_len = kwargs.get("seq_len", 128)
        self.max_context_length = kwargs.get("max_context_length", self.seq_len)
        self.speculation_length = kwargs.get("speculation_length", 0)
        self.__dict__.update(kwargs)


class InferenceConfig:
    def __init__(self, neuron_config, load_config=None, **kwargs):
        self.neuron_config = neuron_config
        if load_config is not None:
            load_config(self)
        self.__dict__.update(kwargs)

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig
