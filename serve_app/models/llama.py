"""Our own forward pass for the Llama family (Llama, Qwen2, Qwen3, Mistral; SmolLM2 is Llama).

Written in the style of gpt-fast's ``model.py``: plain modules and a static, slot-based KV cache
written by position. Every call scores a ragged batch: each sequence brings its own tokens at its
own positions, so prefill, decode and block verification are one code path. Parameter names mirror
Hugging Face's except two fused projections (``qkv_proj``, ``gate_up_proj``): on a CPU a decode step
is dominated by per-op overhead, so fewer, larger matmuls are measurably faster.

Rotary tables come from transformers' ``LlamaRotaryEmbedding`` (it knows every ``rope_type``), so
position encoding matches the Hugging Face oracle by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from serve_app.models import decode_attention


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes one member of the family from another."""

    qkv_bias: bool  # Qwen2 has biases on q/k/v
    qk_norm: bool  # Qwen3 RMS-normalises each head of q and k before RoPE


def arch_spec(config: PretrainedConfig) -> ArchSpec:
    model_type = config.model_type
    if model_type in ("llama", "mistral"):
        return ArchSpec(qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=False)
    if model_type == "qwen2":
        return ArchSpec(qkv_bias=True, qk_norm=False)
    if model_type == "qwen3":
        return ArchSpec(qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=True)
    raise ValueError(f"unsupported model_type {model_type!r}")


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class Batch:
    """One ragged forward: per-sequence cache slots and token positions, padded to ``T`` columns."""

    tokens: torch.Tensor  # [batch, T] int64, pad columns hold any valid id
    positions: torch.Tensor  # [batch, T] int64; pad columns point at the scratch position
    slots: torch.Tensor  # [batch] int64, KV-cache slot of each sequence
    mask: torch.Tensor  # [batch, 1, T, L] bool, True = may attend
    context_len: int  # L: cache columns the batch reads
    slot_range: tuple[int, int] | None = None  # (first, last + 1) when slots are consecutive: read a view
    # [batch * kv_heads, groups * T, L] float32, 0 or -inf: the mask as an additive score bias, for
    # attention outside SDPA (``attend``); made once per forward by ``CausalLM.run_layers``
    score_bias: torch.Tensor | None = None
    # [n] int64: where the n real tokens sit in the flattened [batch * T] grid; None when none is padding
    real: torch.Tensor | None = None

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, T, ...]`` to the real tokens' rows ``[n, ...]`` (``x`` itself without padding)."""
        return x if self.real is None else x.flatten(0, 1)[self.real]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``pack``'s inverse: ``[n, ...]`` back to ``[batch, T, ...]``, zeros at the padding."""
        if self.real is None:
            return x
        B, T = self.tokens.shape
        out = x.new_zeros((B * T, *x.shape[1:])).index_copy_(0, self.real, x)
        return out.view(B, T, *x.shape[1:])


