"""What one worker's NxDI model is compiled for, and the ``NeuronConfig`` arguments that say it.

Followed: ``neuronx_distributed_inference/models/config.py`` (``NeuronConfig.__init__``) and
``utils/hf_adapter.py`` (``_standard_assisted_decoding``) of aws-neuron/neuronx-distributed-inference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["target", "draft"]


def buckets_up_to(longest: int, chosen: tuple[int, ...] | None) -> list[int]:
    """The configured buckets below ``longest`` (default: powers of two), then ``longest`` itself, so
    every length the model may see has a graph (target and draft share the configured list but not
    their compiled lengths)."""
    if chosen is None:
        return default_buckets(longest)
    return [b for b in chosen if b < longest] + [longest]


def default_buckets(longest: int, shortest: int = 128) -> list[int]:
    """Powers of two from ``shortest``, then ``longest``; a power within a quarter of ``longest`` is
    dropped (2048 + k + 1 positions get buckets ..., 1024, 2056, not a near-duplicate 2048 graph)."""
    buckets, size = [], shortest
    while size * 4 < longest * 3:
        buckets.append(size)
        size *= 2
    return buckets + [longest]


@dataclass(frozen=True)
class NeuronSpec:
    """One worker's compiled model.

    The target is compiled with ``speculation_length = k + 1``, non-fused: a prefill graph and a
    graph that scores exactly k + 1 tokens (the last accepted token and k drafts), and no 1-token
    graph. The draft, and a target served without speculation (k = 0), get
    ``speculation_length = 0``: a prefill graph and a 1-token graph.
    """

    role: Role
    tp_degree: int
    batch_size: int
    max_seq_len: int  # tokens a sequence may hold (prompt + output), as in EngineConfig
    max_context_length: int  # longest prompt
    speculation_length: int  # target: k + 1; draft: 0
    dtype: str = "bfloat16"
    context_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    logical_nc_config: int = 2
    artifacts_dir: str = "/mnt/neuron-cache/artifacts"
    compile_if_missing: bool = False

    def __post_init__(self) -> None:
        if self.role == "draft" and self.speculation_length != 0:
            raise ValueError("the Neuron draft is compiled for token generation (speculation_length 0)")

    @property
    def seq_len(self) -> int:
        """Compiled KV length. A block shorter than k + 1 is padded and its padding is written at the
        positions after it (and overwritten later), so the cache needs k + 1 positions of headroom."""
        return self.max_seq_len + self.speculation_length

    @property
    def block_len(self) -> int:
        """Tokens per decode forward: k + 1 on the target, 1 on the draft."""
        return max(self.speculation_length, 1)

    def neuron_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of NxDI's ``NeuronConfig`` for this model."""
        return {
            "tp_degree": self.tp_degree,
            "logical_nc_config": self.logical_nc_config,
            "torch_dtype": self.dtype,
            # Continuous batching: sequences are prefilled one at a time (ctx batch 1) into their own
            # KV line (seq_ids = our slots) and decoded together.
            "batch_size": self.batch_size,
            "max_batch_size": self.batch_size,
            "ctx_batch_size": 1,
            "tkg_batch_size": self.batch_size,
            "is_continuous_batching": True,
            # A forward may carry fewer sequences than the batch: NxDI pads the batch with the missing
            # seq_ids; the mask sends their KV writes to a scratch position instead of real lines.
            "apply_seq_ids_mask": True,
            "padding_side": "right",
            "seq_len": self.seq_len,
            "max_context_length": self.max_context_length,
            "enable_bucketing": True,
            "context_encoding_buckets": buckets_up_to(self.max_context_length, self.context_buckets),
            "token_generation_buckets": buckets_up_to(self.seq_len, self.token_buckets),
            # Non-fused speculation: the target scores a whole block per forward; the draft runs in
            # its own actor on its own cores, so NxDI's fused draft+target graph is not used.
            "speculation_length": self.speculation_length,
            "enable_fused_speculation": False,
            # On-device sampling off: the forward returns logits (``model_base.py``:
            # ``_get_constructed_outputs``), so the project's rejection sampler stays the one source of
            # truth. ``output_logits`` is only for on-device sampling and would duplicate them here.
            "on_device_sampling_config": None,
            "output_logits": False,
        }
