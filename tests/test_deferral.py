"""Sequences held out of a decoder draft while drafting does not pay (``engine.deferral``): admitted
at a batch where the policy plays plain, they cost the draft nothing; once the policy drafts two rounds
in a row they are handed over with their whole context and draft, and the output is plain decoding's.
Rounds that share the cores with a draft's background prefill are left out of what the policy learns."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import ray

from serve_app.engine.deferral import Deferral
from serve_app.engine.request import GenerationParams
from serve_app.models.base import RunnerConfig
from serve_app.models.eagle import folder_fuse_layers
from serve_app.models.runner import ModelRunner
from serve_app.speculation.compatibility import load_vocab
from serve_app.speculation.policy import FixedPolicy, RoundCosts, Row
from serve_app.speculation.proposers.eagle import EagleProposer
from serve_app.speculation.types import SamplingParams
from tests.helpers import engine_for
from tests.test_remote_draft import PROMPT, SLOW_ADD_S, SlowAddDraft, remote_draft

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef mul(a, b):", "The quick brown fox jumps over"]


class DraftsAlone(FixedPolicy):
    """Drafts only for a sequence running alone (as a CPU's best k falls to 0 as the batch grows)."""

    def choose(self, rows: Sequence[Row], plain_overhead_hidden: bool = False) -> list[int]:
        return [r.cap if len(rows) == 1 else 0 for r in rows]


def held_engine(tiny_models, request, draft: str, batch: int = 2, **speculation):
    if draft == "eagle":
        return engine_for(tiny_models["llama"], draft=request.getfixturevalue("tiny_eagle") / "draft", k=3,
                          batch=batch, **speculation)
    return engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=batch, **speculation)


@pytest.mark.parametrize("draft", ["decoder", "eagle", "eagle+ngram"])
def test_sequences_admitted_while_plain_pays_cost_the_draft_nothing_until_it_drafts_again(tiny_models, request,
                                                                                         draft):
    """An EAGLE head too (served, the embedded model's head at 16 streams held every sequence from admission:
    each prompt's features and head prefill, and every plain round's features, for rounds that never drafted):
    the engine keeps a held sequence's features (the prompt's, then each round's) and hands them over with it."""
    engine = held_engine(tiny_models, request, draft.split("+")[0], ngram_first="ngram" in draft)
    engine.policy = DraftsAlone()
    proposer = engine.proposers["draft"]
    draft_side = getattr(proposer, "draft", proposer)  # the head behind n-gram lookup
    assert isinstance(engine.deferral, Deferral)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    plain = engine.generate(prompts, GenerationParams(max_tokens=24, method="none", ignore_eos=True))

    short, long = (engine.add_request(p, GenerationParams(max_tokens=n, ignore_eos=True))
                   for p, n in zip(prompts, (4, 24), strict=True))
    outputs: dict[str, list[int]] = {}
    held_while_two, drafted_alone = [], 0
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        if len(engine.running) == 2:
            held_while_two.append(set(draft_side.history.tokens))
        drafted_alone += int(engine.last_costs.k > 0)
    assert held_while_two and all(not held for held in held_while_two)  # two running: the draft held neither
    assert drafted_alone > 0 and long not in engine.deferral.held
    assert [outputs[short], outputs[long]] == [plain[0].token_ids[:4], plain[1].token_ids]


