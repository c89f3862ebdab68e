"""Overlapped rounds (``speculation.overlap``): the draft drafts block n + 1 while the target verifies
block n. Output stays the target's; a block drafted ahead that did not hold leaves no trace."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from serve_app.builder import ConfigError, parse_config
from serve_app.engine.ahead import DraftAhead
from serve_app.engine.request import GenerationParams
from serve_app.models.base import RunnerConfig
from serve_app.models.runner import ModelRunner
from serve_app.speculation.types import SamplingParams
from tests.helpers import engine_for, hf_greedy, top_k_marginal
from tests.test_engine import PROMPTS


@pytest.mark.parametrize("draft", ["qwen3", "qwen3_near", "qwen3_draft"])
def test_greedy_output_is_the_targets(tiny_models, draft):
    """A draft equal to the target (every block held), a noisy copy (some), an unrelated one (few)."""
    target = tiny_models["qwen3"]
    engine = engine_for(target, draft=tiny_models[draft], k=3, overlap=True, k_policy="fixed")
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = [GenerationParams(max_tokens=n, ignore_eos=True) for n in (17, 40, 33, 26)]
    outs = engine.generate(prompts, params)
    for out, ids, p in zip(outs, prompts, params, strict=True):
        assert out.token_ids == hf_greedy(target, ids, p.max_tokens)
    assert isinstance(engine.ahead, DraftAhead) and engine.ahead.tries > 0
    if draft == "qwen3":
        assert engine.ahead.hit_rate > 0.9  # and the rounds it saved are real: fewer draft calls than rounds
    assert not engine.ahead.ready and not engine.has_work


def kv(runner: ModelRunner, seq_id: str) -> torch.Tensor:
    slot, n = runner._slot[seq_id], runner.length(seq_id)
    return torch.stack([c.kv[slot, :, :, :n] for c in runner.model.caches])


def fresh_kv(path, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(path, RunnerConfig(dtype="float32", max_batch_size=1, max_seq_len=256))
    runner.add("x")
    runner.prefill("x", tokens)
    return kv(runner, "x")


def test_a_dropped_block_leaves_no_trace_in_either_cache(tiny_models):
    """After every round, each running sequence's draft cache holds exactly its decided tokens (but the
    last), or those plus the block drafted ahead that held; the target's holds the decided tokens. Both
    equal a fresh prefill of those tokens. (Right after its first token, a sequence is not with this draft
    yet: it prefills on the target's cores, so it takes the prompt at the next step, ``Deferral.hand_admitted``.)"""
    target, draft = tiny_models["qwen3"], tiny_models["qwen3_near"]
    engine = engine_for(target, draft=draft, k=1, overlap=True, k_policy="fixed")  # k = 1: hits and misses
    proposer, runner = engine.proposers["draft"], engine.verifier.runner
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    for p in ids:
        engine.add_request(p, GenerationParams(max_tokens=30, ignore_eos=True))
    checked = misses = 0
    while engine.has_work:
        engine.step()
        for seq_id, req in engine.running.items():
            decided = req.prompt_ids + req.output_ids
            assert runner.length(seq_id) == len(decided) - 1
            torch.testing.assert_close(kv(runner, seq_id), fresh_kv(target, decided[:-1]))
            if seq_id in engine.deferral.handing:
                assert len(req.output_ids) == 1 and seq_id not in engine.ahead.ready
                continue
            ready = engine.ahead.ready.get(seq_id)
            drafted = [] if ready is None else ready.draft_tokens[0, : int(ready.num_draft_tokens[0]) - 1].tolist()
            misses += ready is None
            expected = decided[:-1] if ready is None else decided + drafted
            assert proposer.runner.length(seq_id) == len(expected)
            torch.testing.assert_close(kv(proposer.runner, seq_id), fresh_kv(draft, expected))
            checked += 1
    assert checked > 10 and engine.ahead.hits > 0 and engine.ahead.tries > engine.ahead.hits


def test_sampled_output_follows_the_target_distribution(tiny_models):
    """Chi-square (ALPHA = 0.001) on the 4th generated token, which a block drafted ahead decides
    whenever the first block (2 drafts) and the guess of the target's 3rd token held. Its exact marginal
    is enumerated with transformers (temperature 1, top_k = 3: 3 + 9 + 27 paths)."""
    target, draft = tiny_models["qwen3"], tiny_models["qwen3_near"]
    engine = engine_for(target, draft=draft, k=2, batch=64, overlap=True, k_policy="fixed")
    ids = engine.tokenizer.encode(PROMPTS[1])
    n = 1500
    outs = engine.generate([ids] * n, [GenerationParams(max_tokens=6, ignore_eos=True,
                                                         sampling=SamplingParams(temperature=1.0, top_k=3, seed=i))
                                        for i in range(n)])
    counts = Counter(o.token_ids[3] for o in outs)
    m = top_k_marginal(target, ids, 3)
    support = m.nonzero()[:, 0].tolist()
    assert set(counts) <= set(support)
    observed = [counts.get(t, 0) for t in support]
    expected = (m[support].double() / m[support].sum() * n).tolist()
    assert chisquare(observed, expected).pvalue > 1e-3
    assert engine.ahead.hits > 50  # blocks drafted ahead really decided some of those tokens


def test_overlap_needs_a_decoder_draft(tiny_models, tiny_eagle):
    with pytest.raises(ConfigError, match="overlap"):
        parse_config({"engine": {"speculation": {"draft": "ngram", "overlap": True}}})
    with pytest.raises(ValueError, match="overlap needs a decoder draft model"):
        engine_for(tiny_models["llama"], draft=tiny_eagle / "draft", overlap=True)
