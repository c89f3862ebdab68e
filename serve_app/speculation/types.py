"""Typed messages between the draft side and the target side (the only things that cross actors).

Vocabulary (Leviathan et al. 2023, arXiv 2211.17192): ``p`` is the target distribution, ``q`` the
draft distribution. Of a block of k draft tokens the target *accepts* a prefix of n; then it emits
one token of its own: a *recovered* token (resampled from max(0, p - q)) at the first rejection, or
a *bonus* token (sampled from p) when all k were accepted.

Blocks carry tokens, never full vocabulary rows: for sampling the draft draws from its own
top-K-truncated distribution q' and ships q' sparsely (``q_ids``/``q_probs``). Speculative sampling
is exact for whatever q the token was really drawn from, so the output stays the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np
import torch

PAD_TOKEN = -1  # fills draft positions past a sequence's own block length
FEATURE_DTYPE = torch.float16  # target hidden states on the wire (numpy has no bfloat16; exact for bf16 < 65504)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters; ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class ProposalBlock:
    """Draft tokens for a batch of sequences, with the sparse draft distribution they came from.

    ``q_ids``/``q_probs`` are None when every row is greedy. A row whose proposer drew its token
    deterministically (n-gram lookup) has q = 1 on that token: ``q_ids[..., 0]`` = the token.
    """

    seq_ids: tuple[str, ...]
    draft_tokens: torch.Tensor  # [batch, k] int64, PAD_TOKEN past num_draft_tokens
    num_draft_tokens: torch.Tensor  # [batch] int64, k_i <= k
    q_ids: torch.Tensor | None = None  # [batch, k, K] int64, PAD_TOKEN where unused
    q_probs: torch.Tensor | None = None  # [batch, k, K] float32, 0 where unused

    @property
    def k(self) -> int:
        return self.draft_tokens.shape[1]

    def __reduce__(self):
        return _rebuild, (type(self), _to_wire(self))

    @classmethod
    def make_dummy(
        cls,
        seq_ids: Sequence[str],
        draft_tokens: Sequence[Sequence[int]],
        q: Sequence[Sequence[dict[int, float]]] | None = None,
    ) -> ProposalBlock:
        """Build a block from plain lists (tests, n-gram proposals). ``q[i][j]`` maps id -> prob."""
        k = max((len(d) for d in draft_tokens), default=0)
        tokens = torch.full((len(seq_ids), k), PAD_TOKEN, dtype=torch.long)
        for i, d in enumerate(draft_tokens):
            tokens[i, : len(d)] = torch.as_tensor(list(d), dtype=torch.long)
        q_ids = q_probs = None
        if q is not None:
            width = max((len(row) for rows in q for row in rows), default=1)
            q_ids = torch.full((len(seq_ids), k, width), PAD_TOKEN, dtype=torch.long)
            q_probs = torch.zeros((len(seq_ids), k, width), dtype=torch.float32)
            for i, rows in enumerate(q):
                for j, row in enumerate(rows):
                    q_ids[i, j, : len(row)] = torch.as_tensor(list(row.keys()), dtype=torch.long)
                    q_probs[i, j, : len(row)] = torch.as_tensor(list(row.values()), dtype=torch.float32)
        lengths = torch.tensor([len(d) for d in draft_tokens], dtype=torch.long)
        return cls(tuple(seq_ids), tokens, lengths, q_ids, q_probs)

    def select(self, rows: Sequence[int]) -> ProposalBlock:
        """The block of only these rows (in this order)."""
        index = torch.tensor(list(rows), dtype=torch.long)
        pick = (lambda t: None if t is None else t[index])  # noqa: E731
        return ProposalBlock(tuple(self.seq_ids[i] for i in rows), self.draft_tokens[index],
                             self.num_draft_tokens[index], pick(self.q_ids), pick(self.q_probs))

    @classmethod
    def concat(cls, blocks: Sequence[ProposalBlock]) -> ProposalBlock:
        """Stack blocks from several proposers into one verify batch (padding k and K)."""
        if len(blocks) == 1:
            return blocks[0]
        k = max(b.k for b in blocks)
        sampled = [b for b in blocks if b.q_ids is not None]
        width = max((b.q_ids.shape[2] for b in sampled), default=0)  # type: ignore[union-attr]
        tokens, q_ids, q_probs = [], [], []
        for b in blocks:
            n = len(b.seq_ids)
            t = torch.full((n, k), PAD_TOKEN, dtype=torch.long)
            t[:, : b.k] = b.draft_tokens
            tokens.append(t)
            if sampled:
                qi = torch.full((n, k, width), PAD_TOKEN, dtype=torch.long)
                qp = torch.zeros((n, k, width), dtype=torch.float32)
                if b.q_ids is not None and b.q_probs is not None:
                    qi[:, : b.k, : b.q_ids.shape[2]] = b.q_ids
                    qp[:, : b.k, : b.q_ids.shape[2]] = b.q_probs
                q_ids.append(qi)
                q_probs.append(qp)
        return cls(
            tuple(s for b in blocks for s in b.seq_ids),
            torch.cat(tokens),
            torch.cat([b.num_draft_tokens for b in blocks]),
            torch.cat(q_ids) if sampled else None,
            torch.cat(q_probs) if sampled else None,
        )


@dataclass(frozen=True)
class VerifyResult:
    """The target's verdict on a block: per sequence, n accepted drafts then one token of its own."""

    seq_ids: tuple[str, ...]
    num_draft_tokens: torch.Tensor  # [batch] int64, as proposed
    num_accepted: torch.Tensor  # [batch] int64, n_i <= num_draft_tokens[i]
    output_tokens: torch.Tensor  # [batch, k + 1] int64: accepted drafts, then recovered/bonus; PAD after
    # [rows, k + 1, hidden] FEATURE_DTYPE: the target's final-norm hidden state at each scored position
    # (the sequence's previous last token, then each draft) of the rows an EAGLE head holds; else None.
    features: torch.Tensor | None = None
    feature_rows: tuple[int, ...] | None = None  # the rows ``features`` holds, in order; None: every row

    def __reduce__(self):
        return _rebuild, (type(self), _to_wire(self))

    @classmethod
    def plain(cls, seq_ids: Sequence[str], tokens: Sequence[int]) -> VerifyResult:
        """One token of the target's own per row and nothing drafted: the first tokens, from the prefills."""
        zeros = torch.zeros(len(seq_ids), dtype=torch.long)
        return cls(tuple(seq_ids), zeros, zeros.clone(), torch.tensor(list(tokens), dtype=torch.long).view(-1, 1))

    def new_tokens(self, i: int) -> list[int]:
        """Tokens row ``i`` gained this round: its accepted drafts plus the recovered or bonus token."""
        return list(self._new_tokens[i])

    @cached_property
    def _new_tokens(self) -> list[list[int]]:
        # every row's, read out of the tensors once: the engine, the pipeline and each proposer ask for them
        return [row[: n + 1] for row, n in zip(self.output_tokens.tolist(), self.num_accepted.tolist(), strict=True)]

    def kept_block_then(self, i: int, block_len: int, token: int) -> bool:
        """Did row ``i`` keep a whole block of ``block_len`` drafts and then emit ``token``? (A block
        drafted ahead from that guess holds: ``serve_app.engine.ahead``.)"""
        return (int(self.num_draft_tokens[i]) == block_len == int(self.num_accepted[i])
                and int(self.output_tokens[i, block_len]) == token)

    def new_features(self, i: int) -> torch.Tensor:
        """The target's features at the positions row ``i`` kept: its previous last token and the
        accepted drafts (what an EAGLE head reads with the next tokens)."""
        if self.features is None or (self.feature_rows is not None and i not in self.feature_rows):
            raise ValueError(f"this verify result carries no features for row {i}: no EAGLE head holds its sequence")
        row = i if self.feature_rows is None else self.feature_rows.index(i)
        return self.features[row, : len(self._new_tokens[i])]


# Messages cross Ray actor boundaries thousands of times a second. Pickling a torch tensor costs
# ~0.3 ms per block here, a numpy array ~0.02 ms: ship numpy, rebuild tensors.
def _to_wire(message: ProposalBlock | VerifyResult) -> tuple:
    values = (getattr(message, f.name) for f in fields(message))  # not what a cached_property holds
    return tuple(v.numpy() if isinstance(v, torch.Tensor) else v for v in values)


def _rebuild(cls: type, fields: tuple) -> ProposalBlock | VerifyResult:
    # Ray hands out read-only buffers; these arrays are tiny, so copy rather than alias them.
    return cls(*(torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v for v in fields))