def test_a_held_sequence_reaches_an_eagle_head_with_the_targets_features_of_its_whole_context(tiny_models,
                                                                                               tiny_eagle):
    """Handed over after a plain stretch, the head drafts exactly what a head given the sequence's whole
    context and the target's features of it, from scratch, drafts (the features kept while it was held
    are the right ones, in order)."""
    engine = engine_for(tiny_models["llama"], draft=tiny_eagle / "draft", k=3, batch=2)
    engine.policy = DraftsAlone()
    head = engine.proposers["draft"]
    assert isinstance(head, EagleProposer)
    proposed: list[tuple[list[int], list[int]]] = []
    propose = head.propose

    def recording(seq_ids, num_tokens):
        contexts = {s: list(head.history.tokens[s]) for s, k in zip(seq_ids, num_tokens, strict=True) if k}
        block = propose(seq_ids, num_tokens)
        for i, s in enumerate(block.seq_ids):
            if s in contexts:
                proposed.append((contexts[s], block.draft_tokens[i, : int(block.num_draft_tokens[i])].tolist()))
        return block

    head.propose = recording
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    engine.add_request(prompts[0], GenerationParams(max_tokens=6, ignore_eos=True))
    engine.add_request(prompts[1], GenerationParams(max_tokens=24, ignore_eos=True))
    while engine.has_work:
        engine.step()
    handed_over = [(c, d) for c, d in proposed if c[:len(prompts[1])] == prompts[1] and len(c) > len(prompts[1]) + 4]
    assert handed_over  # drafted for after a plain stretch of more than four tokens

    cfg = RunnerConfig(max_batch_size=1, max_seq_len=256)
    oracle = ModelRunner(tiny_models["llama"], cfg)
    scratch = EagleProposer(ModelRunner(tiny_eagle / "draft", cfg), target_vocab=oracle.vocab_size,
                            vocab_map=load_vocab(tiny_eagle / "draft"))
    for context, drafts in handed_over[:3]:
        oracle.add("x")
        features = oracle.prefill("x", context[:-1], taps=folder_fuse_layers(tiny_eagle / "draft"))
        oracle.release("x")
        scratch.add_sequence("x", context, SamplingParams(), features)
        assert scratch.propose(["x"], [len(drafts)]).draft_tokens[0].tolist() == drafts
        scratch.remove_sequence("x")


class AsksAndDrafts(FixedPolicy):
    """Drafts every row's cap and keeps the rows of every choice it is asked; its own choice drafts
    only for a sequence alone (so a second sequence is admitted held)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[list[Row]] = []

    def choose(self, rows: Sequence[Row], plain_overhead_hidden: bool = False) -> list[int]:
        self.asked.append(list(rows))
        return [r.cap for r in rows]

    def would_draft(self, rows: Sequence[Row]) -> bool:
        return len(rows) == 1


def test_the_policy_sees_a_held_sequence_as_one_that_cannot_draft(tiny_models):
    """A round where the draft holds one sequence of two is judged as what it is: the batch of two,
    one row able to draft (else the policy learns a batch's drafting from rounds where most rows
    decoded plainly, and drafts for one row at the whole batch's cost)."""
    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=2)
    engine.policy = policy = AsksAndDrafts()
    first = engine.add_request(engine.tokenizer.encode(PROMPTS[0]), GenerationParams(max_tokens=12, ignore_eos=True))
    engine.step()
    second = engine.add_request(engine.tokenizer.encode(PROMPTS[1]), GenerationParams(max_tokens=12, ignore_eos=True))
    engine.step()
    assert second in engine.deferral.held
    policy.asked.clear()
    engine.step()
    caps = {r.seq_id: r.cap for r in policy.asked[-1]}
    assert caps == {first: 3, second: 0}


def test_a_request_admitted_alone_goes_to_the_draft_at_once(tiny_models):
    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=2)
    engine.policy = DraftsAlone()
    engine.add_request(engine.tokenizer.encode(PROMPTS[0]), GenerationParams(max_tokens=8, ignore_eos=True))
    engine.step()  # its prompt, and its first token
    engine.step()
    assert not engine.deferral.held and engine.last_costs.k == 3