class KVCache(nn.Module):
    """Static cache ``[slots, 2 (k, v), kv_heads, capacity + 1, head_dim]`` per layer.

    Keys and values share one buffer so a forward writes and reads each layer's cache with one
    indexing op each. The extra last column is a scratch position: padding tokens write there, so
    a ragged batch never disturbs another sequence's (or its own) valid entries.
    """

    def __init__(self, slots: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__()
        shape = (slots, 2, kv_heads, capacity + 1, head_dim)
        self.kv = nn.Buffer(torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, batch: Batch, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # kv: [batch, T, 2, kv_heads, head_dim]
        self.kv[batch.slots[:, None], :, :, batch.positions] = kv
        if batch.slot_range is not None:  # a view, no copy
            cached = self.kv[batch.slot_range[0]: batch.slot_range[1], :, :, : batch.context_len]
        else:
            cached = self.kv[batch.slots, :, :, : batch.context_len]  # [batch, 2, kv_heads, L, head_dim]
        return cached[:, 0], cached[:, 1]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the input dtype, exactly as transformers does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, T, heads, head_dim]; cos, sin: [batch, T, 1, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """q, k and v come from one fused projection (``qkv_proj``): one matmul instead of three."""

    def __init__(self, config: PretrainedConfig, spec: ArchSpec):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        hidden = config.hidden_size
        self.qkv_proj = nn.Linear(hidden, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch,
                cache: KVCache) -> torch.Tensor:
        """``x``: the real tokens (``Batch.pack``); the cache and the attention see the padded grid."""
        B, T = batch.tokens.shape
        qkv = batch.unpack(self.qkv_proj(x)).view(B, T, self.heads + 2 * self.kv_heads, self.head_dim)
        qk, v = qkv[:, :, : self.heads + self.kv_heads], qkv[:, :, self.heads + self.kv_heads:]
        if self.q_norm is not None:
            q, k = self.q_norm(qk[:, :, : self.heads]), self.k_norm(qk[:, :, self.heads:])
            qk = torch.cat((q, k), dim=2)
        qk = rotate(qk, cos, sin)  # q and k heads rotated together
        keys, values = cache.update(batch, torch.stack((qk[:, :, self.heads:], v), dim=2))
        out = attend(qk[:, :, : self.heads].transpose(1, 2), keys, values, batch)  # [batch, heads, T, head_dim]
        return self.o_proj(batch.pack(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)))


def score_bias(mask: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """``Batch.score_bias`` from the boolean mask ``[batch, 1, T, L]``: rows ordered as ``attend`` groups
    the query heads (the ``groups`` heads sharing a kv head, each with its T queries)."""
    B, _, T, L = mask.shape
    bias = torch.zeros((B, 1, 1, T, L), dtype=torch.float32, device=mask.device)
    bias.masked_fill_(~mask[:, :, None], float("-inf"))
    return bias.expand(B, kv_heads, groups, T, L).reshape(B * kv_heads, groups * T, L)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Grouped-query attention; q ``[batch, heads, T, d]``, keys and values ``[batch, kv_heads, L, d]``.

    float32 goes through SDPA. In bfloat16, PyTorch's CPU SDPA kernel is 4-8x slower than two batched
    matmuls for the short query blocks of decoding and verification (1-9 queries; 1.7 ms vs 0.2 ms a
    layer at batch 16, 300 cached tokens, on an AVX-512 CPU), so both matmuls run in float32: the scores
    with ``baddbmm`` (the mask added as a bias), and the softmax-weighted sum, rounded to the model's
    dtype once at the end. A bfloat16 ``bmm`` on a CPU without native bfloat16 (AVX2) is 20-40x slower
    than converting the values and multiplying in float32 (batch 16, 300 cached tokens: 8.0 vs 0.4 ms).
    A few queries a sequence (decoding, verifying) go to one fused kernel instead (``decode_attention``:
    0.5-0.7x these matmuls' time, each row's bits independent of the batch); a prefill stays here.
    """
    if batch.score_bias is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, enable_gqa=True)
    if decode_attention.supports(q):  # a few queries a sequence: one fused kernel (models.decode_attention)
        return decode_attention.attend(q, keys, values, batch.mask)
    B, H, T, D = q.shape
    kv_heads, L = keys.shape[1], keys.shape[2]
    grouped = q.reshape(B * kv_heads, H // kv_heads * T, D).float()  # head h reads kv head h // groups
    scores = torch.baddbmm(batch.score_bias, grouped, keys.float().reshape(B * kv_heads, L, D).transpose(1, 2),
                           alpha=D ** -0.5)  # [batch * kv_heads, groups * T, L]
    weights = torch.softmax(scores, dim=-1)
    return torch.bmm(weights, values.reshape(B * kv_heads, L, D).float()).to(values.dtype).view(B, H, T, D)


class MLP(nn.Module):
    """SwiGLU with gate and up fused into ``gate_up_proj``."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        hidden, self.inter = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(hidden, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, hidden, bias=bias)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: ArchSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, spec)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, batch: Batch, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """``model.*`` in Hugging Face checkpoints."""

    def __init__(self, config: PretrainedConfig, spec: ArchSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, spec) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def fuse_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map Hugging Face parameter names onto ours: concatenate q/k/v and gate/up (in place)."""
    for name in [n for n in state if n.endswith("self_attn.q_proj.weight") or n.endswith("self_attn.q_proj.bias")]:
        prefix, kind = name.rsplit(".q_proj.", 1)
        parts = [state.pop(f"{prefix}.{p}_proj.{kind}") for p in "qkv"]
        state[f"{prefix}.qkv_proj.{kind}"] = torch.cat(parts)
    for name in [n for n in state if ".mlp.gate_proj." in n]:
        prefix, kind = name.rsplit(".gate_proj.", 1)
        parts = [state.pop(f"{prefix}.{p}_proj.{kind}") for p in ("gate", "up")]
        state[f"{prefix}.gate_up_proj.{kind}"] = torch.cat(parts)
    return state


class CausalLM(nn.Module):
    """A Llama-family decoder with a static slot-based KV cache."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {config.model_type!r}")
        self.config = config
        self.model = Backbone(config, arch_spec(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.caches = nn.ModuleList()
        self.sliding_window: int | None = getattr(config, "sliding_window", None) \
            if config.model_type == "mistral" else None
        self.cos = self.sin = torch.empty(0)

    def setup_caches(self, slots: int, capacity: int, dtype: torch.dtype) -> None:
        """Allocate the KV cache and the rotary tables for positions ``[0, capacity]``."""
        attn = self.model.layers[0].self_attn
        device = self.lm_head.weight.device
        self.caches = nn.ModuleList(
            KVCache(slots, attn.kv_heads, capacity, attn.head_dim, dtype, device)
            for _ in self.model.layers
        )
        rope = LlamaRotaryEmbedding(self.config).to(device)
        positions = torch.arange(capacity + 1, device=device)[None]
        cos, sin = rope(torch.zeros(1, dtype=torch.float32, device=device), positions)
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)  # [capacity + 1, head_dim]

    def hidden_states(self, batch: Batch, features: torch.Tensor | None = None, taps: tuple[int, ...] = (),
                      depth: int | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[batch, T, hidden]``; writes the batch's keys and values.
        ``features`` is for heads that read another model's hidden states (``eagle.py``); ``taps`` and
        ``depth`` are ``run_layers``'."""
        if features is not None:
            raise ValueError(f"{type(self).__name__} takes no features")
        return self.run_layers(self.model.embed_tokens(batch.tokens), batch, taps, depth)

    def run_layers(self, x: torch.Tensor, batch: Batch, taps: tuple[int, ...] = (), depth: int | None = None
                   ) -> torch.Tensor:
        """The final-norm hidden states, preceded on the last dim by the residual stream after the first
        t layers for each t in ``taps`` (``[batch, T, (len(taps) + 1) * hidden]``; what an EAGLE-3 head
        fuses), RMS-normalised without a weight: its scale grows with depth and may pass what fp16, the
        wire's dtype, holds. ``depth``: stop after that many layers and return the taps alone."""
        if x.dtype != torch.float32:  # attend() outside SDPA; see there
            attn = self.model.layers[0].self_attn
            batch = replace(batch, score_bias=score_bias(batch.mask, attn.kv_heads, attn.heads // attn.kv_heads))
        cos = self.cos[batch.positions][:, :, None]  # [batch, T, 1, head_dim]
        sin = self.sin[batch.positions][:, :, None]
        x = batch.pack(x)  # the layers compute the real tokens only, not a ragged block's padding
        tapped = []
        for n, (layer, cache) in enumerate(zip(self.model.layers, self.caches, strict=True), start=1):
            x = layer(x, cos, sin, batch, cache)
            if n in taps:
                tapped.append(F.rms_norm(x.float(), (x.shape[-1],), eps=1e-6).to(x.dtype))
            if n == depth:
                return batch.unpack(torch.cat(tapped, dim=-1))
        x = self.model.norm(x)
        return batch.unpack(torch.cat((*tapped, x), dim=-1) if tapped else x)
