"""The application config: the YAML ``args`` block of ``serve run``, KubeRay's ``serveConfigV2`` and
Python callers, validated into one model (Ray Serve LLM's ``LLMConfig`` shape, without escape
hatches: every key is described and unknown keys are rejected by name)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, model_validator

from serve_app.config import AnyEngineConfig, EngineConfig, StrictModel, VLLMEngineConfig
from serve_app.workers.placement import Accelerator


class PlacementConfig(StrictModel):
    """Where a replica's draft and target workers run (one placement group per replica)."""

    accelerator: Accelerator = Field(
        "CPU",
        description="Resource the workers request: 'neuron_cores' (Trainium NeuronCores; Ray sets "
        "NEURON_RT_VISIBLE_CORES per worker), 'GPU', or 'CPU' (CPUs only).",
    )
    fallback_to_cpu: bool = Field(
        False,
        description="If the cluster has none of `accelerator`, place the workers on CPUs only (logged) "
        "instead of failing at startup. For development configs; keep false in production.",
    )
    draft_cores: int = Field(1, ge=1, description="Accelerator cores of the draft worker (its TP degree).")
    target_cores: int = Field(1, ge=1, description="Accelerator cores of the target worker (its TP degree).")
    worker_cpus: float = Field(0.5, gt=0, description="Logical CPUs reserved for each worker actor.")
    replica_cpus: float = Field(0.2, gt=0, description="Logical CPUs reserved for the replica (HTTP + engine loop).")


class AutoscalingConfig(StrictModel):
    """Serve autoscaling on ongoing requests; each replica is a whole draft + target pair."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept running.")
    max_replicas: int = Field(1, ge=1, description="Most replicas the autoscaler may start.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time (default min).")
    target_ongoing_requests: float = Field(
        4.0, gt=0, description="Ongoing requests per replica the autoscaler aims for. Serve counts every request a "
        "replica holds, those waiting in its queue for a KV-cache slot as well as those decoding (and any queued "
        "in front of it), so replicas are added as the queue grows, not only as the batch fills.",
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="Sustained overload before adding replicas.")
    downscale_delay_s: float = Field(60.0, ge=0, description="Sustained underload before removing replicas.")
    metrics_interval_s: float = Field(1.0, gt=0, description="How often replicas report their load.")
    look_back_period_s: float = Field(10.0, gt=0, description="Window the load is averaged over.")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        return self


class DeploymentConfig(StrictModel):
    """Serve deployment options of the replica."""

    num_replicas: int | None = Field(None, ge=1, description="Fixed replica count (not with autoscaling_config).")
    autoscaling_config: AutoscalingConfig | None = Field(None, description="Scale replicas on load.")
    max_ongoing_requests: int = Field(32, ge=1, description="Requests a replica accepts before Serve queues them.")
    max_queued_requests: int | None = Field(
        None, ge=0,
        description="Requests held waiting, past which a request gets a fast 503; its meaning depends on the "
        "engine kind. kind: disaggregated: the most requests a replica holds waiting for a KV-cache slot, past "
        "it a 503 with an OpenAI error body (code server_busy) and Retry-After (Serve's own max_queued_requests "
        "is left unbounded: its 503 is plain text without Retry-After). kind: vllm: Serve's own "
        "max_queued_requests, requests queued at the router for a replica, past it Serve's plain-text 503 "
        "(vLLM queues the rest itself). None: unbounded.",
    )
    target_restart_timeout_s: float = Field(
        300.0, ge=0,
        description="When the target worker is lost (killed, crashed or hung), the replica starts a new one in the "
        "same placement-group bundle and resumes every request in flight: it caches the prompt plus the tokens "
        "already sent and goes on, so clients see a pause, not an error. Requests fail (503 service_unavailable) "
        "only if the new worker is not serving within this many seconds. Size it to the target's load time "
        "(seconds on CPU; minutes for a large model on Trainium). 0: fail requests at once and let Serve "
        "replace the replica.",
    )
    graceful_shutdown_timeout_s: float = Field(
        120.0, ge=0,
        description="A replica being stopped (downscale, redeploy, a KubeRay upgrade) stops taking requests "
        "and finishes those in flight for up to this many seconds before it is killed (Serve's option). Keep "
        "the pod's terminationGracePeriodSeconds above it.",
    )
    health_check_period_s: float = Field(10.0, gt=0, description="How often Serve checks a replica's health.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="How long a health check may take.")

    def serve_options(self) -> dict[str, Any]:
        """The Serve deployment options these keys set (both engines' deployments take them)."""
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
        }
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = self.autoscaling_config.model_dump(exclude_none=True)
        else:
            options["num_replicas"] = self.num_replicas or 1
        return options

    @model_validator(mode="after")
    def _one_scaling_mode(self) -> DeploymentConfig:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        return self