def test_requests_that_arrive_during_a_prefill_count_in_the_batch_the_draft_decides_for(tiny_models):
    """Served, requests sent together reach the engine one by one: the first is admitted alone and the
    others arrive during its prefill (the real pair at 4 streams: the draft took the first, prefilled it
    and drafted a round for it alone before the others joined, and every stream's first token waited for
    that). Those that arrived meanwhile count in the batch the draft is asked about."""
    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=4)
    engine.policy = DraftsAlone()
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = GenerationParams(max_tokens=10, ignore_eos=True)
    plain = engine.generate(prompts, GenerationParams(max_tokens=10, method="none", ignore_eos=True))

    first = engine.add_request(prompts[0], params)
    later: list[str] = []
    engine.admission.arrivals = lambda: later or later.append(engine.add_request(prompts[1], params))
    engine.step()
    assert later and [r.request_id for r in engine.waiting] == later  # arrived during the prefill, not admitted yet
    assert first in engine.deferral.held and engine.last_costs.k == 0  # its round alone did not draft
    outputs: dict[str, list[int]] = {}
    while engine.has_work:
        outputs.update((out.request_id, out.token_ids) for out in engine.step())
    assert [outputs[first], outputs[later[0]]] == [p.token_ids for p in plain]


class NeverMeasuredAtABatch(FixedPolicy):
    """Would draft for a sequence alone; at a batch size where no round drafted, a hand-over to measure it
    pays after ``wait`` rounds there (as ``speculation.realized``'s, once it is a small share of the time)."""

    def __init__(self, wait: int = 3) -> None:
        super().__init__()
        self.measured: set[int] = set()
        self.rounds, self.wait, self.asked = 0, wait, []

    def would_draft(self, rows: Sequence[Row]) -> bool:
        return len(rows) == 1

    def explore_pays(self, rows: Sequence[Row], read: int) -> bool:
        self.asked.append(read)
        return any(r.cap for r in rows) and len(rows) not in self.measured and self.rounds >= self.wait

    def record_costs(self, costs: RoundCosts) -> None:
        super().record_costs(costs)
        self.rounds += 1
        if costs.k:
            self.measured.add(costs.batch)


@pytest.mark.parametrize("draft", ["decoder", "eagle"])
def test_where_every_sequence_is_held_at_a_batch_size_never_drafted_at_the_draft_takes_one(tiny_models, request,
                                                                                         draft):
    """Requests sent together are held together (``test_requests_that_arrive_during_a_prefill...``), so no
    sequence is with the draft and no probe can measure drafting at that batch size: the policy would
    judge it by its model alone, forever. Once the policy says measuring it pays for the draft's reading,
    the draft takes one sequence (the shortest context: the cheapest to read), whose rounds measure
    drafting there; the others stay held, and the output is plain decoding's."""
    engine = held_engine(tiny_models, request, draft, batch=3)
    prompts = [engine.tokenizer.encode(p) for p in [*PROMPTS, "Once upon a time, in a land far away, there lived"]]
    lengths = [24 if len(p) == min(map(len, prompts)) else 10 for p in prompts]
    plain = engine.generate(prompts, [GenerationParams(max_tokens=n, method="none", ignore_eos=True)
                                      for n in lengths])
    engine.policy = policy = NeverMeasuredAtABatch()
    ids = [engine.add_request(p, GenerationParams(max_tokens=n, ignore_eos=True))
           for p, n in zip(prompts, lengths, strict=True)]
    shortest = ids[lengths.index(24)]
    rounds = drafting_rows(engine)
    outputs: dict[str, list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        if len(engine.running) == 3:
            assert engine.deferral.held == set(ids) - ({shortest} if len(rounds) > policy.wait else set())
    assert 3 in policy.measured and {s for r in rounds for s in r} == {shortest}
    assert policy.asked[0] == len(prompts[ids.index(shortest)]) + 1  # what the draft would read: the prompt and
    # the first token (the prefill's)
    assert not any(rounds[:policy.wait])
    assert [outputs[i] for i in ids] == [p.token_ids for p in plain]


def test_rounds_during_a_drafts_background_prefill_are_not_what_the_policy_learns(cluster, tiny_models):
    draft = remote_draft(SlowAddDraft, tiny_models)
    ray.get(draft.actor.ping.remote())
    draft.add_sequence("a", PROMPT, SamplingParams())
    assert draft.busy  # its prefill runs on the draft's cores
    time.sleep(SLOW_ADD_S * 1.5)
    assert not draft.busy

    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=2)
    learned: list[RoundCosts] = []
    engine.policy = type("Recorder", (FixedPolicy,), {"record_costs": lambda self, costs: learned.append(costs),
                                                     "observe": lambda self, result: None})()
    engine.proposers["draft"].busy = True  # as the remote draft is while a prefill runs
    engine.generate([engine.tokenizer.encode(PROMPTS[0])], GenerationParams(max_tokens=6, ignore_eos=True))
    assert learned and all(c.interval_s is None for c in learned)
    engine.proposers["draft"].busy = False
    engine.generate([engine.tokenizer.encode(PROMPTS[1])], GenerationParams(max_tokens=6, ignore_eos=True))
    assert any(c.interval_s is not None for c in learned[-4:])




