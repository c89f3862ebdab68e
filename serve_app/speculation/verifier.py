"""The target side of a speculation round: score a block in one forward pass and verify it.

Owns the target runner and, per sequence, the one token the cache has not seen yet (the last token
of the sequence; first the one drawn from the prefill's logits after the prompt). A round feeds
``[last, d_1..d_k]`` at the sequence's own positions, so the logits at column j give p for draft j+1
(and column k the bonus distribution). p never leaves this object;
only a ``VerifyResult`` does. Rejected drafts are rolled back by a length change.

With ``features=True`` (an EAGLE draft reads them) the target's final-norm hidden states travel
too, preceded by the residual streams after the first t layers for each t in ``taps`` (an EAGLE-3
head fuses them). They stay here until the head takes the sequence: ``take_features`` hands over
what was kept (the prompt's, then each round's), and from then on each round's travel in
``VerifyResult.features`` (the rows of sequences a head holds, ``feature_rows``). A sequence no
head takes (the policy plays plain at its batch size) costs the wire nothing: with every prompt's
and every round's features shipped to the replica and on to the head, the embedded model's default
decoded 16 streams at 0.83-0.92x its ``draft: none`` replica (one process driving the worker actors).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from serve_app.models.base import FeatureRunner, Runner
from serve_app.speculation.rejection_sampler import greedy_verify, rejection_sample
from serve_app.speculation.sampling import probabilities
from serve_app.speculation.types import FEATURE_DTYPE, PAD_TOKEN, ProposalBlock, SamplingParams, VerifyResult


class Verifier(Protocol):
    """What the engine drives: the target side, in this process (``TargetVerifier``) or on a Ray
    actor (``workers.remote.RemoteVerifier``). Implementations subclass it explicitly, so the
    optional capability below has its default."""

    max_batch_size: int
    can_send_ahead: bool = False  # rounds may be sent before the last one's result (calls run in order)

    @property
    def free_slots(self) -> int: ...

    def add_sequence(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                     prefill: int | None = None) -> int | None:
        """Start a sequence and cache its prompt, all of it or its first ``prefill`` tokens. Returns the
        first token, drawn from the logits after the prompt, once the whole prompt is cached."""
        ...

    def continue_prefill(self, seq_id: str, count: int | None = None) -> int | None:
        """Cache the next ``count`` prompt tokens (None: the rest); the first token as ``add_sequence``."""
        ...

    def take_features(self, seq_ids: Sequence[str]) -> list[torch.Tensor]:
        """The target's features of each sequence's tokens so far (but its last), for an EAGLE head taking it."""
        raise ValueError("this target ships no features: it was not started for an EAGLE draft")

    def remove_sequence(self, seq_id: str) -> None: ...

    def verify(self, block: ProposalBlock) -> VerifyResult: ...

    def verify_async(self, block: ProposalBlock) -> Callable[[], VerifyResult]:
        """Send a round; the returned function waits for its result. In this process: verify now."""
        result = self.verify(block)
        return lambda: result


class TargetVerifier(Verifier):
    def __init__(self, runner: Runner, features: bool = False, taps: tuple[int, ...] = ()):
        self.runner = runner
        self.max_batch_size = runner.free_slots  # a new runner holds no sequence
        self.features = features
        self.feature_runner: FeatureRunner | None = None  # the runner, when it ships features
        if features:
            if not isinstance(runner, FeatureRunner):
                raise ValueError(f"features=True needs a runner that returns hidden states (torch), not {runner!r}")
            self.feature_runner = runner
        self.taps = taps
        self.params: dict[str, SamplingParams] = {}
        self.last_token: dict[str, int] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.unprefilled: dict[str, list[int]] = {}  # prompt tokens a chunked prefill has still to cache
        self.kept: dict[str, list[torch.Tensor]] = {}  # features of sequences no head has taken yet

    @property
    def free_slots(self) -> int:
        return self.runner.free_slots

    def add_sequence(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                     prefill: int | None = None) -> int | None:
        """Start a sequence and cache its prompt: all of it, or only the first ``prefill`` tokens, the rest
        by ``continue_prefill`` (chunked prefill). The forward that caches the prompt's last token scores
        it, as vLLM's does: the first token comes from the prefill (returned), not from a round after it.
        With features on, those of the prefilled positions (``[n, (len(taps) + 1) * hidden]``) are kept
        for ``take_features``."""
        if not prompt_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.runner.add(seq_id)
        self.params[seq_id] = params
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        self.generators[seq_id] = torch.Generator().manual_seed(seed)
        self.unprefilled[seq_id] = list(prompt_ids)
        if self.feature_runner is not None:
            self.kept[seq_id] = []
        return self.continue_prefill(seq_id, prefill)

    def continue_prefill(self, seq_id: str, count: int | None = None) -> int | None:
        """Cache the next ``count`` prompt tokens not cached yet (None: all); their features kept when on.
        Returns the first token once the last prompt token is cached (its logits drawn from)."""
        rest = self.unprefilled[seq_id]
        count = len(rest) if count is None else count
        chunk, self.unprefilled[seq_id] = rest[:count], rest[count:]
        if not chunk:
            return None
        last = not self.unprefilled[seq_id]
        runner = self.feature_runner
        if runner is None:
            if not last:
                self.runner.prefill(seq_id, chunk)
                return None
            logits = self.runner.forward([seq_id], [chunk], logits="last")  # [1, vocab]: the prompt's last
        else:
            hidden = runner.prefill(seq_id, chunk, taps=self.taps)  # [T, (len(taps) + 1) * hidden]
            self.kept[seq_id].append(hidden.to("cpu", FEATURE_DTYPE))
            if not last:
                return None
            logits = runner.head(hidden[-1:])
        empty = torch.zeros((1, 0), dtype=torch.long)
        output, _ = self._accept([seq_id], empty, torch.zeros(1, dtype=torch.long), None, None, logits[:, None])
        self.last_token[seq_id] = int(output[0, 0])
        return self.last_token[seq_id]

    def take_features(self, seq_ids: Sequence[str]) -> list[torch.Tensor]:
        runner = self.feature_runner
        if runner is None:
            return super().take_features(seq_ids)
        empty = torch.zeros((0, (len(self.taps) + 1) * runner.hf_config.hidden_size), dtype=FEATURE_DTYPE)
        return [torch.cat([empty, *self.kept.pop(s)]) for s in seq_ids]  # its rounds' travel from now on

    def remove_sequence(self, seq_id: str) -> None:
        if seq_id in self.params:
            self.runner.release(seq_id)
            for table in (self.params, self.last_token, self.generators, self.unprefilled):
                table.pop(seq_id, None)  # last_token: none until the prompt is cached
            self.kept.pop(seq_id, None)

    def verify(self, block: ProposalBlock) -> VerifyResult:
        seq_ids = block.seq_ids
        k = int(block.num_draft_tokens.max()) if len(seq_ids) else 0
        drafts = block.draft_tokens[:, :k]  # [batch, k]
        counts = block.num_draft_tokens.tolist()
        start = [self.runner.length(s) for s in seq_ids]
        feed = [[self.last_token[s]] + drafts[i, : counts[i]].tolist() for i, s in enumerate(seq_ids)]
        features = None
        if self.feature_runner is not None:
            # [batch, k + 1, vocab], [batch, k + 1, (len(taps) + 1) * hidden]
            logits, hidden = self.feature_runner.forward_hidden(seq_ids, feed, logits="all", taps=self.taps)
            features = hidden.to("cpu", FEATURE_DTYPE)
        else:
            logits = self.runner.forward(seq_ids, feed, logits="all")  # [batch, k + 1, vocab]

        output, accepted = self._accept(seq_ids, drafts, block.num_draft_tokens, block.q_ids, block.q_probs, logits)
        for i, s in enumerate(seq_ids):
            n = int(accepted[i])
            # Cache keeps last + n accepted drafts; the new last token is not cached yet.
            self.runner.truncate(s, start[i] + n + 1)
            self.last_token[s] = int(output[i, n])
            if features is not None and s in self.kept:
                self.kept[s].append(features[i, : n + 1].clone())  # not a view of the whole round's
        shipped = None  # every row's
        if features is not None and any(s in self.kept for s in seq_ids):
            shipped = tuple(i for i, s in enumerate(seq_ids) if s not in self.kept)  # the rows a head holds
            features = features[list(shipped)] if shipped else None
        return VerifyResult(seq_ids, block.num_draft_tokens.clone(), accepted, output, features,
                            shipped if features is not None else None)

    def _accept(self, seq_ids: Sequence[str], drafts: torch.Tensor, num_drafts: torch.Tensor,
                q_ids: torch.Tensor | None, q_probs: torch.Tensor | None, logits: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's accepted drafts and its own next token from ``logits`` ``[batch, k + 1, vocab]``:
        (output ``[batch, k + 1]``, accepted ``[batch]``)."""
        k = drafts.shape[1]
        output = torch.empty((len(seq_ids), k + 1), dtype=torch.long)
        accepted = torch.empty(len(seq_ids), dtype=torch.long)
        greedy = torch.tensor([self.params[s].greedy for s in seq_ids])
        if greedy.any():
            g = greedy.nonzero()[:, 0]
            target_argmax = logits[g.to(logits.device)].argmax(-1).cpu()  # only ids leave the device
            output[g], accepted[g] = greedy_verify(drafts[g], num_drafts[g], target_argmax)
        if not greedy.all():
            s_rows = (~greedy).nonzero()[:, 0]
            params = [self.params[seq_ids[i]] for i in s_rows.tolist()]
            # Sampled rows bring their logits to the host, where each request's generator lives.
            p = probabilities(logits[s_rows.to(logits.device)].cpu(), params)  # [rows, k + 1, vocab]
            if q_ids is None or q_probs is None:  # no proposer drafted for a sampled row
                if bool((num_drafts[s_rows] > 0).any()):
                    raise ValueError("a block with sampled draft tokens must carry q")
                q_ids = torch.full((len(seq_ids), k, 1), PAD_TOKEN, dtype=torch.long)
                q_probs = torch.zeros((len(seq_ids), k, 1))
            output[s_rows], accepted[s_rows] = rejection_sample(
                drafts[s_rows], num_drafts[s_rows],
                q_ids[s_rows, :k], q_probs[s_rows, :k], p,
                [self.generators[seq_ids[i]] for i in s_rows.tolist()],
            )
        return output, accepted
