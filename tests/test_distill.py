"""The distillation pipeline, end to end for a few steps on a tiny target (seconds, not minutes)."""

from __future__ import annotations

import torch

from serve_app.distill.batches import padded_inputs
from serve_app.distill.draft_model import coverage, select_vocab
from serve_app.distill.evaluate import data_note, decoding_walk
from serve_app.distill.features import target_features
from serve_app.distill.prompts import chat_prompts, usable_prompts, user_turn_prefix
from serve_app.distill.train import DistillConfig, distill
from serve_app.engine.request import GenerationParams
from serve_app.models.base import RunnerConfig
from serve_app.models.runner import ModelRunner
from serve_app.speculation.compatibility import check_draft, load_vocab
from tests.helpers import engine_for


def test_heldout_prompts_never_appear_in_training():
    assert not set(chat_prompts("train")) & set(chat_prompts("heldout"))


def test_synthetic_prompts_are_distinct_long_enough_and_not_held_out():
    heldout = ["Teach me something interesting about submarines."]
    candidates = ["What is a good name for a cat?", "what is a GOOD name for a cat", "Hi there",
                  "Teach me something really interesting about submarines.", "How do tides work on Mars?"]
    assert usable_prompts(candidates, heldout) == ["What is a good name for a cat?", "How do tides work on Mars?"]


def test_user_turn_prefix_ends_where_the_user_message_starts(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    prefix = user_turn_prefix(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert full.startswith(prefix + "hello") and prefix.rstrip().endswith("user")


def test_vocabulary_keeps_specials_and_frequent_tokens():
    vocab = select_vocab([[5, 5, 5, 7, 7, 9]], special_ids=[0, 2], size=4)
    assert vocab == [0, 2, 5, 7]
    assert coverage([[5, 5, 9]], vocab) == 2 / 3


def test_acceptance_length_is_what_decoding_sees_not_a_mean_over_positions():
    # tokens per pass if a draft began at each position; decoding begins one where the last pass ended
    lengths = torch.tensor([3, 1, 2, 1, 1, 2, 1])
    assert decoding_walk(lengths) == (7, 4)  # positions 0, 3, 4, 5: 3 + 1 + 1 + 2 tokens
    assert lengths.float().mean() < 7 / 4  # the mean over positions counts easy stretches once per token


def test_a_draft_that_fits_its_data_far_better_than_held_out_is_told_to_get_data():
    assert "--synth-prompts" in data_note(0.66, 0.42) and "0.66" in data_note(0.66, 0.42)
    assert data_note(0.45, 0.42) is None


def test_pipeline_trains_resumes_and_yields_a_lossless_draft(tiny_models, tmp_path):
    target = tiny_models["llama"]
    cfg = DistillConfig(target=str(target), out=tmp_path / "run", arch="decoder", minutes=0.05, vocab_size=200,
                        max_prompts=6, samples_per_prompt=2, synth_prompts=4, max_new_tokens=12, text_docs=3,
                        text_tokens=32, batch_size=4, eval_every=3, gen_batch=8)
    draft = distill(cfg)
    for name in ("data.pt", "teacher.pt", "checkpoint.pt", "log.jsonl"):
        assert (cfg.out / name).is_file()
    step = torch.load(cfg.out / "checkpoint.pt", weights_only=False)["state"]["step"]
    assert step > 0
    assert "reduced vocabulary" in check_draft(target, draft)[0]
    vocab = load_vocab(draft)
    assert vocab is not None and len(vocab) <= 200

    distill(cfg)  # resumes: reuses data and teacher, continues from the checkpoint
    assert torch.load(cfg.out / "checkpoint.pt", weights_only=False)["state"]["step"] >= step

    engine = engine_for(target, draft=draft, k=3)
    prompts = [engine.tokenizer.encode(p) for p in ("The quick brown fox", "def add(a, b):")]
    plain = engine.generate(prompts, GenerationParams(max_tokens=20, method="none"))
    spec = engine.generate(prompts, GenerationParams(max_tokens=20, method="draft"))
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert sum(s.stats.num_draft_tokens for s in spec) > 0


def test_target_features_are_the_targets_hidden_states_and_batches_pad_them(tiny_models):
    """What an EAGLE head trains on: the target's final-norm states over each item but its last token
    (bf16, as served), and draft-vocabulary inputs padded to the longest item."""
    items = [{"ids": torch.tensor([5, 9, 17, 33, 2])}, {"ids": torch.tensor([7, 8, 9])}]
    feats = target_features(tiny_models["qwen3"], {"train": items, "heldout": items[:1]})
    runner = ModelRunner(tiny_models["qwen3"], RunnerConfig(dtype="bfloat16", max_batch_size=1, max_seq_len=64))
    for item, f in zip(items, feats["train"], strict=True):
        runner.add("x")
        alone = runner.prefill("x", item["ids"][:-1].tolist())
        runner.release("x")
        assert f.shape == alone.shape and torch.allclose(f.float(), alone.float(), atol=0.05)
    assert len(feats["heldout"]) == 1
    inputs, mask = padded_inputs(items, torch.arange(320), 320)
    assert inputs.shape == (2, 4) and mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]] and inputs[1, 3] == 320