def recorded_calls(engine) -> list[str]:
    """The order of the target's and the draft's add and remove calls from now on."""
    calls: list[str] = []
    for name, obj in (("target", engine.verifier), ("draft", engine.proposers["draft"])):
        add, remove = obj.add_sequence, obj.remove_sequence
        obj.add_sequence = lambda *a, _n=name, _f=add, **kw: (calls.append(f"{_n} add"), _f(*a, **kw))[1]
        obj.remove_sequence = lambda *a, _n=name, _f=remove, **kw: (calls.append(f"{_n} remove"), _f(*a, **kw))[1]
    return calls


def test_a_draft_that_will_draft_takes_the_prompt_before_the_targets_prefill_and_lets_go_if_it_fails(tiny_models):
    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=2)
    engine.proposers["draft"].prefills_aside = True  # as a remote draft on cores of its own
    calls = recorded_calls(engine)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    engine.add_request(prompt, GenerationParams(max_tokens=5, ignore_eos=True))
    engine.step()  # its prompt, and its first token
    engine.step()
    assert calls[:2] == ["draft add", "target add"]  # the draft's prefill runs beside the target's
    assert engine.last_costs.k == 3 and not engine.deferral.early

    calls.clear()
    target_add = engine.verifier.add_sequence
    engine.verifier.add_sequence = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("target lost"))
    request_id = engine.add_request(prompt, GenerationParams(max_tokens=4, ignore_eos=True))
    try:
        engine.step()
    except RuntimeError:
        pass
    assert calls == ["draft add", "draft remove"] and not engine.deferral.early
    assert [r.request_id for r in engine.waiting] == [request_id]  # still queued, the draft holds nothing
    engine.verifier.add_sequence = target_add
    while engine.has_work:
        engine.step()


def test_a_draft_prefilling_on_the_targets_cores_takes_the_prompt_after_the_targets_prefill(tiny_models):
    """A draft whose prefill would share the target's cores (``Proposer.prefills_aside`` false: in process,
    or a heavy draft on a small CPU host) gets the prompt once the target holds it, and drafts at once."""
    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=2)
    assert not engine.proposers["draft"].prefills_aside
    calls = recorded_calls(engine)
    engine.add_request(engine.tokenizer.encode(PROMPTS[0]), GenerationParams(max_tokens=5, ignore_eos=True))
    engine.step()  # its prompt, and its first token
    engine.step()
    assert calls[:2] == ["target add", "draft add"] and engine.last_costs.k == 3


