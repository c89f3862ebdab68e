"""``python -m serve_app compile CONFIG``: compile a Serve config's target and draft for Neuron, once.

Each model lands in ``engine.neuron.artifacts_dir/<key>`` (see ``artifacts.py``), which the workers
of every replica with the same configuration load. Run it on a Trainium node (kuberay/compile-job.yaml
on EKS) with the artifact volume mounted where the RayService mounts it.
"""

from __future__ import annotations

from pathlib import Path

from serve_app.builder import load_app_config
from serve_app.config import EngineConfig
from serve_app.engine.plan import plan_engine
from serve_app.models.neuron.artifacts import artifact_dir, is_complete
from serve_app.models.neuron.runner import compile_and_load
from serve_app.models.neuron.sdk import NxDI
from serve_app.models.neuron.spec import NeuronSpec
from serve_app.serving.config import AppConfig


def compile_plan(app: AppConfig) -> list[tuple[Path, NeuronSpec]]:
    """(model folder, spec) for the target and, with a draft model, the draft: the engine plan's."""
    if not isinstance(app.engine, EngineConfig) or app.engine.backend != "neuron":
        raise ValueError("compile is for engine.backend: neuron (the torch backend needs no compile step)")
    plan = plan_engine(app.engine, app.placement.target_cores, app.placement.draft_cores)
    models = [plan.target] if plan.draft is None else [plan.target, plan.draft]
    return [(m.path, m.runner.neuron) for m in models if m.runner.neuron is not None]


def compile_config(path: Path, app_name: str | None = None, say=print) -> list[Path]:
    sdk = NxDI()  # fails first, with the install hint, where the SDK is missing
    folders = []
    for model_path, spec in compile_plan(load_app_config(path, app_name)):
        folder = artifact_dir(model_path, spec)
        if is_complete(folder):
            say(f"{spec.role}: already compiled: {folder}")
        else:
            say(f"{spec.role}: compiling {model_path} (tp {spec.tp_degree}, batch {spec.batch_size}, "
                f"seq {spec.seq_len}, speculation {spec.speculation_length}) into {folder} ...")
            compile_and_load(model_path, spec, sdk, compile_only=True)
            say(f"{spec.role}: compiled: {folder}")
        folders.append(folder)
    return folders
