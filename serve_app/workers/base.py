"""What every worker actor does on start: claim its cores, size torch's thread pool, report itself."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from serve_app.workers.placement import Accelerator, claim_neuron_cores


@dataclass(frozen=True)
class WorkerInfo:
    role: str
    pid: int
    node_id: str
    accelerator: Accelerator
    cores: tuple[int, int] | None  # (first, last) NeuronCore, when placed on neuron_cores
    visible_cores: str | None  # NEURON_RT_VISIBLE_CORES as the worker runs with it
    vocab_size: int


class WorkerBase:
    """Mixin for the actors. A lock serialises calls: compiled-graph tasks and ordinary actor calls
    (add/remove sequences) run on different threads of the same actor."""

    role = "worker"

    def _start(self, accelerator: Accelerator, num_threads: int | None) -> None:
        self.lock = threading.Lock()
        self.accelerator = accelerator
        self.cores = claim_neuron_cores(f"{self.role} worker") if accelerator == "neuron_cores" else None
        if num_threads is not None:
            torch.set_num_threads(num_threads)

    def _info(self, vocab_size: int) -> WorkerInfo:
        import ray

        return WorkerInfo(
            self.role, os.getpid(), ray.get_runtime_context().get_node_id(), self.accelerator, self.cores,
            os.environ.get("NEURON_RT_VISIBLE_CORES"), vocab_size,
        )

    def ping(self) -> bool:
        return True
