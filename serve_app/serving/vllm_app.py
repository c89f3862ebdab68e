"""``engine.kind: vllm``: vLLM's engine with its own speculative decoding, served by Ray Serve LLM
(``ray.serve.llm``) behind this project's config schema, served model id, routes and API key, so
users coming from vLLM run it through the same app and compare it with the disaggregated engine.

``llm_config`` maps an ``AppConfig`` onto Ray Serve LLM's ``LLMConfig`` as plain data (tested
without vLLM); ``build_vllm_app`` imports ``ray.serve.llm``, which needs vLLM, so it runs only where
vLLM is installed: the application's ``runtime_env`` names that Python (docs/engines.md).

Per request: vLLM implements the OpenAI fields this project's engine refuses (``logprobs``, ``n``,
penalties; ``response_format`` and ``tools`` where vLLM is configured for them) and answers its own
400s; this project's extensions that vLLM has no per-request counterpart for get a 400 naming them.
"""

# No `from __future__ import annotations`: FastAPI reads the ingress routes' annotations, which name
# classes imported inside guarded_ingress, so they must be evaluated where they are defined.
import re
from typing import Any

from serve_app.config import VLLMEngineConfig
from serve_app.engine.plan import served_source
from serve_app.serving.config import AppConfig

# This project's per-request extensions with no vLLM counterpart (vLLM takes top_k and ignore_eos too).
UNSUPPORTED_EXTENSIONS = ("num_speculative_tokens", "speculative_method")