def test_the_first_token_does_not_wait_for_a_draft_prefilling_on_the_targets_cores(tiny_models):
    """Such a draft takes the prompt at the next step, once the first token is out: its prefill (about 1.1 s
    a request for the pair's 0.5 B draft in float32 on two cores) no longer stands between the target's
    prefill and the first token. A request that ends or is aborted before that step never reaches the draft;
    the tokens are plain decoding's either way."""
    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=2)
    prompt = engine.tokenizer.encode(PROMPTS[0])
    plain = engine.generate([prompt], GenerationParams(max_tokens=6, method="none", ignore_eos=True))[0]
    calls = recorded_calls(engine)
    engine.add_request(prompt, GenerationParams(max_tokens=6, ignore_eos=True), "kept")
    [first] = engine.step()
    assert first.token_ids == plain.token_ids[:1] and calls == ["target add"]
    engine.step()
    assert calls[:2] == ["target add", "draft add"] and engine.last_costs.k == 3
    out = []
    while engine.has_work:
        out += engine.step()
    assert out[-1].token_ids == plain.token_ids

    calls.clear()
    engine.add_request(prompt, GenerationParams(max_tokens=6, ignore_eos=True), "left")
    engine.step()
    engine.abort("left")
    engine.add_request(prompt, GenerationParams(max_tokens=1, ignore_eos=True), "one")
    [done] = engine.step()
    assert done.finished and not engine.has_work
    assert "draft add" not in calls and not engine.deferral.handing


class PlainWithProbes(FixedPolicy):
    """Its own choice drafts until ``plain`` is set, then plays plain with a probe of every row's cap
    each ``every``-th round (as ``speculation.realized`` explores while plain leads)."""

    def __init__(self, every: int = 4) -> None:
        super().__init__()
        self.plain, self.every, self.calls = False, every, 0

    def choose(self, rows: Sequence[Row], plain_overhead_hidden: bool = False) -> list[int]:
        self.calls += 1
        probe = self.calls % self.every == 0
        return [r.cap if not self.plain or probe else 0 for r in rows]

    def would_draft(self, rows: Sequence[Row]) -> bool:
        return not self.plain


def drafting_rows(engine) -> list[list[str]]:
    """From now on, per round: the sequences that drafted."""
    rounds: list[list[str]] = []
    engine.on_round = lambda result, seconds: rounds.append(
        [s for s, k in zip(result.seq_ids, result.num_draft_tokens.tolist(), strict=True) if k])
    return rounds


@pytest.mark.parametrize("draft", ["decoder", "eagle"])
def test_a_probe_during_a_plain_stretch_drafts_with_one_sequence_so_one_draft_catches_up(tiny_models, request,
                                                                                         draft):
    """A draft holding sequences through plain rounds has every one of their tokens still to read: a
    probe drafting for all of them pays all of it (a decoder draft on the pair: 1.3 s for 4 sequences 44
    rounds behind, against 0.23 s a round; an EAGLE head, which reads the target's features of the
    stretch, on the embedded model at 16 streams: 0.04-0.25 s in the head, 0.22-0.35 s a round against
    0.11 s). A probe drafts with the sequence the draft is least behind on (an EAGLE head holds every
    sequence from admission, as it needs the prompt's features, and is cut all the same); the others
    decode plainly that round, and the output is plain decoding's."""
    if draft == "eagle":
        engine = engine_for(tiny_models["llama"], draft=request.getfixturevalue("tiny_eagle") / "draft", k=3, batch=2)
    else:
        engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=2)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    plain = engine.generate(prompts, GenerationParams(max_tokens=30, method="none", ignore_eos=True))
    engine.policy = policy = PlainWithProbes()
    ids = [engine.add_request(p, GenerationParams(max_tokens=30, ignore_eos=True)) for p in prompts]
    outputs: dict[str, list[int]] = {}
    rounds = drafting_rows(engine)
    for _ in range(3):  # each prompt's step (its first token), then a round
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    assert set(rounds[-1]) == set(ids) and not engine.deferral.held  # both on the draft, drafting
    policy.plain = True
    start = len(rounds)
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    probes = [r for r in rounds[start:] if r]
    assert probes and all(len(r) == 1 for r in probes)
    assert [outputs[i] for i in ids] == [p.token_ids for p in plain]


