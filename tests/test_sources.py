"""Model sources: folders, GGUF files, the embedded name, and the errors a user sees."""

from __future__ import annotations

import json
import shutil

import pytest

from serve_app.models.base import ModelLoadError
from serve_app.models.runner import ModelRunner
from serve_app.models.sources import ModelSourceError, resolve


def test_missing_path_names_the_accepted_forms(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist.*Hugging Face folder.*gguf.*smollm2-135m-instruct"):
        resolve(str(tmp_path / "nope"))


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match="no \\*.safetensors"):
        resolve(str(tmp_path))


def test_plain_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"123")
    with pytest.raises(ModelSourceError, match="not a .gguf file"):
        resolve(str(f))


def test_corrupt_gguf_is_a_clear_error_and_leaves_no_cache(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelSourceError, match="cannot read GGUF file"):
        resolve(str(f), cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache" / "models").iterdir() if not p.name.endswith(".lock")]


def test_unsupported_architecture(tiny_models, tmp_path):
    folder = tmp_path / "gpt"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported.*llama"):
        ModelRunner(resolve(str(folder)))


def test_corrupt_safetensors(tiny_models, tmp_path):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_models["llama"], folder)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="corrupt or unreadable safetensors"):
        ModelRunner(resolve(str(folder)))


@pytest.mark.slow
def test_embedded_model_is_converted_once_and_reloads_fast(smollm2_path):
    import time

    start = time.perf_counter()
    again = resolve("smollm2-135m-instruct")
    assert again == smollm2_path
    assert time.perf_counter() - start < 1.0
    assert (again / "model.safetensors").is_file() and (again / "tokenizer.json").is_file()
    config = json.loads((again / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config


@pytest.mark.slow
def test_a_gguf_converted_a_tensor_at_a_time_holds_what_transformers_loads(smollm2_path, tmp_path, monkeypatch):
    """``models.gguf`` streams tensors into shards; the weights are exactly transformers' own GGUF load
    (float32), and in bfloat16 exactly those rounded; shards and their index follow Hugging Face's names."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from serve_app.models import gguf
    from serve_app.models.sources import embedded_gguf

    path = embedded_gguf("smollm2-135m-instruct")
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32").state_dict()
    monkeypatch.setattr(gguf, "SHARD_BYTES", 64 << 20)  # several shards
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        out.mkdir()
        gguf.write_hf_folder(path, out, dtype)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(out.glob("model-*-of-*.safetensors"))
        assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
        state = {k: v for s in shards for k, v in load_file(s).items()}
        assert set(state) == set(reference) - {"lm_head.weight"}  # tied: the embedding serves as the head
        for name, tensor in state.items():
            assert torch.equal(tensor, reference[name].to(getattr(torch, dtype))), name
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
