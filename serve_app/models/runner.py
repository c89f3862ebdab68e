"""The torch model runner: one model, its KV cache, and the lengths of the sequences it holds.

A runner is the unit a worker owns (the draft side or the target side). It knows nothing about
speculation: callers append tokens to sequences and read logits back. Rolling a sequence back is
``truncate``, an O(1) length change: cache entries past the new length are overwritten by the next
write (gpt-fast's convention).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from serve_app.models.base import DTYPES, ModelLoadError, RunnerConfig
from serve_app.models.eagle import EagleHead, is_eagle
from serve_app.models.llama import SUPPORTED_MODEL_TYPES, Batch, CausalLM, fuse_hf_state_dict
from serve_app.models.packed import int8_available, linear_kernel, pack_linears
from serve_app.models.slots import SequenceSlots

log = logging.getLogger(__name__)

def load_causal_lm(path: Path, dtype: torch.dtype, device: str = "cpu") -> CausalLM:
    """Build our model from a Hugging Face folder (config.json + *.safetensors)."""
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise ModelLoadError(f"{path}: cannot read config.json ({e})") from e
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{path}: model_type {config.model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (the Llama family)"
        )
    if getattr(config, "use_sliding_window", False):
        raise ModelLoadError(f"{path}: Qwen sliding-window attention is not supported")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    with torch.device("meta"):
        model = EagleHead(config) if is_eagle(config) else CausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ModelLoadError(f"{f}: corrupt or unreadable safetensors file ({e})") from e
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    try:
        state = fuse_hf_state_dict(state)
    except KeyError as e:
        raise ModelLoadError(f"{path}: weights do not match the architecture: missing {e}") from e
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"{path}: weights do not match the architecture: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval()


class ModelRunner(SequenceSlots):
    """Owns one model and the KV state of the sequences it serves."""

    def __init__(self, path: str | Path, config: RunnerConfig = RunnerConfig()):  # noqa: B008 - frozen
        start = time.perf_counter()
        self.path = Path(path)
        self.config = config
        self.dtype = DTYPES[config.dtype]
        self.model = load_causal_lm(self.path, self.dtype, config.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.hf_config = self.model.config
        self.vocab_size: int = self.hf_config.vocab_size
        self.capacity = config.max_seq_len
        self.model.setup_caches(config.max_batch_size, self.capacity, self.dtype)
        if config.weights == "int8":
            if not int8_available(config.dtype, config.device):
                raise ModelLoadError(f"{self.path}: int8 weights need bfloat16 on an x86 CPU with AVX2 and FMA and "
                                     "the kernel built (a C++ compiler); set speculation.draft_weights: model")
            pack_linears(self.model, "avx2", "int8")
        elif (kernel := linear_kernel(self.dtype, config.device)) is not None:
            pack_linears(self.model, kernel)
        super().__init__(config.max_batch_size)
        log.info("loaded %s (%s) in %.1fs", self.path, config.dtype, time.perf_counter() - start)

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return AutoTokenizer.from_pretrained(self.path)

    # ---- forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq_id: str, tokens: Sequence[int], features: torch.Tensor | None = None,
                taps: tuple[int, ...] = ()) -> torch.Tensor:
        """Cache a new sequence's first tokens; return their final-norm hidden states ``[T, hidden]``
        (the lm_head is skipped), preceded by the residual stream after the first t layers for each t
        in ``taps`` (``CausalLM.run_layers``). ``features`` ``[T, f]``: what an EAGLE head reads with
        the tokens."""
        hidden, _ = self.hidden_states([seq_id], [tokens], None if features is None else features[None], taps)
        return hidden[0]

    @torch.inference_mode()
    def forward(
        self,
        seq_ids: Sequence[str],
        tokens: Sequence[Sequence[int]],
        logits: Literal["last", "all"] = "last",
        features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``tokens[i]`` to sequence ``seq_ids[i]`` and return float32 logits.

        ``logits="last"``: ``[batch, vocab]`` after each sequence's last new token.
        ``logits="all"``: ``[batch, T, vocab]`` for every new token; rows past a sequence's own
        token count are padding. ``features`` ``[batch, T, f]``: an EAGLE head's second input.
        """
        return self.forward_hidden(seq_ids, tokens, logits, features)[0]

    @torch.inference_mode()
    def forward_hidden(
        self,
        seq_ids: Sequence[str],
        tokens: Sequence[Sequence[int]],
        logits: Literal["last", "all"] = "last",
        features: torch.Tensor | None = None,
        taps: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits and the final-norm hidden states they came from (same rows), preceded
        by the ``taps`` as in ``prefill``."""
        hidden, lengths = self.hidden_states(seq_ids, tokens, features, taps)
        if logits == "last":
            last = torch.tensor(lengths, device=hidden.device) - 1
            hidden = hidden[torch.arange(len(seq_ids), device=hidden.device), last]
        elif sum(lengths) < hidden.shape[0] * hidden.shape[1]:  # a ragged block: the head skips the padding
            device = hidden.device
            real = torch.arange(hidden.shape[1], device=device) < torch.tensor(lengths, device=device)[:, None]
            out = self.head(hidden[real])
            return out.new_zeros((*real.shape, out.shape[-1])).index_put_((real,), out), hidden
        return self.head(hidden), hidden

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden states as ``prefill`` and ``forward_hidden`` return them (the taps' streams
        first, the final-norm state in the last ``hidden_size`` columns)."""
        return self.model.lm_head(hidden[..., -self.hf_config.hidden_size:]).float()

    @torch.inference_mode()
    def hidden_states(self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]],
                      features: torch.Tensor | None = None, taps: tuple[int, ...] = (), depth: int | None = None
                      ) -> tuple[torch.Tensor, list[int]]:
        """Append ``tokens[i]`` to ``seq_ids[i]`` and return the hidden states of every new token,
        ``[batch, T, ...]`` (rows past a sequence's own count are padding), with each row's length:
        the final-norm states preceded by the ``taps`` as in ``prefill``, or, with ``depth``, only the
        streams up to that layer (the pass stops there: what distillation reads)."""
        # Rows in slot order: a running set on consecutive slots then reads the cache as a view (see
        # KVCache.update); the hidden states come back in the caller's order.
        order = sorted(range(len(seq_ids)), key=lambda i: self._slot[seq_ids[i]])
        reordered = order != list(range(len(seq_ids)))
        batch, _ = self._make_batch([seq_ids[i] for i in order], [tokens[i] for i in order])
        if reordered and features is not None:
            features = features[order]
        hidden = self.model.hidden_states(batch, features, taps, depth)
        if reordered:
            hidden = hidden[sorted(range(len(order)), key=order.__getitem__)]  # back to the caller's order
        lengths = [len(t) for t in tokens]
        for seq_id, n in zip(seq_ids, lengths, strict=True):
            self._length[seq_id] += n
        return hidden, lengths

    def _make_batch(self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]]) -> tuple[Batch, list[int]]:
        lengths = [len(t) for t in tokens]
        if not seq_ids or min(lengths) == 0:
            raise ValueError("every sequence in a forward needs at least one token")
        T = max(lengths)
        starts = [self._length[s] for s in seq_ids]
        for s, start, n in zip(seq_ids, starts, lengths, strict=True):
            if start + n > self.capacity:
                raise ValueError(f"sequence {s!r} would exceed max_seq_len={self.capacity}")
        device = self.config.device
        tok = torch.zeros(len(seq_ids), T, dtype=torch.long)
        pos = torch.full((len(seq_ids), T), self.capacity, dtype=torch.long)  # scratch position
        for i, (t, start, n) in enumerate(zip(tokens, starts, lengths, strict=True)):
            tok[i, :n] = torch.as_tensor(t, dtype=torch.long)
            pos[i, :n] = torch.arange(start, start + n)
        context_len = max(s + n for s, n in zip(starts, lengths, strict=True))
        key_pos = torch.arange(context_len)
        query_pos = pos.clamp(max=context_len - 1)[:, None, :, None]  # [batch, 1, T, 1]
        mask = key_pos <= query_pos  # causal by absolute position; entries past it are stale
        window = self.model.sliding_window
        if window is not None:
            mask &= key_pos > query_pos - window
        slot_list = [self._slot[s] for s in seq_ids]
        consecutive = slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list)))
        slots = torch.tensor(slot_list, dtype=torch.long)
        real = None
        if sum(lengths) < len(seq_ids) * T:  # padding: the layers compute the real tokens only (Batch.pack)
            real = (torch.arange(T) < torch.tensor(lengths)[:, None]).flatten().nonzero()[:, 0].to(device)
        batch = Batch(tok.to(device), pos.to(device), slots.to(device), mask.to(device), context_len,
                      (slot_list[0], slot_list[-1] + 1) if consecutive else None, real=real)
        return batch, lengths
