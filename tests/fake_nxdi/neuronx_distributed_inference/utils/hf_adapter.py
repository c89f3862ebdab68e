"""FAKE ``load_pretrained_config`` (see the package docstring)."""

from transformers import AutoConfig


def load_pretrained_config(model_path):
    def load_config(config):
        config.hf_config = AutoConfig.from_pretrained(model_path)
        config.vocab_size = config.hf_config.vocab_size

    return load_config
