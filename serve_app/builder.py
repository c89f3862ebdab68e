"""The application builder: ``import_path: serve_app.builder:build_app`` in Serve configs.

The YAML ``args`` block (or a dict from Python) is validated into ``AppConfig``; a mistake fails at
startup naming the key. The same builder serves ``serve run``, KubeRay's ``serveConfigV2`` and
Python callers (``serve.run(build_app({...}))``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from ray.serve import Application

from serve_app.config import ENGINE_KINDS, EngineConfig, VLLMEngineConfig, kind_of_key
from serve_app.serving.config import AppConfig

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """An invalid application config; the message names the key and the fix."""


def parse_config(args: dict[str, Any] | AppConfig | None) -> AppConfig:
    if isinstance(args, AppConfig):
        return args
    try:
        return AppConfig.model_validate(args or {})
    except ValidationError as e:
        raise ConfigError("invalid serve_app config:\n  " + "\n  ".join(map(_explain, e.errors()))) from None


def _explain(err: Any) -> str:
    """One line naming the key and the fix. Inside ``engine`` pydantic's location carries the engine
    kind's tag (``engine.vllm.backend``), which is not a key: it goes, and a key of the other kind says so."""
    loc = [str(p) for p in err["loc"]]
    kind = loc.pop(1) if loc[:1] == ["engine"] and len(loc) > 1 and loc[1] in ENGINE_KINDS else None
    key = ".".join(["args", *loc])
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        return f"{key}.kind: not an engine kind; use one of {', '.join(ENGINE_KINDS)}"
    if err["type"] != "extra_forbidden":
        return f"{key}: {err['msg']}"
    other = kind_of_key(tuple(loc[1:]), kind) if kind is not None else None
    if other is not None:
        return (f"args: {'.'.join(loc)} applies to engine.kind: {other}, not {kind}; remove it or set "
                f"engine.kind: {other}")
    return f"{key}: unknown key; remove it or check its spelling"


def _resolve_accelerator(config: AppConfig) -> AppConfig:
    """Apply ``placement.fallback_to_cpu`` when the cluster lacks the accelerator resource."""
    p = config.placement
    if p.accelerator == "CPU":
        return config
    import ray

    if not ray.is_initialized():
        ray.init()  # what serve.run would do next anyway
    key = p.accelerator
    available = ray.cluster_resources().get(key, 0)
    if available:
        return config
    if p.fallback_to_cpu:
        log.warning("the cluster has no %r resource: placing the draft and target workers on CPUs only "
                    "(placement.fallback_to_cpu). To emulate NeuronCores locally, start Ray with "
                    "--resources='{\"neuron_cores\": 8}'.", key)
        update: dict = {"placement": p.model_copy(update={"accelerator": "CPU"})}
        if isinstance(config.engine, EngineConfig) and config.engine.device != "cpu":
            update["engine"] = config.engine.model_copy(update={"device": "cpu"})
        return config.model_copy(update=update)
    log.warning("the cluster has no %r resource yet; replicas stay pending until nodes with it join "
                "(e.g. the Ray autoscaler adding Trainium workers)", key)
    return config


def build_app(args: dict[str, Any] | AppConfig | None = None) -> Application:
    from serve_app.serving.replica import replica_bundles
    from serve_app.serving.server import SpeculativeLLMServer

    config = _resolve_accelerator(parse_config(args))
    if isinstance(config.engine, VLLMEngineConfig):
        from serve_app.serving.vllm_app import build_vllm_app

        return build_vllm_app(config)
    options: dict[str, Any] = {
        "placement_group_bundles": replica_bundles(config),
        "placement_group_strategy": "STRICT_PACK",
        "ray_actor_options": {"num_cpus": config.placement.replica_cpus},
        **config.deployment.serve_options(),
    }
    return SpeculativeLLMServer.options(**options).bind(config.model_dump())


def load_app_config(path: Path, app_name: str | None = None) -> AppConfig:
    """The ``args`` of a Serve config file (``applications[*]``), or a file that is just the args."""
    doc = yaml.safe_load(path.read_text()) or {}
    if "applications" in doc:
        apps = [a for a in doc["applications"] if app_name in (None, a.get("name"))]
        if len(apps) != 1:
            names = [a.get("name") for a in doc["applications"]]
            raise ValueError(f"{path}: pick one application with --app (found {names})")
        doc = apps[0].get("args") or {}
    return parse_config(doc)
