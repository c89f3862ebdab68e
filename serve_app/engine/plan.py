"""What an engine config runs, resolved once: the ``EnginePlan``.

One function, ``plan_engine``, answers "which models does this config name, where are they, and how
does each run": each model's source resolved to a Hugging Face folder (a GGUF converted once, an
embedded name found), its runner config (with the Neuron spec of its role and cores), the draft
check's verdict, whether the target ships features to an EAGLE head (and its taps), and the longest
prompt a compiled prefill graph takes. The in-process builder, the replica, the compile command, the
planner and the vLLM kind all read a plan; none resolves a source itself (``tests/test_layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from serve_app.config import EngineConfig, VLLMEngineConfig
from serve_app.models.base import RunnerConfig
from serve_app.models.eagle import folder_fuse_layers, is_eagle_folder
from serve_app.models.neuron.spec import NeuronSpec, Role
from serve_app.models.sources import named_models, resolve
from serve_app.speculation.compatibility import check_draft


@dataclass(frozen=True)
class ModelPlan:
    """One model of the plan: where its folder is and how its runner is configured."""

    source: str  # as the config names it
    path: Path  # the Hugging Face folder it resolved to
    runner: RunnerConfig


@dataclass(frozen=True)
class EnginePlan:
    config: EngineConfig
    target: ModelPlan
    draft: ModelPlan | None  # None: no draft model (n-gram lookup or plain decoding)
    draft_notes: tuple[str, ...] = ()  # what the draft check reconciled (a mismatch fails the plan)
    features: bool = False  # the target ships its hidden states: the draft is an EAGLE head
    taps: tuple[int, ...] = ()  # the target layers whose streams the head fuses too
    max_prompt_len: int | None = None  # a compiled prefill graph's limit (Neuron); None: max_seq_len


def cache_dir(config: EngineConfig | VLLMEngineConfig) -> Path | None:
    return Path(config.cache_dir) if config.cache_dir else None


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


def runner_config(config: EngineConfig, role: Role = "target", cores: int = 1) -> RunnerConfig:
    return RunnerConfig(
        dtype=config.dtype,
        max_batch_size=config.max_batch_size,
        max_seq_len=config.max_seq_len,  # the engine caps each block to the room left
        device=config.device,
        neuron=neuron_spec(config, role, cores) if config.backend == "neuron" else None,
        weights=config.speculation.draft_weights if role == "draft" else "model",
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


def plan_engine(config: EngineConfig, target_cores: int = 1, draft_cores: int = 1) -> EnginePlan:
    """Resolve the config's models (converting a GGUF once, on this node), check the draft against
    the target (failing here, naming what differs) and say how each runs."""
    target_path = resolve(config.model, cache_dir(config))
    target = ModelPlan(config.model, target_path, runner_config(config, "target", target_cores))
    limit = config.neuron_context_length if config.backend == "neuron" else None  # its prefill graph, whole prompts
    spec = config.speculation
    if spec.method != "draft":
        return EnginePlan(config, target, None, max_prompt_len=limit)
    draft_path = resolve(spec.draft, cache_dir(config))
    notes = tuple(check_draft(target_path, draft_path))
    features = reads_features(config, draft_path)
    return EnginePlan(config, target, ModelPlan(spec.draft, draft_path, runner_config(config, "draft", draft_cores)),
                      notes, features, folder_fuse_layers(draft_path) if features else (), limit)


def model_folder(source: str) -> Path:
    """The folder one model source resolves to, outside any engine config (distilling a draft for it)."""
    return resolve(source)


def check_pair(target: str, draft: str) -> list[str]:
    """``python -m serve_app check-draft``: resolve both sources and check the draft against the target."""
    return check_draft(resolve(target), resolve(draft))


def served_source(source: str, config: VLLMEngineConfig) -> str:
    """What an engine that loads Hugging Face folders and hub ids itself (the vLLM kind) is given:
    named models and GGUF files as the folder this project converts them to (vLLM's GGUF loader needs
    a separate tokenizer); folders and hub ids as they are."""
    if source in named_models() or source.lower().endswith(".gguf"):
        return str(resolve(source, cache_dir(config)))
    return source
