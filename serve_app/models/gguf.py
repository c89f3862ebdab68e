"""Convert a GGUF checkpoint into a Hugging Face folder, one tensor at a time.

transformers reads a GGUF file's config and tokenizer, and knows how its tensor names map onto the
Hugging Face model's (``get_gguf_hf_weights_map`` and the per-architecture tensor processors, which
undo llama.cpp's reordering where it applies). Loading the whole model through it holds every
tensor dequantized at once (5.6 GB peak for a 1.5 B model in float32); here the file is memory-mapped
(``gguf.GGUFReader``), each tensor is dequantized, cast to the target dtype and added to a safetensors
shard of at most ``SHARD_BYTES``, written as soon as it is full. Peak memory is a shard plus one
tensor, well under one copy of the model. The folder has ``config.json`` (with ``architectures``),
``generation_config.json``, the tokenizer (with the chat template) and ``model.safetensors.index.json``,
so transformers, vLLM and this project's runner all load it as they load any checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from serve_app.models.dtype import DType

SHARD_BYTES = 1 << 30  # a shard in memory at a time


def write_hf_folder(path: Path, out: Path, dtype: DType) -> None:
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if hasattr(config, "quantization_config"):  # the weights written are dequantized
        del config.quantization_config
    config.torch_dtype = torch_dtype
    with torch.device("meta"):  # names and shapes only: no memory for weights
        model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]

    reader = GGUFReader(path)  # memory-mapped
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed.get("config", {}))
    names = get_gguf_hf_weights_map(model, processor)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}

    shard: dict[str, torch.Tensor] = {}
    files: dict[str, str] = {}
    written: set[str] = set()

    def flush() -> None:
        name = f"shard-{len(set(files.values())) + 1:05d}.tmp"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.update(dict.fromkeys(shard, name))
        shard.clear()

    for tensor in reader.tensors:
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters=parsed)
        if result.name not in names:
            continue
        hf_name = names[result.name]
        shard[hf_name] = torch.from_numpy(np.array(result.weights)).to(torch_dtype)  # a copy: not the file's map
        written.add(hf_name)
        if sum(t.numel() * t.element_size() for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    missing = expected - written
    if missing:
        raise ValueError(f"{path.name}: no tensor for {sorted(missing)[:5]} ({len(missing)} missing)")
    _name_shards(out, files, sum(model.state_dict()[k].numel() for k in written) * torch_dtype.itemsize)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)


def _name_shards(out: Path, files: dict[str, str], total_bytes: int) -> None:
    """Hugging Face's names: one shard is ``model.safetensors``; several are ``model-0000i-of-0000n``
    with ``model.safetensors.index.json`` mapping each tensor to its shard."""
    shards = sorted(set(files.values()))
    if len(shards) == 1:
        (out / shards[0]).rename(out / "model.safetensors")
        return
    final = {s: f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, s in enumerate(shards, start=1)}
    for temp, name in final.items():
        (out / temp).rename(out / name)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": {k: final[v] for k, v in sorted(files.items())}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