def speculative_config(engine: VLLMEngineConfig) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` from ``engine.speculation`` plus ``engine.vllm.speculative_config``."""
    spec, out = engine.speculation, {}
    k = spec.num_speculative_tokens
    if spec.method == "ngram" and k:
        out = {"method": "ngram", "num_speculative_tokens": k,
               "prompt_lookup_min": spec.ngram_min, "prompt_lookup_max": spec.ngram_max}
    elif spec.method == "draft" and k:  # vLLM infers the method (draft model, EAGLE, MTP) from the checkpoint
        out = {"model": served_source(spec.draft, engine), "num_speculative_tokens": k}
    out.update(engine.vllm.speculative_config)
    return out or None


def llm_config(config: AppConfig) -> dict[str, Any]:
    """The keyword arguments of ``ray.serve.llm.LLMConfig`` for this config."""
    engine, p, d = config.engine, config.placement, config.deployment
    if not isinstance(engine, VLLMEngineConfig):
        raise TypeError("llm_config maps engine.kind: vllm")
    kwargs: dict[str, Any] = {"dtype": engine.dtype, "max_model_len": engine.max_seq_len,
                              "max_num_seqs": engine.max_batch_size}
    spec = speculative_config(engine)
    if spec:
        kwargs["speculative_config"] = spec
    if p.accelerator == "GPU":  # one bundle per tensor-parallel worker (vLLM's Ray executor)
        placement: dict[str, Any] = {"bundle_per_worker": {"CPU": p.worker_cpus, "GPU": 1}}
        kwargs["tensor_parallel_size"] = p.target_cores
    elif p.accelerator == "neuron_cores":  # vllm-neuron runs the whole TP group (and the fused draft) in one process
        placement = {"bundles": [{"CPU": p.worker_cpus, "neuron_cores": p.target_cores}]}
        kwargs["tensor_parallel_size"] = p.target_cores
    else:
        placement = {"bundles": [{"CPU": p.worker_cpus}]}
    kwargs.update(engine.vllm.engine_kwargs)
    deployment = {**d.serve_options(), "ray_actor_options": {"num_cpus": p.replica_cpus}}
    if d.max_queued_requests is not None:  # Serve's own bound: past it the ingress answers 503
        deployment["max_queued_requests"] = d.max_queued_requests
    return {
        "model_loading_config": {"model_id": config.served_model_id,
                                 "model_source": served_source(engine.model, engine)},
        "engine_kwargs": kwargs,
        "deployment_config": deployment,
        "placement_group_config": {**placement, "strategy": "STRICT_PACK"},
        "log_engine_metrics": True,  # vLLM's vllm:* metrics (spec_decode counters among them) on Ray's exporter
    }


def refusal(body: dict[str, Any]) -> tuple[str, str] | None:
    """(field, message) for a request field this engine does not honour, else None."""
    for name in UNSUPPORTED_EXTENSIONS:
        if body.get(name) is not None:
            return name, (f"{name} is an extension of engine.kind: disaggregated; vLLM sets speculation for the "
                          "whole engine (engine.vllm.speculative_config): omit it")
    return None


def build_vllm_app(config: AppConfig):
    """The Ray Serve LLM application: an LLMServer deployment running vLLM, behind an OpenAI ingress
    that also checks the API key and refuses the extensions vLLM does not take."""
    from ray.serve.llm import LLMConfig, build_openai_app

    api_key = config.resolved_api_key()
    return build_openai_app({
        "llm_configs": [LLMConfig(**llm_config(config))],
        "ingress_cls_config": {"ingress_cls": guarded_ingress(), "ingress_extra_kwargs": {"api_key": api_key}},
        "ingress_deployment_config": {"ray_actor_options": {"num_cpus": config.placement.replica_cpus / 2}},
    })


def guarded_ingress() -> type:
    """Ray Serve LLM's OpenAI ingress with this project's surface: the API key on every route, a 400
    naming the extensions vLLM does not take, and only this project's routes (models, completions,
    chat completions). Built on call: its base class imports only where vLLM is installed."""
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from ray.serve.llm.ingress import OpenAiIngress
    from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

    from serve_app.serving import openai_api as oa
    from serve_app.serving.http import check_api_key

    class GuardedIngress(OpenAiIngress):
        def __init__(self, llm_deployments, model_cards, lora_paths=None, *, api_key: str | None = None, **kw):
            super().__init__(llm_deployments, model_cards, lora_paths=lora_paths, **kw)
            self._key = api_key.encode() if api_key else None

        def _refused(self, request: Request, body: Any = None) -> JSONResponse | None:
            try:
                check_api_key(request.headers.get("authorization"), self._key)
            except oa.OpenAIError as e:
                return JSONResponse(e.body(), status_code=e.status)
            if body is not None:
                fields = {**(body.model_extra or {}), **{n: getattr(body, n, None) for n in UNSUPPORTED_EXTENSIONS
                                                          if hasattr(body, n)}}
                refused = refusal(fields)
                if refused:
                    return JSONResponse(oa.error_body(refused[1], refused[0]), status_code=400)
            return None

        async def models(self, request: Request):
            return self._refused(request) or await super().models()

        async def model_data(self, model: str, request: Request):
            return self._refused(request) or await super().model_data(model)

        async def completions(self, body: CompletionRequest, request: Request):
            return self._refused(request, body) or await self._answer(super().completions(body, request))

        async def chat(self, body: ChatCompletionRequest, request: Request):
            return self._refused(request, body) or await self._answer(super().chat(body, request))

        @staticmethod
        async def _answer(response):
            """vLLM's refusals as this project's error bodies: the field named in ``param``, no internals."""
            try:
                return await response
            except Exception as e:
                status, message = getattr(e, "status_code", None), getattr(e, "message", None)
                if not (isinstance(status, int) and 400 <= status < 500 and isinstance(message, str)):
                    raise
                param = re.search(r"\(parameter=(\w+)", message)
                return JSONResponse(oa.error_body(message, param and param.group(1)), status_code=status)

        async def _not_served(self, request: Request):
            return JSONResponse(oa.error_body(f"{request.url.path} is not served by this app", type_="not_found_error"),
                                status_code=404)

        embeddings = transcriptions = score = tokenize = detokenize = _not_served

    return GuardedIngress
