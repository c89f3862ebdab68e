"""Helpers shared by test modules."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from serve_app.config import EngineConfig, SpeculationConfig
from serve_app.engine.factory import build_engine


def engine_for(target, draft="ngram", k=4, batch=4, seq_len=256, prefill_chunk_tokens=None, dtype="float32",
               **speculation):
    """An in-process engine on tiny models. k is fixed unless ``k_policy="cost_model"`` is given: the
    tests of the speculation mechanics need every round to draft what they ask (on tiny models a
    draft step costs what a target step does, so the cost model rightly stops drafting)."""
    speculation.setdefault("k_policy", "fixed")
    config = EngineConfig(
        model=str(target), dtype=dtype, max_batch_size=batch, max_seq_len=seq_len,
        prefill_chunk_tokens=prefill_chunk_tokens,
        speculation=SpeculationConfig(draft=str(draft), num_speculative_tokens=k, **speculation),
    )
    return build_engine(config)


def hf_greedy(path, prompt_ids, max_new_tokens):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def top_k_marginal(path, prefix_ids, depth, k=3):
    """The exact distribution of the generated token at index ``depth`` (temperature 1, top-k), by
    enumerating every path of ``depth`` tokens before it with transformers (k + k² + ... forwards)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def top(prefix):
        with torch.no_grad():
            logits = model(torch.tensor([prefix])).logits[0, -1]
        v, i = logits.topk(k)
        return torch.zeros_like(logits).scatter(0, i, torch.softmax(v, 0))

    def marginal(prefix, d):
        p = top(prefix)
        return p if d == 0 else sum(p[t] * marginal(prefix + [t], d - 1) for t in p.nonzero()[:, 0].tolist())

    return marginal(list(prefix_ids), depth).double()
