"""The runner interface (``add``/``release``/``length``/``truncate``/``prefill``/``forward``) on an NxDI model.

How runner calls become NxDI forwards (conventions of NxDI's ``HuggingFaceGenerationAdapter``,
``utils/hf_adapter.py``, and the graph routing of ``NeuronBaseForCausalLM._get_model_outputs``,
``models/model_base.py``):

- Each sequence owns a KV line of the compiled batch: its ``seq_ids`` entry is its slot.
- A forward whose positions start at 0 runs the prefill (context-encoding) graph, one sequence at
  a time (``ctx_batch_size = 1``); NxDI returns the logits after the last real token.
- Every other forward is a decode: ``position_ids[i] = start_i + arange(L)`` and ``attention_mask``
  marks the ``start_i`` cached positions. ``L`` must equal the compiled block: k + 1 on the target
  (its only decode graph scores exactly that many tokens), 1 on the draft. Shorter rows are padded
  by repeating their last token at the following positions; the padding's logits are dropped and its
  KV entries lie past the sequence's length, where the next write overwrites them.
- Rollback is a length change: NxDI's cache is indexed by position and attention only reaches the
  positions the mask marks, so entries past the length are dead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from serve_app.models.base import ModelLoadError, RunnerConfig
from serve_app.models.neuron.artifacts import artifact_dir, is_complete, mark_complete, sdk_versions
from serve_app.models.neuron.sdk import NeuronModel, NxDI
from serve_app.models.neuron.spec import NeuronSpec
from serve_app.models.slots import SequenceSlots

log = logging.getLogger(__name__)


def compile_and_load(path: Path, spec: NeuronSpec, sdk: NxDI | None = None, compile_only: bool = False,
                     ) -> tuple[NeuronModel, Path]:
    """Load the compiled model for ``spec`` from its artifact folder, compiling it first if asked."""
    sdk = sdk or NxDI()
    versions = sdk_versions()
    folder = artifact_dir(path, spec, versions)
    complete = is_complete(folder)
    if not (complete or compile_only or spec.compile_if_missing):
        raise ModelLoadError(
            f"no compiled {spec.role} artifacts at {folder}: run `python -m serve_app compile CONFIG` "
            "(kuberay/compile-job.yaml on EKS) with this configuration first, or set "
            "engine.neuron.compile_if_missing: true"
        )
    model = sdk.build(path, AutoConfig.from_pretrained(path).model_type, spec)
    if not complete:
        start = time.perf_counter()
        folder.mkdir(parents=True, exist_ok=True)
        model.compile(str(folder))
        mark_complete(folder, path, spec, versions)
        log.info("compiled %s %s into %s in %.0fs", spec.role, path, folder, time.perf_counter() - start)
    if not compile_only:
        start = time.perf_counter()
        model.load(str(folder))
        log.info("loaded %s %s from %s in %.0fs", spec.role, path, folder, time.perf_counter() - start)
    return model, folder


class NeuronModelRunner(SequenceSlots):
    """One NxDI model and the lengths of the sequences in its KV lines."""

    def __init__(self, path: str | Path, config: RunnerConfig, sdk: NxDI | None = None):
        if config.neuron is None:
            raise ValueError("the Neuron runner needs RunnerConfig.neuron (its NeuronSpec)")
        self.path = Path(path)
        self.config = config
        self.spec: NeuronSpec = config.neuron
        self.model, self.artifacts = compile_and_load(self.path, self.spec, sdk)
        self.vocab_size: int = AutoConfig.from_pretrained(self.path).vocab_size
        self.weight_bytes = 0  # the NeuronCores compute; torch's CPU threads only glue
        self.capacity = config.max_seq_len
        super().__init__(self.spec.batch_size)

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return AutoTokenizer.from_pretrained(self.path)

    # ---- forward -------------------------------------------------------------------------------
    def prefill(self, seq_id: str, tokens: Sequence[int]) -> None:
        """Cache a new sequence's first tokens (no logits needed)."""
        self.forward([seq_id], [tokens])

    @torch.inference_mode()
    def forward(self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]],
                logits: Literal["last", "all"] = "last") -> torch.Tensor:
        """Append ``tokens[i]`` to ``seq_ids[i]``; float32 logits ``[batch, vocab]`` (last) or
        ``[batch, T, vocab]`` (all; rows past a sequence's own token count are zero)."""
        lengths = [len(t) for t in tokens]
        if not seq_ids or min(lengths) == 0:
            raise ValueError("every sequence in a forward needs at least one token")
        for s, n in zip(seq_ids, lengths, strict=True):
            if self._length[s] + n > self.capacity:
                raise ValueError(f"sequence {s!r} would exceed max_seq_len={self.capacity}")
        rows: list[list[torch.Tensor]] = [[] for _ in seq_ids]  # per row: [n_i, vocab] pieces
        pending: dict[int, list[int]] = {}
        for i, (s, toks) in enumerate(zip(seq_ids, tokens, strict=True)):
            toks = list(toks)
            if self._length[s] == 0:  # prefill graph; it returns the last token's logits only
                # For logits after every token: prefill the first, decode the rest.
                head = toks[:1] if logits == "all" else toks
                if len(head) > self.spec.max_context_length:
                    raise ValueError(f"prompt of {len(head)} tokens exceeds the compiled max_context_length "
                                     f"{self.spec.max_context_length}")
                rows[i].append(self._prefill(s, head))
                if len(head) < len(toks):
                    pending[i] = toks[len(head):]
            else:
                pending[i] = toks
        while pending:  # decode in blocks of the compiled length
            batch = sorted(pending)
            block = self.spec.block_len
            out = self._decode([seq_ids[i] for i in batch], [pending[i][:block] for i in batch])
            for r, i in enumerate(batch):
                n = min(len(pending[i]), block)
                rows[i].append(out[r, :n])
                pending[i] = pending[i][n:]
                if not pending[i]:
                    del pending[i]
        full = [torch.cat(r) for r in rows]
        if logits == "last":
            return torch.stack([r[-1] for r in full])
        result = torch.zeros(len(full), max(lengths), full[0].shape[-1])
        for i, r in enumerate(full):
            result[i, : len(r)] = r
        return result

    def _prefill(self, seq_id: str, toks: list[int]) -> torch.Tensor:
        """Context encoding of one sequence from position 0; returns [1, vocab] (after its last token)."""
        n = len(toks)
        out = self.model.forward(
            input_ids=torch.tensor([toks], dtype=torch.long),
            seq_ids=torch.tensor([self._slot[seq_id]], dtype=torch.int32),
            attention_mask=torch.ones(1, n, dtype=torch.long),
            position_ids=torch.arange(n, dtype=torch.long)[None],
        )
        self._length[seq_id] = n
        return out.logits.reshape(-1, out.logits.shape[-1])[-1:].float()

    def _decode(self, seq_ids: list[str], blocks: list[list[int]]) -> torch.Tensor:
        """One decode forward, every row padded to the compiled block; returns [batch, block, vocab]."""
        block = self.spec.block_len
        starts = [self._length[s] for s in seq_ids]
        input_ids = torch.tensor([b + [b[-1]] * (block - len(b)) for b in blocks], dtype=torch.long)
        position_ids = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(block)[None]
        attention_mask = (torch.arange(max(starts))[None] < torch.tensor(starts)[:, None]).long()
        out = self.model.forward(
            input_ids=input_ids,
            seq_ids=torch.tensor([self._slot[s] for s in seq_ids], dtype=torch.int32),
            attention_mask=attention_mask,
            position_ids=position_ids,
        )
        for s, b in zip(seq_ids, blocks, strict=True):
            self._length[s] += len(b)
        return out.logits.reshape(len(seq_ids), block, -1).float()
