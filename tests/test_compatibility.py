"""Draft compatibility: the same token ids, the same special tokens, a reconcilable vocabulary."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from serve_app.speculation.compatibility import VOCAB_FILE, DraftMismatchError, check_draft


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_same_family_draft_passes(tiny_models):
    assert check_draft(tiny_models["qwen3"], tiny_models["qwen3_draft"]) == []


def test_other_tokenizer_is_named(tiny_models, tmp_path):
    draft = copy(tiny_models["llama_draft"], tmp_path / "d")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["completely different text " * 50, "zebra yak xylophone"] * 4, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|im_end|>", "<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|im_end|>").save_pretrained(draft)
    with pytest.raises(DraftMismatchError, match="tokenizer: .* target tokens have another id"):
        check_draft(tiny_models["llama"], draft)


def test_other_special_tokens_are_named(tiny_models, tmp_path):
    draft = copy(tiny_models["llama_draft"], tmp_path / "d")
    config = json.loads((draft / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|endoftext|>"
    (draft / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DraftMismatchError, match="special token eos_token: target '<\\|im_end\\|>'"):
        check_draft(tiny_models["llama"], draft)


def test_vocabulary_sizes(tiny_models, tmp_path):
    draft = copy(tiny_models["llama_draft"], tmp_path / "d")
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(DraftMismatchError, match="vocab_size: the draft embeds 100 ids"):
        check_draft(tiny_models["llama"], draft)
    (draft / VOCAB_FILE).write_text(json.dumps({"target_ids": list(range(50))}))
    with pytest.raises(DraftMismatchError, match="lists 50 ids but the draft's vocab_size is 100"):
        check_draft(tiny_models["llama"], draft)
    (draft / VOCAB_FILE).write_text(json.dumps({"target_ids": list(range(99))}))
    assert "reduced vocabulary" in check_draft(tiny_models["llama"], draft)[0]


def test_cli(tiny_models):
    ok = subprocess.run([sys.executable, "-m", "serve_app", "check-draft", "--target", str(tiny_models["llama"]),
                         "--draft", str(tiny_models["llama_draft"])], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("ok:")
    bad = subprocess.run([sys.executable, "-m", "serve_app", "check-draft", "--target", str(tiny_models["llama"]),
                          "--draft", "/no/such/draft"], capture_output=True, text=True)
    assert bad.returncode != 0 and "does not exist" in bad.stderr
