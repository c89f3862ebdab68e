"""An EAGLE head as proposer (``serve_app.models.eagle``): the draft-model loop, fed the target's features.

Per sequence it holds the target's true features that its cache has not consumed yet. With history
x_0..x_{L-1} and c cache entries built from true features, those are f_{c-1}..f_{L-2} (f_{-1} = 0).
A proposal first feeds x_c..x_{L-1} with them (the catch-up), then drafts: each step feeds the
token it just drew with the feature it just predicted. The entries of those steps rest on predicted
features, so ``observe`` rolls the cache back to the c true ones and queues the features the verify
result brings (``VerifyResult.new_features``: the previous last token's and each accepted draft's).
Sampling, q' and the reduced vocabulary are the draft-model proposer's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_app.models.base import FeatureRunner
from serve_app.speculation.proposers.draft_model import DraftModelProposer
from serve_app.speculation.types import FEATURE_DTYPE, SamplingParams, VerifyResult


class EagleProposer(DraftModelProposer):
    # A head continues from the target's features of the tokens it reads; an optimistic block has none.
    can_propose_ahead = False
    can_add_later = True  # from the whole context and the target's features of it (the engine keeps them)
    reads_features = True
    runner: FeatureRunner

    def __init__(self, runner: FeatureRunner, width: int = 32, target_vocab: int | None = None,
                 vocab_map: list[int] | None = None, stop_below: float = 0.0):
        super().__init__(runner, width, target_vocab, vocab_map, stop_below)
        # the target's features: its final state, after the streams of any layers the head taps (EAGLE-3)
        self.true_width: int = (len(runner.model.fuse_layers) + 1) * runner.model.feature_size  # type: ignore[attr-defined]
        self.pending: dict[str, list[torch.Tensor]] = {}  # true features not fed yet, oldest first
        self.queued: dict[str, int] = {}  # how many: a plain stretch queues one a round, so no sum over them

    def add_sequence(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                     features: torch.Tensor | None = None) -> None:
        if features is None or len(features) != len(prompt_ids) - 1:
            raise ValueError(f"an EAGLE draft needs the target's features for the {len(prompt_ids) - 1} prefilled "
                             "prompt tokens (a TargetVerifier started with features=True)")
        self._track(seq_id, prompt_ids, params)
        shifted = torch.cat((torch.zeros((1, self.true_width), dtype=FEATURE_DTYPE), features.to(FEATURE_DTYPE)))
        if len(prompt_ids) > 1:  # x_0..x_{P-2} with f_{-1}..f_{P-3}
            self.runner.prefill(seq_id, self._to_draft(prompt_ids[:-1]), shifted[:-1])
        self.pending[seq_id] = [shifted[-1:]]
        self.queued[seq_id] = 1

    def remove_sequence(self, seq_id: str) -> None:
        super().remove_sequence(seq_id)
        self.pending.pop(seq_id, None)
        self.queued.pop(seq_id, None)

    def _catch_up(self, seq_ids: Sequence[str], feed: Sequence[Sequence[int]]) -> torch.Tensor:
        out = torch.zeros((len(seq_ids), max(map(len, feed)), self.true_width), dtype=FEATURE_DTYPE)
        for r, s in enumerate(seq_ids):
            f = torch.cat(self.pending[s])
            if len(f) != len(feed[r]):
                raise RuntimeError(f"EAGLE draft out of step on {s!r}: {len(f)} features for {len(feed[r])} tokens")
            out[r, : len(f)] = f
            self.pending[s] = []
            self.queued[s] = 0
        return out

    def _step(self, seq_ids: Sequence[str], feed: Sequence[Sequence[int]], carry: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = self.runner.forward_hidden(seq_ids, feed, features=carry)
        return logits, hidden[:, None]  # the predicted feature goes with the token drawn from it

    def observe(self, result: VerifyResult) -> None:
        for i, s in enumerate(result.seq_ids):
            if s in self.pending:
                features = result.new_features(i)
                self.pending[s].append(features)
                self.queued[s] += len(features)
        for s in self.history.extend(result):
            # c = L minus the features still queued: one per history token the cache lacks
            true_len = len(self.history.tokens[s]) - self.queued[s]
            if self.runner.length(s) > true_len:
                self.runner.truncate(s, true_len)