def test_a_round_whose_draft_catches_up_costs_what_it_cost_but_teaches_nothing_of_a_draft_step(tiny_models):
    """After a plain stretch the draft reads every token of it first: the round's interval is what
    drafting then costs (the policy must see it), its draft's seconds are not what a draft step costs."""
    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=2)
    learned: list[RoundCosts] = []

    class Learns(PlainWithProbes):
        def record_costs(self, costs: RoundCosts) -> None:
            learned.append(costs)

    engine.policy = policy = Learns(every=1000)
    engine.add_request(engine.tokenizer.encode(PROMPTS[0]), GenerationParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert learned[-1].k == 3 and learned[-1].interval_s is not None and learned[-1].draft_s
    policy.plain = True
    for _ in range(8):  # plain rounds: the draft falls 8 tokens behind
        engine.step()
    policy.plain = False
    engine.step()
    assert learned[-1].k == 3 and learned[-1].interval_s is not None and not learned[-1].draft_s
    engine.step()
    assert learned[-1].k == 3 and learned[-1].interval_s is not None and learned[-1].draft_s


def test_a_round_that_hands_held_sequences_to_the_draft_is_not_what_the_policy_learns(tiny_models):
    """Its interval holds the draft's prefill of their whole context so far."""
    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=2)
    learned: list[RoundCosts] = []
    engine.policy = type("Learns", (DraftsAlone,), {"record_costs": lambda self, costs: learned.append(costs)})()
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    for p, n in zip(prompts, (6, 24), strict=True):
        engine.add_request(p, GenerationParams(max_tokens=n, ignore_eos=True))
    while len(engine.running) + len(engine.waiting) != 1 or not engine.deferral.held:
        engine.step()
    context = engine.running[next(iter(engine.deferral.held))].num_tokens
    engine.step()  # alone: the held one is handed over, and drafts
    assert not engine.deferral.held and learned[-1].k == 3 and learned[-1].interval_s is None
    assert learned[-1].catch_up is not None and learned[-1].catch_up[0] == context  # what the draft read first
    engine.step()
    assert learned[-1].k == 3 and learned[-1].interval_s is not None and learned[-1].catch_up is None


class DraftsAloneAtAPrice(DraftsAlone):
    """Would draft for a sequence alone, but a hand-over pays only as ``pays`` says; records what it is asked."""

    def __init__(self, pays: bool) -> None:
        super().__init__()
        self.pays, self.asked = pays, []

    def hand_over_pays(self, rows: Sequence[Row], remaining: int, read: int) -> bool:
        self.asked.append((len(rows), remaining, read))
        return self.pays


def test_held_sequences_stay_held_where_the_hand_over_does_not_pay_for_the_catch_up(tiny_models):
    """The policy is asked with the tokens the running requests may still generate and the tokens the
    draft would have to read; where it says no, the held sequence decodes plainly to its end."""
    engine = engine_for(tiny_models["qwen3"], draft=tiny_models["qwen3_near"], k=3, batch=2)
    engine.policy = policy = DraftsAloneAtAPrice(pays=False)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    plain = engine.generate(prompts, GenerationParams(max_tokens=24, method="none", ignore_eos=True))
    ids = [engine.add_request(p, GenerationParams(max_tokens=n, ignore_eos=True))
           for p, n in zip(prompts, (6, 24), strict=True)]
    outputs: dict[str, list[int]] = {}
    while len(engine.running) + len(engine.waiting) != 1 or not engine.deferral.held:
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    held = engine.running[ids[1]]
    left, context = 24 - len(held.output_ids), held.num_tokens
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        assert engine.last_costs.k == 0
    assert policy.asked[0] == (1, left, context)
    assert ids[1] in outputs and [outputs[i] for i in ids] == [plain[0].token_ids[:6], plain[1].token_ids]
