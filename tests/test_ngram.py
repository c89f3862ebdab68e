"""N-gram prompt lookup."""

from __future__ import annotations

import numpy as np
import torch

from serve_app.speculation.proposers.ngram import NgramProposer, lookup
from serve_app.speculation.types import PAD_TOKEN, SamplingParams, VerifyResult


def test_lookup_prefers_longest_suffix_and_latest_match():
    tokens = np.array([1, 2, 3, 9, 9, 2, 3, 4, 5, 1, 2, 3])
    # suffix (1, 2, 3) occurs at 0 -> continuation 9, 9, 2
    assert lookup(tokens, 3, 1, 3) == [9, 9, 2]
    # with max_n = 2, suffix (2, 3) latest earlier match is at 5 -> 4, 5, 1
    assert lookup(tokens, 3, 1, 2) == [4, 5, 1]


def test_lookup_returns_nothing_without_a_match():
    assert lookup(np.array([1, 2, 3, 4]), 4, 1, 3) == []
    assert lookup(np.array([5]), 4, 1, 3) == []


def test_continuation_is_capped_at_available_tokens():
    assert lookup(np.array([7, 8, 7]), 5, 1, 3) == [8, 7]


def test_proposer_tracks_history_and_ships_one_hot_q_when_sampling():
    prop = NgramProposer(1, 2)
    prop.add_sequence("g", [1, 2, 3, 1, 2], SamplingParams())
    prop.add_sequence("s", [4, 5, 4], SamplingParams(temperature=1.0))
    block = prop.propose(["g", "s"], [2, 3])
    assert block.draft_tokens.tolist() == [[3, 1], [5, 4]]  # "s" has only 2 tokens after its match
    assert block.num_draft_tokens.tolist() == [2, 2]
    assert block.q_ids is not None and block.q_ids[1, 0, 0] == 5 and block.q_probs[1, 0, 0] == 1.0
    # "x" belongs to another proposer: ignored
    result = VerifyResult(
        ("g", "x"), torch.tensor([2, 1]), torch.tensor([1, 0]), torch.tensor([[3, 8, PAD_TOKEN], [1, 2, 3]])
    )
    prop.observe(result)
    assert prop.history.tokens["g"] == [1, 2, 3, 1, 2, 3, 8]
    prop.remove_sequence("g")
    assert "g" not in prop.history.tokens
