"""The worker actor classes in this process (Ray only wraps them), their failure classification, and
the small pieces they stand on: KV slots, speculation stats, the base proposers."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError, RayError

from serve_app.engine.stats import SpecStats
from serve_app.models.base import RunnerConfig
from serve_app.models.slots import SequenceSlots
from serve_app.speculation.proposers.base import NoProposer, TokenHistory
from serve_app.speculation.types import SamplingParams
from serve_app.workers.base import WorkerBase
from serve_app.workers.draft_worker import DraftWorker
from serve_app.workers.remote import WorkerError
from serve_app.workers.target_worker import TargetWorker
from tests.helpers import hf_greedy

PROMPT = [5, 9, 17, 33, 2, 8]


def test_the_workers_run_rounds_as_the_replica_drives_them(tiny_models):
    """One call each per round: the draft learns the last outcome and drafts, the target verifies;
    greedy output is transformers'."""
    config = RunnerConfig(max_batch_size=2, max_seq_len=128)
    target = TargetWorker(str(tiny_models["qwen3"]), config, "CPU", num_threads=1)
    draft = DraftWorker(str(tiny_models["qwen3_near"]), config, 8, target.verifier.runner.vocab_size, "CPU", 1)
    assert isinstance(target, WorkerBase) and isinstance(draft, WorkerBase)
    first = target.add_sequence("a", PROMPT, SamplingParams())  # the first token, from the prompt's prefill
    draft.add_sequence("a", [*PROMPT, first], SamplingParams())
    tokens, previous = [first], ()
    while len(tokens) < 24:
        block = draft.propose((previous, ("a",), (3,)))
        result = target.verify(block)
        tokens += result.new_tokens(0)
        previous = (result,)
    assert tokens[:24] == hf_greedy(tiny_models["qwen3"], PROMPT, 24)
    seconds, calls = target.compute_stats()
    assert calls > 0 and seconds > 0 and target.compute_stats() == (0.0, 0)
    target.remove_sequence("a")
    draft.observe(previous)  # outcomes of a removed sequence are learnt without drafting
    draft.remove_sequence("a")
    assert target.verifier.free_slots == 2


@pytest.mark.parametrize("error, lost", [
    (ActorDiedError(), True), (GetTimeoutError("hung"), True), (RayError("raised inside the call"), False)])
def test_a_worker_error_says_whether_the_worker_is_gone(error, lost):
    e = WorkerError.of("target", error)
    assert e.lost is lost and str(e).startswith("target worker failed: ")


def test_kv_slots_are_reused_lowest_first_and_refuse_past_capacity():
    slots = SequenceSlots(2)
    slots.add("a")
    slots.add("b")
    assert slots.free_slots == 0
    with pytest.raises(RuntimeError):
        slots.add("c")
    slots.release("a")
    slots.add("c")
    assert slots._slot["c"] == 0 and slots.length("c") == 0


def test_stats_merge_and_report_consistently():
    a, b = SpecStats(), SpecStats()
    a.record_round(3, 2)
    b.record_round(0, 0)
    b.record_round(4, 4)
    a.merge(b)
    d = a.as_dict()
    assert d["num_drafts"] == 2 and d["num_draft_tokens"] == 7 and d["num_accepted_tokens"] == 6
    assert d["accepted_per_position"] == [2, 2, 1, 1] and d["target_forward_passes"] == 3
    assert d["mean_acceptance_length"] == 4.0


def test_the_base_proposers_keep_history_and_propose_nothing():
    history = TokenHistory()
    history.add("a", [1, 2], SamplingParams())
    with pytest.raises(ValueError):
        history.add("b", [], SamplingParams())
    block = NoProposer().propose(["a"], [4])
    assert int(block.num_draft_tokens.sum()) == 0
