"""The draft worker: owns the draft runner and proposes blocks.

One round call, ``propose((previous_results, seq_ids, num_tokens))``: the draft first learns the
outcome of the previous round(s) (rollback by a length change, ingest the new tokens), then drafts.
So a round costs one call to each worker.
"""

from __future__ import annotations

from pathlib import Path

from serve_app.models.base import RunnerConfig
from serve_app.models.loader import build_runner
from serve_app.speculation.proposers.registry import draft_proposer
from serve_app.speculation.types import ProposalBlock, VerifyResult
from serve_app.workers.base import WorkerBase, WorkerInfo
from serve_app.workers.placement import Accelerator


class DraftWorker(WorkerBase):
    role = "draft"

    def __init__(self, model_path: str, runner_config: RunnerConfig, width: int, target_vocab: int,
                 accelerator: Accelerator = "CPU", num_threads: int | None = None, stop_below: float = 0.0,
                 alone: bool = True):
        """``alone``: the target never computes while this worker drafts (rounds not overlapped)."""
        self._start(accelerator, num_threads)
        runner = build_runner(model_path, runner_config)
        self.proposer = self.owner = draft_proposer(runner, Path(model_path), width, target_vocab, stop_below)
        self._plan_threads(runner, alone, runner_config.device)

    def info(self) -> WorkerInfo:
        return self._info(self.proposer.runner.vocab_size)

    def propose(self, request: tuple[tuple[VerifyResult, ...], tuple[str, ...], tuple[int, ...]]) -> ProposalBlock:
        """``request`` = (outcomes not seen yet, oldest first; seq_ids; draft tokens wanted per sequence).
        One argument, because a compiled graph passes one input."""
        previous, seq_ids, num_tokens = request
        with self._round():
            self._threads_for(len(seq_ids))
            for result in previous:
                self.proposer.observe(result)
            return self.proposer.propose(seq_ids, num_tokens)

    def observe(self, previous: tuple[VerifyResult, ...]) -> None:
        """Learn outcomes without drafting (before a sequence is taken again under the same id)."""
        with self.lock:
            for result in previous:
                self.proposer.observe(result)

    def propose_ahead(self, request: tuple[tuple[VerifyResult, ...], tuple[str, ...], tuple[int, ...]]
                      ) -> tuple[list[int], ProposalBlock]:
        """Overlapped rounds: the next blocks, drafted while the target verifies the last ones
        (``DraftModelProposer.propose_ahead``); ``request`` as for ``propose``."""
        previous, seq_ids, num_tokens = request
        with self._round():
            self._threads_for(len(seq_ids))
            for result in previous:
                self.proposer.observe(result)
            return self.proposer.propose_ahead(seq_ids, num_tokens)()  # drafted here, now
