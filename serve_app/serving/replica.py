"""Build one replica's engine: the target and draft worker actors in the replica's placement group,
and the engine that drives rounds between them.

Bundle layout (see ``serve_app.workers.placement``): 0 = the replica, 1 = target, 2 = draft (only
when the draft is a model; n-gram lookup runs in the replica, it needs no accelerator).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from serve_app.config import EngineConfig
from serve_app.engine.engine import Engine
from serve_app.engine.factory import eos_token_ids, make_engine
from serve_app.engine.plan import plan_engine
from serve_app.serving.config import AppConfig, PlacementConfig
from serve_app.serving.metrics import ReplicaMetrics
from serve_app.speculation.proposers.registry import proposers_for
from serve_app.workers.draft_worker import DraftWorker
from serve_app.workers.placement import worker_resources
from serve_app.workers.remote import RemoteDraftProposer, RemoteVerifier, WorkerError

log = logging.getLogger(__name__)

TARGET_BUNDLE, DRAFT_BUNDLE = 1, 2


def replica_bundles(config: AppConfig) -> list[dict[str, float]]:
    """Placement-group bundles of one replica: itself, the target, and the draft if it is a model."""
    p = config.placement
    bundles = [{"CPU": p.replica_cpus}, worker_resources(p.accelerator, p.target_cores, p.worker_cpus)]
    if config.engine.speculation.method == "draft":
        bundles.append(worker_resources(p.accelerator, p.draft_cores, p.worker_cpus))
    return bundles


def actor_options(p: PlacementConfig, cores: int, bundle: int) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": p.worker_cpus, "max_restarts": 0}
    if p.accelerator == "GPU":
        options["num_gpus"] = cores
    elif p.accelerator == "neuron_cores":
        options["resources"] = {"neuron_cores": cores}
    pg = get_current_placement_group()
    if pg is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
    return options


@dataclass
class ReplicaEngine:
    engine: Engine
    tokenizer: PreTrainedTokenizerBase
    verifier: RemoteVerifier
    draft: RemoteDraftProposer | None
    target_restart_timeout_s: float = 0.0
    metrics: ReplicaMetrics = field(default_factory=ReplicaMetrics)

    @property
    def target(self) -> Any:
        """The TargetWorker actor handle serving now."""
        return self.verifier.actor

    def resume(self, error: BaseException) -> bool:
        """A round failed. If the target worker was lost, start a new one and requeue every admitted
        request to re-prefill its prompt plus what it has generated (``Engine.requeue_admitted``), so
        streams pause and go on. Returns False (the caller fails the requests) for any other error,
        when resuming is off, or when the new worker is not up within ``target_restart_timeout_s``."""
        if not isinstance(error, WorkerError) or not error.lost or self.target_restart_timeout_s <= 0:
            return False
        start = time.perf_counter()
        requeued = self.engine.requeue_admitted()
        log.warning("%s; starting a new target worker, %d requests resume when it is up", error, requeued)
        try:
            self.verifier.restart(self.target_restart_timeout_s)
        except WorkerError as e:
            log.error("the new target worker did not come up within %.0f s: %s", self.target_restart_timeout_s, e)
            self.metrics.on_target_restart(False, time.perf_counter() - start)
            return False
        seconds = time.perf_counter() - start
        log.warning("target worker replaced in %.1f s (pid %d); %d requests resume", seconds, self.verifier.info.pid,
                    requeued)
        self.metrics.on_target_restart(True, seconds)
        return True

    def close(self) -> None:
        self.verifier.close()
        if self.draft is not None:
            self.draft.close()


def build_replica_engine(config: AppConfig, metrics: ReplicaMetrics | None = None) -> ReplicaEngine:
    from serve_app.workers.target_worker import TargetWorker

    metrics = metrics or ReplicaMetrics()
    engine_cfg, p = config.engine, config.placement
    if not isinstance(engine_cfg, EngineConfig):
        raise TypeError("engine.kind: vllm is served by serving.vllm_app, not by this project's replica")
    if engine_cfg.backend == "neuron":
        from serve_app.models.neuron.sdk import NxDI

        NxDI()  # the workers share this node (STRICT_PACK): fail now, with the install hint, if it lacks the SDK
    plan = plan_engine(engine_cfg, p.target_cores, p.draft_cores)  # converts a GGUF once, on this node
    compiled = config.exchange == "compiled_graph"
    spec = engine_cfg.speculation

    def spawn_target() -> Any:
        return ray.remote(TargetWorker).options(**actor_options(p, p.target_cores, TARGET_BUNDLE)).remote(
            str(plan.target.path), plan.target.runner, p.accelerator, engine_cfg.num_threads, plan.features, plan.taps,
            not spec.overlap)

    verifier = RemoteVerifier(spawn_target, engine_cfg.max_batch_size, compiled)  # waits for the model to load
    workers = {"target": verifier.info}
    tokenizer = AutoTokenizer.from_pretrained(plan.target.path)

    draft: RemoteDraftProposer | None = None
    if plan.draft is not None:
        vocab, draft_plan = workers["target"].vocab_size, plan.draft

        def spawn() -> Any:
            return ray.remote(DraftWorker).options(**actor_options(p, p.draft_cores, DRAFT_BUNDLE)).remote(
                str(draft_plan.path), draft_plan.runner, spec.draft_top_k, vocab, p.accelerator,
                engine_cfg.num_threads, spec.draft_stop_below, not spec.overlap)

        draft = RemoteDraftProposer(spawn, compiled, on_state=metrics.on_draft_state,
                                    decoder=not plan.features)  # an EAGLE head reads the target's features
        workers["draft"] = draft.info
        metrics.on_draft_state(True)

    engine = make_engine(plan, verifier, proposers_for(spec, draft), tokenizer,
                         eos_token_ids(plan.target.path, tokenizer), on_round=metrics.on_round)
    log.info("replica ready: %s", {k: (v.pid, v.visible_cores) for k, v in workers.items()})
    return ReplicaEngine(engine, tokenizer, verifier, draft, config.deployment.target_restart_timeout_s, metrics)