API_KEY_ENV = "SERVE_APP_API_KEY"


class AppConfig(StrictModel):
    """Everything ``serve_app.builder:build_app`` takes."""

    model_id: str | None = Field(
        None, description="Model name clients send and /v1/models lists (default: engine.model)."
    )
    engine: AnyEngineConfig = Field(
        default_factory=EngineConfig,
        description="Target, runner and speculation; its keys depend on engine.kind (marked 'kind: ...' below).")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Worker placement.")
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig, description="Serve deployment options.")
    exchange: Literal["actor_calls", "compiled_graph"] = Field(
        "actor_calls",
        description="How the engine calls the workers each round: plain actor calls (~0.7 ms a hop; "
        "idle waits cost no CPU) or a Ray Compiled Graph per worker (~0.1 ms a hop, but its channel "
        "readers poll: the replica and each worker hold most of a core even when idle, which on a "
        "host with few cores slows the model itself; for hosts with cores to spare).",
    )

    api_key: str | None = Field(
        None, min_length=8,
        description=f"Key clients must send as `Authorization: Bearer <key>` on every /v1 route (401 otherwise); "
        f"/health stays open for probes. Prefer the {API_KEY_ENV} environment variable (a Kubernetes Secret) to "
        "writing it here. Neither set: no authentication.",
    )

    @property
    def served_model_id(self) -> str:
        return self.model_id or self.engine.model

    def resolved_api_key(self) -> str | None:
        """``api_key``, else the environment's ``SERVE_APP_API_KEY`` where the replica runs, else None."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None

    @model_validator(mode="after")
    def _cuda_runs_on_gpus(self) -> AppConfig:
        if not isinstance(self.engine, EngineConfig):  # vLLM picks its device from the platform it runs on
            return self
        on_cuda, on_gpus = self.engine.device.startswith("cuda"), self.placement.accelerator == "GPU"
        if on_cuda and not on_gpus:
            raise ValueError("engine.device: cuda needs placement.accelerator: GPU (Ray then gives each worker "
                             "its own GPUs through CUDA_VISIBLE_DEVICES)")
        if on_gpus and not on_cuda and not self.placement.fallback_to_cpu:
            raise ValueError("placement.accelerator: GPU reserves GPUs that engine.device: cpu leaves unused; "
                             "set engine.device: cuda")
        return self

    @model_validator(mode="after")
    def _neuron_runs_on_neuron_cores(self) -> AppConfig:
        if isinstance(self.engine, EngineConfig) and self.engine.backend == "neuron":
            if self.placement.accelerator != "neuron_cores":
                raise ValueError("engine.backend: neuron needs placement.accelerator: neuron_cores "
                                 "(each worker's NeuronCore count is its model's tensor-parallel degree)")
            if self.placement.fallback_to_cpu:
                raise ValueError("placement.fallback_to_cpu cannot apply to engine.backend: neuron "
                                 "(NxDI models run only on NeuronCores); set it to false")
        return self

    @model_validator(mode="after")
    def _vllm_runs_one_fused_engine(self) -> AppConfig:
        """The app-level keys of the disaggregated shape (outside the engine block, so not refused by
        the engine's schema): set to anything but their default under kind: vllm, they are refused."""
        if not isinstance(self.engine, VLLMEngineConfig):
            return self
        keys = {"exchange": (self, "exchange"), "placement.draft_cores": (self.placement, "draft_cores"),
                "deployment.target_restart_timeout_s": (self.deployment, "target_restart_timeout_s")}
        unused = [key for key, (model, name) in keys.items()
                  if getattr(model, name) != type(model).model_fields[name].get_default(call_default_factory=True)]
        if unused:
            raise ValueError(f"{', '.join(unused)}: not used by engine.kind: vllm (vLLM runs the draft inside the "
                             "target's engine, on the target's cores, and Serve replaces a failed replica); remove")
        return self
