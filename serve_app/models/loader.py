"""``build_runner``: the runner a ``RunnerConfig`` asks for, NxDI on Trainium or our torch one. The
Neuron SDK is imported only here, only then."""

from __future__ import annotations

from pathlib import Path

from serve_app.models.base import Runner, RunnerConfig


def build_runner(path: str | Path, config: RunnerConfig) -> Runner:
    if config.neuron is not None:
        from serve_app.models.neuron.runner import NeuronModelRunner

        return NeuronModelRunner(path, config)
    from serve_app.models.runner import ModelRunner

    return ModelRunner(path, config)
