"""What every worker actor does on start: claim its cores, size torch's thread pool, report itself."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from serve_app.models.base import Runner
from serve_app.speculation.types import SamplingParams
from serve_app.workers.placement import Accelerator, ThreadPlan, available_cpus, claim_neuron_cores


@dataclass(frozen=True)
class WorkerInfo:
    role: str
    pid: int
    node_id: str
    accelerator: Accelerator
    cores: tuple[int, int] | None  # (first, last) NeuronCore, when placed on neuron_cores
    visible_cores: str | None  # NEURON_RT_VISIBLE_CORES as the worker runs with it
    vocab_size: int
    # its forwards run on every CPU core of the host (``ThreadPlan.every_core``): work of another worker beside
    # them stalls both, so the replica never starts any (``RemoteDraftProposer.prefills_aside``)
    every_core: bool = False


class WorkerBase:
    """Mixin for the actors. A lock serialises calls: compiled-graph tasks and ordinary actor calls
    (add/remove sequences) run on different threads of the same actor."""

    role = "worker"
    owner: Any  # the TargetVerifier or proposer that holds the sequences' state

    def _start(self, accelerator: Accelerator, num_threads: int | None) -> None:
        """Before the model loads (on every core unless ``num_threads`` is set: loading is all prefill)."""
        self.lock = threading.Lock()
        self.busy_s, self.round_calls = 0.0, 0  # model compute of round calls, for the exchange benchmark
        self.accelerator = accelerator
        self.cores = claim_neuron_cores(f"{self.role} worker") if accelerator == "neuron_cores" else None
        self.num_threads = num_threads
        torch.set_num_threads(num_threads or available_cpus())

    def _plan_threads(self, runner: Runner, alone: bool, device: str) -> None:
        """Once the model is loaded: the threads of each forward (see ``EngineConfig.num_threads``)."""
        self.plan = ThreadPlan.fixed(self.num_threads) if self.num_threads else \
            ThreadPlan.for_worker(self.role, runner.weight_bytes, alone)
        torch.set_num_threads(self.plan.narrow)
        # weight_bytes is 0 where torch's CPU threads do not compute (NeuronCores); a GPU's runner is not on them either
        self.every_core = runner.weight_bytes > 0 and device == "cpu" and self.plan.every_core()

    def _threads_for(self, tokens: int | None) -> None:
        """Size torch's thread pool for a forward of ``tokens`` tokens (None: a prefill)."""
        torch.set_num_threads(self.plan.threads(tokens))

    def _info(self, vocab_size: int) -> WorkerInfo:
        import ray

        return WorkerInfo(
            self.role, os.getpid(), ray.get_runtime_context().get_node_id(), self.accelerator, self.cores,
            os.environ.get("NEURON_RT_VISIBLE_CORES"), vocab_size, self.every_core,
        )

    def ping(self) -> bool:
        return True

    def add_sequence(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                     features: torch.Tensor | None = None, **options: Any) -> int | None:
        """``features``: the target's over the context (an EAGLE draft reads them). ``options``: the
        owner's own (the target's ``prefill`` count). Returns the owner's answer (the target's first token)."""
        with self.lock:
            self._threads_for(None)
            extra = () if features is None else (features,)
            return self.owner.add_sequence(seq_id, prompt_ids, params, *extra, **options)

    def remove_sequence(self, seq_id: str) -> None:
        with self.lock:
            self.owner.remove_sequence(seq_id)

    @contextmanager
    def _round(self) -> Iterator[None]:
        """Serialise with admission calls and time the work of a round call."""
        with self.lock:
            start = time.perf_counter()
            try:
                yield
            finally:
                self.busy_s += time.perf_counter() - start
                self.round_calls += 1

    def compute_stats(self, reset: bool = True) -> tuple[float, int]:
        """(seconds spent inside round calls, number of round calls) since the last reset."""
        stats = (self.busy_s, self.round_calls)
        if reset:
            self.busy_s, self.round_calls = 0.0, 0
        return stats
