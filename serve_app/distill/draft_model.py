"""The draft architecture for a given target, and its reduced output vocabulary.

Choice (DESIGN.md, "Training a draft here"): a small decoder of the target's own family and width,
with 2 layers initialised from the target's first and last layers, the target's final norm, and a
*reduced vocabulary*: the N token ids most frequent in the target's own outputs (plus every special
token). Its embedding (tied, as in SmolLM2) holds only those N rows (+1 row for "any other token" on
the input side), taken from the target's, so the output layer costs N/V of the target's and the draft ships
in tens of MB. It keeps the wire tokens-only, and runs where the target cannot ship its hidden
states (the Neuron backend); elsewhere the EAGLE head (``eagle.py``) accepts far more. The draft
gives zero probability outside its vocabulary; speculative sampling stays exact because q is what
the draft really sampled from.

On disk it is an ordinary Hugging Face Llama folder (our runner and transformers load it) with the
target's tokenizer and ``draft_vocab.json``: ``{"target_ids": [...]}``, draft id i <-> target id
target_ids[i]; draft id N is the input-only "other token".
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from serve_app.speculation.compatibility import VOCAB_FILE


def select_vocab(token_lists: Iterable[list[int]], special_ids: Iterable[int], size: int) -> list[int]:
    """The ``size`` most frequent ids in ``token_lists`` (special tokens always in), sorted."""
    counts: dict[int, int] = {}
    for tokens in token_lists:
        for t in tokens:
            counts[t] = counts.get(t, 0) + 1
    chosen = set(special_ids)
    for t, _ in sorted(counts.items(), key=lambda kv: -kv[1]):
        if len(chosen) >= size:
            break
        chosen.add(t)
    return sorted(chosen)


def coverage(token_lists: Iterable[list[int]], vocab: Iterable[int]) -> float:
    keep, total, hit = set(vocab), 0, 0
    for tokens in token_lists:
        total += len(tokens)
        hit += sum(t in keep for t in tokens)
    return hit / max(total, 1)


def init_draft(target_path: Path, vocab: list[int], layers: tuple[int, ...] | None = None) -> LlamaForCausalLM:
    """A draft initialised from the target (Llama-family target of any width)."""
    target_cfg = AutoConfig.from_pretrained(target_path)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    n_layers = target_cfg.num_hidden_layers
    layers = layers or (0, n_layers - 1)
    cfg = LlamaConfig(
        vocab_size=len(vocab) + 1,
        hidden_size=target_cfg.hidden_size,
        intermediate_size=target_cfg.intermediate_size,
        num_hidden_layers=len(layers),
        num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=getattr(target_cfg, "head_dim", None) or target_cfg.hidden_size // target_cfg.num_attention_heads,
        max_position_embeddings=target_cfg.max_position_embeddings,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope_parameters=dict(target_cfg.rope_parameters),
        tie_word_embeddings=target_cfg.tie_word_embeddings,
        hidden_act=target_cfg.hidden_act,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    draft = LlamaForCausalLM(cfg)
    with torch.no_grad():
        rows = target.get_input_embeddings().weight[torch.tensor(vocab)]
        other = target.get_input_embeddings().weight.mean(0, keepdim=True)
        draft.model.embed_tokens.weight.copy_(torch.cat([rows, other]))
        if not target_cfg.tie_word_embeddings:  # the output layer has rows of its own
            head = target.get_output_embeddings().weight[torch.tensor(vocab)]
            draft.lm_head.weight.copy_(torch.cat([head, torch.zeros_like(head[:1])]))
        if target_cfg.model_type == "llama":  # same module layout: copy whole layers
            for i, src in enumerate(layers):
                draft.model.layers[i].load_state_dict(target.model.layers[src].state_dict())
        draft.model.norm.weight.copy_(target.model.norm.weight)
    return draft


def save_draft(draft: LlamaForCausalLM, vocab: list[int], target_path: Path, out: Path,
               dtype: torch.dtype = torch.bfloat16) -> None:
    out.mkdir(parents=True, exist_ok=True)
    draft.to(dtype).save_pretrained(out)
    draft.to(torch.float32)
    AutoTokenizer.from_pretrained(target_path).save_pretrained(out)
    (out / VOCAB_FILE).write_text(json.dumps({"target_ids": vocab}))

