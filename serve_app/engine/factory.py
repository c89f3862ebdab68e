"""Build an engine from an ``EngineConfig``: resolve sources, load runners, pick proposers."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerBase

from serve_app.config import EngineConfig, SpeculationConfig, SpeculationMethod
from serve_app.engine.engine import Engine
from serve_app.models.base import Runner, RunnerConfig
from serve_app.models.eagle import folder_fuse_layers, is_eagle_folder
from serve_app.models.neuron.spec import NeuronSpec, Role
from serve_app.models.runner import ModelRunner
from serve_app.models.sources import resolve
from serve_app.speculation.compatibility import check_draft, load_vocab
from serve_app.speculation.policy import BlockSizePolicy
from serve_app.speculation.proposers.base import NoProposer, Proposer
from serve_app.speculation.proposers.draft_model import DraftModelProposer
from serve_app.speculation.proposers.eagle import EagleProposer
from serve_app.speculation.proposers.hybrid import HybridProposer
from serve_app.speculation.proposers.ngram import NgramProposer
from serve_app.speculation.types import VerifyResult
from serve_app.speculation.verifier import TargetVerifier, Verifier

log = logging.getLogger(__name__)


def neuron_spec(config: EngineConfig, role: Role, tp_degree: int) -> NeuronSpec:
    """What the ``role`` model is compiled for: TP = its worker's NeuronCores, the rest from the engine."""
    k = config.speculation.num_speculative_tokens if config.speculation.method != "none" else 0
    n = config.neuron
    return NeuronSpec(
        role=role,
        tp_degree=tp_degree,
        batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len,
        max_context_length=config.neuron_context_length,
        speculation_length=k + 1 if role == "target" and k > 0 else 0,
        dtype=config.dtype,
        context_buckets=tuple(n.context_buckets) if n.context_buckets else None,
        token_buckets=tuple(n.token_buckets) if n.token_buckets else None,
        logical_nc_config=n.logical_nc_config,
        artifacts_dir=n.artifacts_dir,
        compile_if_missing=n.compile_if_missing,
    )


def prefill_limit(engine: EngineConfig) -> int | None:
    """Longest prompt a Neuron target takes: its prefill graph caches all prompt tokens but the last."""
    if engine.backend != "neuron":
        return None
    return engine.neuron_context_length + 1


def runner_config(config: EngineConfig, role: Role = "target", cores: int = 1) -> RunnerConfig:
    return RunnerConfig(
        dtype=config.dtype,
        max_batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len,  # the engine caps each block to the room left
        device=config.device,
        neuron=neuron_spec(config, role, cores) if config.backend == "neuron" else None,
    )


def reads_features(config: EngineConfig, draft_path: Path) -> bool:
    """Whether the target must ship its hidden states: the draft is an EAGLE head (torch targets only)."""
    if not is_eagle_folder(draft_path):
        return False
    if config.backend == "neuron":
        raise ValueError(f"speculation.draft: {draft_path} is an EAGLE head, which reads the target's hidden "
                         "states; the Neuron target returns logits only. Use a standalone draft model "
                         "(python -m serve_app distill --arch decoder) or engine.backend: torch")
    return True


def shipped_features(config: EngineConfig, draft_path: Path) -> tuple[bool, tuple[int, ...]]:
    """(``reads_features``, the target layers whose streams precede its final state: the head's taps)."""
    features = reads_features(config, draft_path)
    return features, folder_fuse_layers(draft_path) if features else ()


def draft_proposer(runner: Runner, path: Path, width: int, target_vocab: int, stop_below: float = 0.0
                   ) -> DraftModelProposer:
    """The proposer for a draft model folder: an EAGLE head or a standalone decoder."""
    kind = EagleProposer if is_eagle_folder(path) else DraftModelProposer
    return kind(runner, width, target_vocab=target_vocab, vocab_map=load_vocab(path), stop_below=stop_below)


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


def block_size_policy(spec: SpeculationConfig) -> BlockSizePolicy | None:
    """The engine's k policy: None when k is fixed, or when nothing drafts."""
    if spec.k_policy == "fixed" or spec.method == "none" or spec.num_speculative_tokens == 0:
        return None
    return BlockSizePolicy(spec.num_speculative_tokens)


def proposers_for(spec: SpeculationConfig, draft: Proposer | None = None) -> dict[SpeculationMethod, Proposer]:
    """The proposer registry of an engine: plain decoding and n-gram lookup always (a request may ask
    for either), and the draft (in this process or on its actor), behind n-gram lookup with
    ``ngram_first``."""
    proposers: dict[SpeculationMethod, Proposer] = {
        "none": NoProposer(),
        "ngram": NgramProposer(spec.ngram_min, spec.ngram_max),
    }
    if draft is not None:
        proposers["draft"] = draft
        if spec.ngram_first:
            proposers["draft"] = HybridProposer(NgramProposer(spec.ngram_min, spec.ngram_max), draft, spec.ngram_match)
    return proposers


def make_engine(config: EngineConfig, verifier: Verifier, proposers: Mapping[SpeculationMethod, Proposer],
                tokenizer: PreTrainedTokenizerBase, eos_ids: Iterable[int],
                on_round: Callable[[VerifyResult, float], None] | None = None) -> Engine:
    """The one place an ``Engine`` is assembled from its config: the CLI, the replica, the tests and
    the benchmarks differ only in where the verifier and the proposers live."""
    spec = config.speculation
    return Engine(
        verifier,
        proposers,
        tokenizer,
        default_method=spec.method,
        default_k=spec.num_speculative_tokens,
        draft_token_budget=spec.draft_token_budget,
        prefill_chunk=config.prefill_chunk_tokens,
        policy=block_size_policy(spec),
        overlap=spec.overlap,
        max_seq_len=config.max_seq_len,
        eos_ids=eos_ids,
        on_round=on_round,
        max_prompt_len=prefill_limit(config),
    )


def build_engine(config: EngineConfig) -> Engine:
    """An engine with the draft and the target in this process (CLI, benchmarks, tests)."""
    if config.backend != "torch":
        raise ValueError(f"backend {config.backend!r} runs in Ray workers on their NeuronCore groups "
                         "(serve run configs/trn2-*.yaml); in-process engines use backend: torch")
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    cache_dir = Path(config.cache_dir) if config.cache_dir else None
    target = ModelRunner(resolve(config.model, cache_dir), runner_config(config))
    tokenizer = target.load_tokenizer()
    spec = config.speculation
    features, taps, draft = False, (), None
    if spec.method == "draft":
        draft_path = resolve(spec.draft, cache_dir)
        check_draft(target.path, draft_path)
        features, taps = shipped_features(config, draft_path)
        draft = draft_proposer(ModelRunner(draft_path, runner_config(config)), draft_path, spec.draft_top_k,
                               target.vocab_size, spec.draft_stop_below)
    return make_engine(config, TargetVerifier(target, features, taps), proposers_for(spec, draft), tokenizer,
                       eos_token_ids(target.path, tokenizer))
