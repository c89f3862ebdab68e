"""Shared fixtures: tiny random Llama-family models (built in milliseconds) and the real embedded model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

TINY_VOCAB = 320
CORPUS = [
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIGS = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config, "mistral": MistralConfig}


_EXIT_STATUS: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process with pytest's own exit status once every report is written, skipping the native
    libraries' teardown. After the whole suite (a few dozen Ray clusters started and stopped in this process,
    torch's thread pools, our kernels), that teardown has died of SIGSEGV now and then (CI at 6e87263; here at
    acc2c1c, 453 passed and the status 139) after Python's own finalization: faulthandler, kept on to the end,
    printed nothing. The crash is not in any test, and it hid their status."""
    if _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def make_tiny_model(path: Path, kind: str = "llama", seed: int = 0, layers: int = 2, **overrides) -> Path:
    """A random model of the given family, saved as a Hugging Face folder with a tokenizer."""
    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    kwargs = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](**kwargs))
    # Sharpen the output layer so greedy continuations are not ties and sampling is not uniform.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    out = {kind: make_tiny_model(root / kind, kind) for kind in CONFIGS}
    out["llama_draft"] = make_tiny_model(root / "llama_draft", "llama", seed=1, layers=1)
    out["qwen3_draft"] = make_tiny_model(root / "qwen3_draft", "qwen3", seed=2, layers=1)
    out["qwen3_near"] = perturbed_copy(out["qwen3"], root / "qwen3_near", scale=2.0)
    out["llama_reduced"] = reduced_vocab_draft(out["llama"], root / "llama_reduced")
    return out


@pytest.fixture(scope="session")
def tiny_eagle(tmp_path_factory, tiny_models) -> Path:
    """An EAGLE head for the tiny Llama, trained for 800 steps (seconds) by the distill pipeline; returns
    the run folder (the head is in ``draft/``)."""
    from serve_app.distill.train import DistillConfig, distill

    out = tmp_path_factory.mktemp("eagle") / "run"
    distill(DistillConfig(target=str(tiny_models["llama"]), out=out, arch="eagle", minutes=5, max_steps=800,
                          vocab_size=200, max_prompts=6, samples_per_prompt=2, max_new_tokens=12, text_docs=3,
                          text_tokens=32, batch_size=4, eval_every=200, gen_batch=8))
    return out


def reduced_vocab_draft(target: Path, out: Path) -> Path:
    """An untrained distill-style draft: the target's layers, 200 of its 320 tokens."""
    from serve_app.distill.draft_model import init_draft, save_draft, select_vocab

    tokenizer = tiny_tokenizer()
    vocab = select_vocab([tokenizer.encode(t) for t in CORPUS], tokenizer.all_special_ids, 200)
    save_draft(init_draft(target, vocab, layers=(0, 1)), vocab, target, out, dtype=torch.float32)
    return out


def perturbed_copy(path: Path, out: Path, scale: float) -> Path:
    """A draft that agrees with the target often but not always: its weights plus noise."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(torch.randn(w.shape, generator=gen) * w.std() * scale)
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real embedded model (converted from GGUF once per machine, cached)."""
    from serve_app.models.sources import resolve

    return resolve("smollm2-135m-instruct")


from tests.serve_cluster import cluster, metrics_port  # noqa: E402, F401  (the Serve tests' Ray cluster)
