"""The target worker: owns the target runner and the KV state of the sequences it serves.

Its only round method is ``verify(ProposalBlock) -> VerifyResult``; p never leaves the actor.
"""

from __future__ import annotations

import torch

from serve_app.models.runner import RunnerConfig, build_runner
from serve_app.speculation.types import ProposalBlock, VerifyResult
from serve_app.speculation.verifier import TargetVerifier
from serve_app.workers.base import WorkerBase, WorkerInfo
from serve_app.workers.placement import Accelerator, available_cpus


class TargetWorker(WorkerBase):
    role = "target"

    def __init__(self, model_path: str, runner_config: RunnerConfig, accelerator: Accelerator = "CPU",
                 num_threads: int | None = None, features: bool = False, taps: tuple[int, ...] = ()):
        """``features``: ship the target's hidden states to an EAGLE draft, after the ``taps`` it fuses."""
        self._start(accelerator, num_threads)
        self.verifier = self.owner = TargetVerifier(build_runner(model_path, runner_config), features, taps)

    def default_threads(self) -> int:
        # One core stays with the replica, the ingress and the draft: measured on 2 cores, a second
        # compute thread that shares a core with them made a batch-1 step slower (20 vs 17 ms).
        return max(1, available_cpus() - 1)

    def info(self) -> WorkerInfo:
        return self._info(self.verifier.runner.vocab_size)

    def continue_prefill(self, seq_id: str, count: int | None = None) -> torch.Tensor | None:
        with self.lock:
            return self.verifier.continue_prefill(seq_id, count)

    def verify(self, block: ProposalBlock) -> VerifyResult:
        with self._round():
            return self.verifier.verify(block)
