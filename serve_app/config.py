"""Configuration models. One pydantic model per component slice; unknown keys are rejected."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.models.sources import DEFAULT_MODEL

SpeculationMethod = Literal["draft", "ngram", "none"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeculationConfig(StrictModel):
    """How the engine drafts: the proposer and the block size k."""

    draft: str = Field(
        "ngram",
        description="Draft source: 'ngram' (prompt lookup), 'none' (plain decoding), or a model "
        "source (Hugging Face folder, .gguf file or embedded name) sharing the target's tokenizer.",
    )
    num_speculative_tokens: int = Field(
        4, ge=0, le=16,
        description="Default block size k: draft tokens verified per target pass (0 = plain decoding). "
        "Requests may override it.",
    )
    draft_top_k: int = Field(
        32, ge=1, le=1024,
        description="Support size of the truncated draft distribution q' shipped with each sampled "
        "draft token. Larger keeps more of q (higher acceptance), smaller keeps blocks small.",
    )
    ngram_first: bool = Field(
        False,
        description="With a draft model: use n-gram lookup for a sequence whenever its last "
        "`ngram_match` tokens occur earlier in its context, the draft otherwise.",
    )
    ngram_match: int = Field(2, ge=1, description="Suffix length that counts as a match for ngram_first.")
    ngram_min: int = Field(1, ge=1, description="Shortest suffix n-gram the prompt lookup matches.")
    ngram_max: int = Field(3, ge=1, description="Longest suffix n-gram the prompt lookup tries first.")

    @model_validator(mode="after")
    def _ngram_range(self) -> SpeculationConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        return self

    @model_validator(mode="after")
    def _ngram_first_needs_a_draft(self) -> SpeculationConfig:
        if self.ngram_first and self.draft in ("ngram", "none"):
            raise ValueError("ngram_first combines n-gram lookup with a draft model: set `draft` to a model")
        return self

    @property
    def method(self) -> SpeculationMethod:
        return self.draft if self.draft in ("ngram", "none") else "draft"  # type: ignore[return-value]


class EngineConfig(StrictModel):
    """The target model, its runner and the speculation defaults."""

    model: str = Field(
        DEFAULT_MODEL,
        description="Target model source: a Hugging Face folder, a .gguf file or an embedded name.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="Weights, activations and KV cache dtype (logits are float32)."
    )
    backend: Literal["torch", "neuron"] = Field(
        "torch",
        description="Model runner: 'torch' (our forward, CPU or CUDA) or 'neuron' (NxD Inference on "
        "Trainium; needs the Neuron SDK).",
    )
    device: str = Field("cpu", description="torch device of the runners: 'cpu' or 'cuda[:N]'.")
    max_batch_size: int = Field(8, ge=1, le=256, description="Sequences decoded together (KV-cache slots).")
    max_seq_len: int = Field(
        2048, ge=16,
        description="Per-sequence token budget: prompt + max_tokens (speculative blocks fit inside it).",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads for CPU runs; default: torch's own choice."
    )
    cache_dir: str | None = Field(
        None, description="Where converted GGUF models are cached (default ~/.cache/serve_app)."
    )
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
