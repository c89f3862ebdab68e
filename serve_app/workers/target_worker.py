"""The target worker: owns the target runner and the KV state of the sequences it serves.

Its only round method is ``verify(ProposalBlock) -> VerifyResult``; p never leaves the actor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_app.models.base import RunnerConfig
from serve_app.models.loader import build_runner
from serve_app.speculation.types import ProposalBlock, VerifyResult
from serve_app.speculation.verifier import TargetVerifier
from serve_app.workers.base import WorkerBase, WorkerInfo
from serve_app.workers.placement import Accelerator


class TargetWorker(WorkerBase):
    role = "target"

    def __init__(self, model_path: str, runner_config: RunnerConfig, accelerator: Accelerator = "CPU",
                 num_threads: int | None = None, features: bool = False, taps: tuple[int, ...] = (),
                 alone: bool = True):
        """``features``: ship the target's hidden states to an EAGLE draft, after the ``taps`` it fuses.
        ``alone``: the draft never computes while this worker verifies (rounds not overlapped)."""
        self._start(accelerator, num_threads)
        self.verifier = self.owner = TargetVerifier(build_runner(model_path, runner_config), features, taps)
        self._plan_threads(self.verifier.runner, alone, runner_config.device)

    def info(self) -> WorkerInfo:
        return self._info(self.verifier.runner.vocab_size)

    def continue_prefill(self, seq_id: str, count: int | None = None) -> int | None:
        with self.lock:
            self._threads_for(None)
            return self.verifier.continue_prefill(seq_id, count)

    def take_features(self, seq_ids: Sequence[str]) -> list[torch.Tensor]:
        with self.lock:
            return self.verifier.take_features(seq_ids)

    def verify(self, block: ProposalBlock) -> VerifyResult:
        with self._round():
            self._threads_for(len(block.seq_ids) + int(block.num_draft_tokens.sum()))
            return self.verifier.verify(block)
