"""The verifier, three ways (after vLLM's rejection-sampler tests): exact greedy tables, a statistical
check that sampled outputs follow the target distribution p, and determinism under a seed.

Statistical tests: chi-square goodness of fit at significance level ALPHA = 0.001, with fixed seeds
(so each test is deterministic; a correct sampler fails one with probability 0.001 over seeds).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from serve_app.speculation.rejection_sampler import greedy_verify, rejection_sample
from serve_app.speculation.sampling import truncate_top
from serve_app.speculation.types import PAD_TOKEN

ALPHA = 1e-3
VOCAB = 8


def t(rows):
    return torch.tensor(rows, dtype=torch.long)


# ---- greedy ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "drafts, counts, argmax, accepted, output",
    [
        ([[1, 2, 3]], [3], [[1, 2, 3, 4]], [3], [[1, 2, 3, 4]]),  # all accepted: bonus 4
        ([[1, 2, 3]], [3], [[1, 5, 3, 4]], [1], [[1, 5, PAD_TOKEN, PAD_TOKEN]]),  # recovered 5
        ([[1, 2, 3]], [3], [[6, 2, 3, 4]], [0], [[6, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]]),
        ([[1, 2, PAD_TOKEN]], [2], [[1, 2, 7, 4]], [2], [[1, 2, 7, PAD_TOKEN]]),  # short row: bonus at 2
        ([[PAD_TOKEN] * 3], [0], [[5, 1, 1, 1]], [0], [[5, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]]),  # plain step
    ],
)
def test_greedy_table(drafts, counts, argmax, accepted, output):
    out, n = greedy_verify(t(drafts), t(counts), t(argmax))
    assert n.tolist() == accepted
    assert out.tolist() == output


def test_greedy_batch_rows_are_independent():
    out, n = greedy_verify(t([[1, 2], [3, 4]]), t([2, 2]), t([[1, 2, 9], [0, 4, 9]]))
    assert n.tolist() == [2, 0]
    assert out.tolist() == [[1, 2, 9], [0, PAD_TOKEN, PAD_TOKEN]]


# ---- sampling ----------------------------------------------------------------------------------
def dist(*values) -> torch.Tensor:
    x = torch.tensor(values, dtype=torch.float32)
    return x / x.sum()


def run_sampler(p_rows: torch.Tensor, q_rows: torch.Tensor, k: int, draws: int, seed: int, width: int | None = None):
    """Draft tokens drawn from q (or its top-``width`` truncation q'), verified against p.

    p_rows: [k + 1, vocab] target distribution per position; q_rows: [k, vocab] draft distribution.
    Returns (output_tokens [draws, k + 1], num_accepted [draws]).
    """
    gen = torch.Generator().manual_seed(seed)
    if width is None:
        q_ids = torch.arange(VOCAB).expand(k, VOCAB)
        q_probs = q_rows
    else:
        q_ids, q_probs = truncate_top(q_rows, width)  # the q' the draft really samples from
    drafts = torch.stack([
        q_ids[j].gather(0, torch.multinomial(q_probs[j], draws, replacement=True, generator=gen))
        for j in range(k)
    ], dim=1)  # [draws, k]
    generators = [torch.Generator().manual_seed(seed * 100_003 + i) for i in range(draws)]
    return rejection_sample(
        drafts, torch.full((draws,), k), q_ids.expand(draws, k, -1), q_probs.expand(draws, k, -1),
        p_rows.expand(draws, k + 1, VOCAB), generators,
    )


def assert_follows(tokens: torch.Tensor, p: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert counts[p == 0].sum() == 0, "a token with zero target probability was emitted"
    support = p > 0
    expected = p[support].double() / p[support].double().sum() * counts[support].sum()
    _, pvalue = chisquare(counts[support].numpy(), expected.numpy())
    assert pvalue > ALPHA, f"output counts {counts.tolist()} do not follow p={p.tolist()} (p-value {pvalue:.2e})"


P = dist(5, 1, 3, 0, 8, 2, 0.5, 4)
CASES = {
    "q_equals_p": P,
    "q_unrelated": dist(1, 6, 1, 3, 0.5, 2, 7, 1),
    "q_zero_where_p_has_mass": dist(0, 0, 3, 0, 0, 5, 1, 0),  # q misses tokens 0, 1, 4, 7
    "q_mass_where_p_is_zero": dist(1, 1, 1, 9, 1, 1, 1, 1),  # p(3) == 0 after top-k in the target
    "q_one_hot_like_ngram": dist(0, 0, 0, 0, 0, 1, 0, 0),
}


@pytest.mark.parametrize("case", CASES)
def test_sampled_outputs_follow_p(case):
    k = 3
    q = CASES[case].expand(k, VOCAB)
    out, n = run_sampler(P.expand(k + 1, VOCAB), q, k, draws=6000, seed=11)
    emitted = out[out != PAD_TOKEN]  # i.i.d. p at every position: pool all emitted tokens
    assert_follows(emitted, P)
    if case == "q_equals_p":
        assert (n == k).all()


@pytest.mark.parametrize("width", [1, 2, 4])
def test_top_k_truncated_q_keeps_p(width):
    k = 2
    q = CASES["q_unrelated"].expand(k, VOCAB)
    out, _ = run_sampler(P.expand(k + 1, VOCAB), q, k, draws=6000, seed=12, width=width)
    assert_follows(out[out != PAD_TOKEN], P)


def test_each_position_follows_its_own_p():
    p_rows = torch.stack([P, dist(1, 1, 1, 1, 8, 1, 1, 1), dist(0, 4, 0, 4, 0, 4, 0, 1)])
    q_rows = torch.stack([dist(2, 1, 1, 1, 1, 1, 1, 1), dist(1, 1, 1, 1, 1, 1, 1, 8)])
    out, _ = run_sampler(p_rows, q_rows, k=2, draws=8000, seed=13)
    assert_follows(out[:, 0], p_rows[0])
    # The second token (present when the first was accepted) is distributed as p_rows[1]
    # whatever happened at position 1: accepted draft, recovered token.
    second = out[:, 1]
    assert_follows(second[second != PAD_TOKEN], p_rows[1])


def test_deterministic_under_seed_and_independent_of_batch_neighbours():
    q = CASES["q_unrelated"].expand(3, VOCAB)
    a, na = run_sampler(P.expand(4, VOCAB), q, 3, draws=50, seed=5)
    b, nb = run_sampler(P.expand(4, VOCAB), q, 3, draws=50, seed=5)
    assert torch.equal(a, b) and torch.equal(na, nb)

    drafts = torch.multinomial(q, 20, replacement=True, generator=torch.Generator().manual_seed(0)).T  # [20, 3]
    q_ids, q_probs = torch.arange(VOCAB).expand(20, 3, VOCAB), q.expand(20, 3, VOCAB)

    def gens(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    batch, _ = rejection_sample(drafts, torch.full((20,), 3), q_ids, q_probs, P.expand(20, 4, VOCAB), gens(range(20)))
    alone, _ = rejection_sample(drafts[7:8], t([3]), q_ids[:1], q_probs[:1], P.expand(1, 4, VOCAB), gens([7]))
    assert torch.equal(alone[0], batch[7])
