"""N-gram lookup where the context matches, the draft elsewhere: still lossless, both used."""

from __future__ import annotations

import pytest

from serve_app.builder import ConfigError, parse_config
from serve_app.engine.request import GenerationParams
from serve_app.speculation.proposers.hybrid import HybridProposer
from tests.helpers import engine_for

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "The quick brown fox jumps over"]


def test_hybrid_is_lossless_and_uses_both(tiny_models, monkeypatch):
    engine = engine_for(tiny_models["llama"], draft=tiny_models["llama_reduced"], k=3, ngram_first=True)
    hybrid = engine.proposers["draft"]
    assert isinstance(hybrid, HybridProposer)
    calls = {"ngram": 0, "draft": 0}
    for name, proposer in (("ngram", hybrid.ngram), ("draft", hybrid.draft)):
        original = proposer.propose

        def counting(seq_ids, num_tokens, _original=original, _name=name):
            calls[_name] += len(seq_ids)
            return _original(seq_ids, num_tokens)

        monkeypatch.setattr(proposer, "propose", counting)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    plain = engine.generate(prompts, GenerationParams(max_tokens=24, method="none"))
    spec = engine.generate(prompts, GenerationParams(max_tokens=24))
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert calls["ngram"] > 0 and calls["draft"] > 0


def test_ngram_first_needs_a_draft_model():
    with pytest.raises(ConfigError, match="ngram_first combines n-gram lookup with a draft model"):
        parse_config({"engine": {"speculation": {"draft": "ngram", "ngram_first": True}}})
