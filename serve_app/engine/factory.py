"""Assemble an engine: ``make_engine`` is the one place an ``Engine`` is built from its config;
``build_engine`` runs a plan's models in this process (CLI, benchmarks, tests)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerBase

from serve_app.config import EngineConfig, SpeculationMethod
from serve_app.engine.block_sizer import BlockSizer
from serve_app.engine.engine import Engine, RoundSink
from serve_app.engine.plan import EnginePlan, plan_engine
from serve_app.models.runner import ModelRunner
from serve_app.speculation.proposers.base import Proposer
from serve_app.speculation.proposers.registry import draft_proposer, proposers_for
from serve_app.speculation.realized import policy_for
from serve_app.speculation.verifier import TargetVerifier, Verifier


def eos_token_ids(model_path: Path, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every id that ends generation: config, generation config and tokenizer may each name some."""
    ids: set[int] = set()
    config = AutoConfig.from_pretrained(model_path)
    sources = [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    if (model_path / "generation_config.json").is_file():
        sources.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


def make_engine(plan: EnginePlan, verifier: Verifier, proposers: Mapping[SpeculationMethod, Proposer],
                tokenizer: PreTrainedTokenizerBase, eos_ids: Iterable[int], on_round: RoundSink | None = None
                ) -> Engine:
    """The one place an ``Engine`` is assembled from its plan: the CLI, the replica, the tests and
    the benchmarks differ only in where the verifier and the proposers live."""
    config, spec = plan.config, plan.config.speculation
    sizer = BlockSizer(spec.method, spec.num_speculative_tokens, spec.draft_token_budget, policy_for(spec))
    return Engine(
        verifier,
        proposers,
        tokenizer,
        sizer,
        prefill_chunk=config.prefill_chunk_tokens,
        overlap=spec.overlap,
        max_seq_len=config.max_seq_len,
        eos_ids=eos_ids,
        on_round=on_round,
        max_prompt_len=plan.max_prompt_len,
    )


def build_engine(config: EngineConfig) -> Engine:
    """An engine with the draft and the target in this process (CLI, benchmarks, tests)."""
    if config.backend != "torch":
        raise ValueError(f"backend {config.backend!r} runs in Ray workers on their NeuronCore groups "
                         "(serve run configs/trn2-*.yaml); in-process engines use backend: torch")
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    plan = plan_engine(config)
    target = ModelRunner(plan.target.path, plan.target.runner)
    tokenizer = target.load_tokenizer()
    spec, draft = config.speculation, None
    if plan.draft is not None:
        draft = draft_proposer(ModelRunner(plan.draft.path, plan.draft.runner), plan.draft.path, spec.draft_top_k,
                               target.vocab_size, spec.draft_stop_below)
    return make_engine(plan, TargetVerifier(target, plan.features, plan.taps), proposers_for(spec, draft), tokenizer,
                       eos_token_ids(target.path, tokenizer))
