"""The replica's side of the draft actor (``workers.remote.RemoteDraftProposer``), on a real Ray
actor: admitting a sequence never waits for the draft to prefill it, a failed admission falls back
to plain decoding, and plain stretches do not pile the draft's unseen outcomes up in the replica."""

from __future__ import annotations

import dataclasses
import time

import ray

from serve_app.models.base import RunnerConfig
from serve_app.speculation.types import SamplingParams
from serve_app.workers.draft_worker import DraftWorker
from serve_app.workers.remote import PENDING_FLUSH, RemoteDraftProposer
from serve_app.workers.target_worker import TargetWorker

PROMPT = [5, 9, 17, 33, 2, 8]
CONFIG = RunnerConfig(max_batch_size=2, max_seq_len=256)
SLOW_ADD_S = 2.0


class SlowAddDraft(DraftWorker):
    """A draft whose admission (its prompt's prefill) takes ``SLOW_ADD_S``, as a large draft's does."""

    def add_sequence(self, *args, **kwargs):
        time.sleep(SLOW_ADD_S)
        return super().add_sequence(*args, **kwargs)


def remote_draft(worker_class, tiny_models) -> RemoteDraftProposer:
    path = str(tiny_models["qwen3_near"])
    return RemoteDraftProposer(lambda: ray.remote(worker_class).remote(path, CONFIG, 8, 512, "CPU", 1), False)


def test_admission_does_not_wait_for_the_draft_and_drafting_starts_once_it_is_in(cluster, tiny_models):
    target = TargetWorker(str(tiny_models["qwen3"]), CONFIG, "CPU", num_threads=1)
    local = DraftWorker(str(tiny_models["qwen3_near"]), CONFIG, 8, 512, "CPU", 1)
    draft = remote_draft(SlowAddDraft, tiny_models)
    assert draft.prefills_aside  # one thread of two cores: its prefill leaves the target a core
    context = [*PROMPT, target.add_sequence("a", PROMPT, SamplingParams())]  # and the prefill's first token
    local.add_sequence("a", context, SamplingParams())

    start = time.perf_counter()
    draft.add_sequence("a", context, SamplingParams())
    assert time.perf_counter() - start < SLOW_ADD_S / 2  # the prefill runs on the draft's core, not the replica's

    # Until the draft holds the sequence, its rounds are plain: nothing waits on the prefill.
    start = time.perf_counter()
    block = draft.propose(["a"], [3])
    assert block.num_draft_tokens.tolist() == [0] and time.perf_counter() - start < SLOW_ADD_S / 2
    result = target.verify(block)
    draft.observe(result)
    local.observe((result,))

    time.sleep(SLOW_ADD_S * 1.5)
    for _ in range(3):  # then it drafts what the same draft in this process drafts, outcomes included
        block = draft.propose(["a"], [3])
        expected = local.propose(((), ("a",), (3,)))
        assert block.num_draft_tokens.tolist() == [3]
        assert block.draft_tokens.tolist() == expected.draft_tokens.tolist()
        result = target.verify(block)
        draft.observe(result)
        local.observe((result,))
    assert draft.failures == 0


class EveryCoreDraft(SlowAddDraft):
    """A slow-to-admit draft whose forwards run on every core of the host (a heavy draft on a small CPU host)."""

    def info(self):
        return dataclasses.replace(super().info(), every_core=True)


def test_a_draft_on_every_core_prefills_before_the_next_round_not_beside_it(cluster, tiny_models):
    """Beside the target's work, a prefill on the same cores stalls both (each forward's threads wait on
    the other's): the replica waits for it instead, and the sequence drafts from the next round."""
    draft = remote_draft(EveryCoreDraft, tiny_models)
    assert not draft.prefills_aside
    start = time.perf_counter()
    draft.add_sequence("a", PROMPT, SamplingParams())
    assert time.perf_counter() - start >= SLOW_ADD_S
    assert not draft.busy
    assert draft.propose(["a"], [3]).num_draft_tokens.tolist() == [3]
    assert draft.failures == 0


def test_a_failed_admission_leaves_the_sequence_to_plain_decoding_and_restarts_the_draft(cluster, tiny_models):
    draft = remote_draft(DraftWorker, tiny_models)
    for seq_id in ("a", "b", "c"):  # the draft has 2 slots: the third admission fails on the actor
        draft.add_sequence(seq_id, PROMPT, SamplingParams())
    deadline = time.time() + 30
    while draft.failures == 0 and time.time() < deadline:
        block = draft.propose(["a", "b", "c"], [2, 2, 2])
        time.sleep(0.1)
    assert draft.failures == 1
    assert block.num_draft_tokens.tolist() == [0, 0, 0]  # every sequence goes on plainly


def test_plain_stretches_hand_outcomes_to_the_draft_as_they_come(cluster, tiny_models):
    target = TargetWorker(str(tiny_models["qwen3"]), CONFIG, "CPU", num_threads=1)
    draft = remote_draft(DraftWorker, tiny_models)
    context = [*PROMPT, target.add_sequence("a", PROMPT, SamplingParams())]  # and the prefill's first token
    draft.add_sequence("a", context, SamplingParams())
    rounds = 3 * PENDING_FLUSH + 1
    for _ in range(rounds):  # plain rounds: the draft is never asked to draft
        block = draft.propose(["a"], [0])
        result = target.verify(block)
        draft.observe(result)
        assert len(draft.pending) < PENDING_FLUSH
    seen = ray.get(draft.actor.__ray_call__.remote(lambda worker: len(worker.proposer.history.tokens["a"])))
    assert seen == len(context) + rounds - len(draft.pending)
    block = draft.propose(["a"], [2])  # and it drafts from all of them at once
    assert block.num_draft_tokens.tolist() == [2]
