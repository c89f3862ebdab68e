"""The engine plan: one resolution of a config's models, read by every builder."""

from __future__ import annotations

import pytest

from serve_app.config import EngineConfig, NeuronSettings, SpeculationConfig, VLLMEngineConfig
from serve_app.engine.plan import check_pair, plan_engine, served_source
from serve_app.models.eagle import folder_fuse_layers
from serve_app.speculation.compatibility import DraftMismatchError
from tests.conftest import make_tiny_model


def config(target, draft="ngram", **engine) -> EngineConfig:
    return EngineConfig(model=str(target), dtype="float32", max_batch_size=3, max_seq_len=128,
                        speculation=SpeculationConfig(draft=str(draft)), **engine)


def test_a_draft_model_plan_names_both_folders_and_how_each_runs(tiny_models):
    plan = plan_engine(config(tiny_models["qwen3"], tiny_models["qwen3_draft"]), target_cores=3, draft_cores=1)
    assert plan.target.path == tiny_models["qwen3"] and plan.draft is not None
    assert plan.draft.path == tiny_models["qwen3_draft"]
    for model in (plan.target, plan.draft):
        assert (model.runner.dtype, model.runner.max_batch_size, model.runner.max_seq_len) == ("float32", 3, 128)
        assert model.runner.neuron is None  # torch backend
    assert (plan.features, plan.taps, plan.max_prompt_len) == (False, (), None)


def test_ngram_and_plain_plans_hold_no_draft(tiny_models):
    assert plan_engine(config(tiny_models["llama"], "ngram")).draft is None
    assert plan_engine(config(tiny_models["llama"], "none")).draft is None


def test_an_eagle_head_makes_the_target_ship_features_with_the_heads_taps(tiny_models, tiny_eagle):
    plan = plan_engine(config(tiny_models["llama"], tiny_eagle / "draft"))
    assert plan.features and plan.taps == folder_fuse_layers(tiny_eagle / "draft")


def test_a_draft_that_cannot_serve_the_target_fails_the_plan(tiny_models, tmp_path):
    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=300)
    with pytest.raises(DraftMismatchError):
        plan_engine(config(tiny_models["llama"], other))
    with pytest.raises(DraftMismatchError):
        check_pair(str(tiny_models["llama"]), str(other))


def test_a_neuron_plan_carries_each_roles_compiled_shape_and_the_prompt_limit(tiny_models):
    cfg = config(tiny_models["qwen3"], tiny_models["qwen3_near"], backend="neuron",
                 neuron=NeuronSettings(max_context_length=64))
    plan = plan_engine(cfg, target_cores=4, draft_cores=2)
    assert plan.target.runner.neuron.role == "target" and plan.target.runner.neuron.tp_degree == 4
    assert plan.target.runner.neuron.speculation_length == 5  # k + 1
    assert plan.draft.runner.neuron.role == "draft" and plan.draft.runner.neuron.tp_degree == 2
    assert plan.max_prompt_len == 64  # the prefill graph caches every prompt token


def test_the_vllm_kind_gets_hub_ids_and_folders_as_they_are(tiny_models):
    """(Embedded names and GGUF files become the converted folder: tests/test_vllm_engine.py.)"""
    engine = VLLMEngineConfig()
    assert served_source("Qwen/Qwen3-8B", engine) == "Qwen/Qwen3-8B"
    assert served_source(str(tiny_models["llama"]), engine) == str(tiny_models["llama"])
