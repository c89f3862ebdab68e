"""Core-range parsing and the contiguity check the Neuron runtime needs."""

from __future__ import annotations

import pytest

from serve_app.workers.placement import (
    NEURON_VISIBLE_CORES,
    PlacementError,
    claim_neuron_cores,
    contiguous_range,
    parse_core_ids,
    worker_resources,
)


@pytest.mark.parametrize(
    "value, ids",
    [("0-3", [0, 1, 2, 3]), ("3,4,5", [3, 4, 5]), ("6,4,5", [6, 4, 5]), ("0-1,4", [0, 1, 4]), ("", []), ("7", [7])],
)
def test_parse_core_ids(value, ids):
    assert parse_core_ids(value) == ids


def test_backwards_range_is_an_error():
    with pytest.raises(PlacementError, match="backwards"):
        parse_core_ids("5-2")


def test_unsorted_but_contiguous_is_sorted():
    assert contiguous_range([6, 4, 5, 7], "target") == (4, 7)


@pytest.mark.parametrize("ids", [[0, 2], [1, 1, 2], []])
def test_gaps_duplicates_and_empty_fail_clearly(ids):
    with pytest.raises(PlacementError, match="target"):
        contiguous_range(ids, "target")


def test_claim_rewrites_the_variable_as_a_sorted_range(monkeypatch):
    monkeypatch.setenv(NEURON_VISIBLE_CORES, "5,3,4")
    assert claim_neuron_cores("draft worker") == (3, 5)
    import os

    assert os.environ[NEURON_VISIBLE_CORES] == "3-5"


def test_claim_fails_without_assignment_or_with_gaps(monkeypatch):
    monkeypatch.delenv(NEURON_VISIBLE_CORES, raising=False)
    with pytest.raises(PlacementError, match="not set"):
        claim_neuron_cores("draft worker")
    monkeypatch.setenv(NEURON_VISIBLE_CORES, "0,1,3")
    with pytest.raises(PlacementError, match=r"not one contiguous range.*4-7"):
        claim_neuron_cores("target worker")


def test_worker_resources():
    assert worker_resources("neuron_cores", 4, 1.0) == {"CPU": 1.0, "neuron_cores": 4}
    assert worker_resources("CPU", 4, 0.5) == {"CPU": 0.5}


def test_available_cpus_is_within_the_affinity():
    import os

    from serve_app.workers.placement import available_cpus

    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


def test_thread_plan_widens_only_for_large_rounds():
    from serve_app.workers.placement import ThreadPlan

    plan = ThreadPlan.for_worker("target", weight_bytes=270_000_000, alone=True, cpus=2)
    assert plan.threads(1) == 1  # a batch-1 step stays off the core the replica and the ingress use
    assert plan.threads(plan.wide_from_tokens - 1) == 1
    assert plan.threads(plan.wide_from_tokens) == 2  # a large round gains more than it loses to stalls
    assert plan.threads(None) == 2  # a prefill
    assert ThreadPlan.for_worker("target", 270_000_000, alone=True, cpus=1).threads(64) == 1
    fixed = ThreadPlan.fixed(3)
    assert fixed.threads(1) == fixed.threads(100) == 3


def test_a_heavy_model_computing_alone_takes_every_core_and_shares_them_when_rounds_overlap():
    """A forward that reads a gigabyte takes 150 ms on one core and 85 on two (the 1.5 B target here):
    the stall a shared core costs is lost in it. But while the draft drafts ahead during the target's
    verify, each keeps to its own cores."""
    from serve_app.workers.placement import HEAVY_WEIGHT_BYTES, ThreadPlan

    heavy = HEAVY_WEIGHT_BYTES
    assert ThreadPlan.for_worker("target", heavy, alone=True, cpus=2).threads(1) == 2
    assert ThreadPlan.for_worker("draft", heavy, alone=True, cpus=2).threads(1) == 2
    assert ThreadPlan.for_worker("target", heavy, alone=False, cpus=2).threads(1) == 1
    assert ThreadPlan.for_worker("target", heavy, alone=False, cpus=2).threads(None) == 2
    assert ThreadPlan.for_worker("draft", heavy, alone=False, cpus=2).threads(None) == 1
    assert ThreadPlan.for_worker("draft", heavy - 1, alone=True, cpus=2).threads(1) == 1
    assert ThreadPlan.for_worker("draft", heavy, alone=True, cpus=1).threads(1) == 1


def test_a_plan_on_every_core_is_one_no_other_worker_may_compute_beside():
    """A draft whose forwards take every core (heavy, rounds not overlapped) must not prefill beside the
    target's work: both would stall (``workers.remote.RemoteDraftProposer.prefills_aside``)."""
    from serve_app.workers.placement import HEAVY_WEIGHT_BYTES, ThreadPlan

    heavy = HEAVY_WEIGHT_BYTES
    assert ThreadPlan.for_worker("draft", heavy, alone=True, cpus=2).every_core(2)
    assert not ThreadPlan.for_worker("draft", heavy - 1, alone=True, cpus=2).every_core(2)
    assert not ThreadPlan.for_worker("draft", heavy, alone=False, cpus=2).every_core(2)
    assert ThreadPlan.for_worker("draft", heavy - 1, alone=True, cpus=1).every_core(1)  # one core: shared
    assert ThreadPlan.fixed(2).every_core(2) and not ThreadPlan.fixed(1).every_core(2)
