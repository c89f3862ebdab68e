"""Build one replica's engine: the target and draft worker actors in the replica's placement group,
and the engine that drives rounds between them.

Bundle layout (see ``serve_app.workers.placement``): 0 = the replica, 1 = target, 2 = draft (only
when the draft is a model; n-gram lookup runs in the replica, it needs no accelerator).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from serve_app.engine.engine import Engine
from serve_app.engine.factory import eos_token_ids, make_engine, proposers_for, runner_config, shipped_features
from serve_app.models.sources import resolve
from serve_app.serving.config import AppConfig, PlacementConfig
from serve_app.serving.metrics import ServingMetrics
from serve_app.speculation.compatibility import check_draft
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
    metrics: ServingMetrics | None = None

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
            if self.metrics:
                self.metrics.on_target_restart(False, time.perf_counter() - start)
            return False
        seconds = time.perf_counter() - start
        log.warning("target worker replaced in %.1f s (pid %d); %d requests resume", seconds, self.verifier.info.pid,
                    requeued)
        if self.metrics:
            self.metrics.on_target_restart(True, seconds)
        return True

    def close(self) -> None:
        self.verifier.close()
        if self.draft is not None:
            self.draft.close()


def build_replica_engine(config: AppConfig, metrics: ServingMetrics | None = None) -> ReplicaEngine:
    from serve_app.workers.target_worker import TargetWorker

    engine_cfg, p = config.engine, config.placement
    if engine_cfg.backend == "neuron":
        from serve_app.models.neuron.sdk import NxDI

        NxDI()  # the workers share this node (STRICT_PACK): fail now, with the install hint, if it lacks the SDK
    cache_dir = Path(engine_cfg.cache_dir) if engine_cfg.cache_dir else None
    target_path = resolve(engine_cfg.model, cache_dir)  # converts a GGUF once, on this node
    rc = runner_config(engine_cfg, "target", p.target_cores)
    compiled = config.exchange == "compiled_graph"
    spec = engine_cfg.speculation
    draft_path = resolve(spec.draft, cache_dir) if spec.method == "draft" else None
    if draft_path is not None:
        check_draft(target_path, draft_path)  # fails at startup, naming what differs
    features, taps = shipped_features(engine_cfg, draft_path) if draft_path is not None else (False, ())

    def spawn_target() -> Any:
        return ray.remote(TargetWorker).options(**actor_options(p, p.target_cores, TARGET_BUNDLE)).remote(
            str(target_path), rc, p.accelerator, engine_cfg.num_threads, features, taps)

    verifier = RemoteVerifier(spawn_target, engine_cfg.max_batch_size, compiled)  # waits for the model to load
    workers = {"target": verifier.info}
    tokenizer = AutoTokenizer.from_pretrained(target_path)

    draft: RemoteDraftProposer | None = None
    if draft_path is not None:
        vocab = workers["target"].vocab_size

        def spawn() -> Any:
            return ray.remote(DraftWorker).options(**actor_options(p, p.draft_cores, DRAFT_BUNDLE)).remote(
                str(draft_path), runner_config(engine_cfg, "draft", p.draft_cores), spec.draft_top_k, vocab,
                p.accelerator, engine_cfg.num_threads, spec.draft_stop_below)

        draft = RemoteDraftProposer(spawn, compiled, on_state=metrics.on_draft_state if metrics else lambda _: None,
                                    can_propose_ahead=not features)  # an EAGLE head (features) cannot
        workers["draft"] = ray.get(draft.actor.info.remote())
        if metrics:
            metrics.on_draft_state(True)

    engine = make_engine(engine_cfg, verifier, proposers_for(spec, draft), tokenizer,
                         eos_token_ids(target_path, tokenizer), on_round=metrics.on_round if metrics else None)
    log.info("replica ready: %s", {k: (v.pid, v.visible_cores) for k, v in workers.items()})
    return ReplicaEngine(engine, tokenizer, verifier, draft, config.deployment.target_restart_timeout_s, metrics)
