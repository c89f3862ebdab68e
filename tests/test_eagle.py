"""The EAGLE draft head: trained by the distill pipeline, lossless in the engine, its features in step.

The head reads the target's hidden states, which travel from the verifier to the proposer; the
bookkeeping test recomputes every proposal from scratch (target features over the whole history,
then the head's k steps) and compares it with the incremental, cached proposer.
"""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil

import pytest
import torch

from serve_app.config import EngineConfig, SpeculationConfig
from serve_app.distill.eagle import load_eagle, unrolled
from serve_app.distill.train import DistillConfig, distill
from serve_app.engine.plan import reads_features
from serve_app.engine.request import GenerationParams
from serve_app.models.base import RunnerConfig
from serve_app.models.eagle import EagleHead, folder_fuse_layers
from serve_app.models.runner import ModelRunner
from serve_app.speculation.compatibility import DraftMismatchError, check_draft, load_vocab
from serve_app.speculation.proposers.eagle import EagleProposer
from serve_app.speculation.types import ProposalBlock, SamplingParams, VerifyResult
from serve_app.speculation.verifier import TargetVerifier
from tests.conftest import make_tiny_model
from tests.helpers import engine_for, hf_greedy

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):",
    "The quick brown fox jumps over",
    "Speculative decoding drafts tokens",
    "dog dog dog dog",
]


def test_pipeline_writes_a_servable_eagle_head(tiny_models, tiny_eagle):
    head = tiny_eagle / "draft"
    for name in ("features.pt", "features_after_1.pt", "checkpoint.pt", "draft/eagle_fc.safetensors",
                 "draft/draft_vocab.json"):
        assert (tiny_eagle / name).is_file(), name
    assert folder_fuse_layers(head) == (1,)  # default taps for a 2-layer target: after its first layer
    notes = check_draft(tiny_models["llama"], head)
    assert any("EAGLE head: the target ships its hidden states (its residual streams after 1 layers" in n
               for n in notes) and any("reduced vocabulary" in n for n in notes)
    runner = ModelRunner(head, RunnerConfig())
    assert isinstance(runner.model, EagleHead)
    runner.add("s")
    with pytest.raises(ValueError, match="needs the target's features"):
        runner.forward(["s"], [[1, 2]])


def test_training_continues_from_a_saved_head(tiny_models, tiny_eagle, tmp_path, capsys):
    out = tmp_path / "more"
    out.mkdir()
    for name in ("data.pt", "teacher.pt", "features.pt"):  # same data: same vocabulary
        shutil.copy(tiny_eagle / name, out / name)
    distill(DistillConfig(target=str(tiny_models["llama"]), out=out, arch="eagle", init=tiny_eagle / "draft",
                          max_steps=4, eval_every=2, vocab_size=200, unroll=2, batch_size=4))
    log = capsys.readouterr().out
    assert f"starting from {tiny_eagle / 'draft'}" in log and "mean acceptance length at k=4" in log
    assert re.search(r"held-out agreement [0-9.]+ \(training [0-9.]+\)", log)
    record = json.loads((out / "log.jsonl").read_text().splitlines()[-1])
    assert 0 <= record["heldout_agreement"] <= 1 and 0 <= record["train_agreement"] <= 1
    assert (out / "draft" / "eagle_fc.safetensors").is_file()


@torch.no_grad()
def test_training_unrolls_drafting_exactly_as_the_served_head_drafts(tiny_eagle):
    """The training-time test (``unrolled``) must compute, at step s and position p, the logits the
    served head gives for the (s+1)-th token of a draft that began at p - s: true features up to
    there, its own predictions after."""
    head = tiny_eagle / "draft"
    trained = load_eagle(head).eval()
    runner = ModelRunner(head, RunnerConfig(max_seq_len=64))
    gen = torch.Generator().manual_seed(0)
    n, steps = 14, 4
    width = (len(folder_fuse_layers(head)) + 1) * 64  # the fixture's head fuses a tapped layer (EAGLE-3)
    assert width > 64
    tokens = torch.randint(0, len(load_vocab(head)), (n,), generator=gen)
    true = torch.randn(n, width, generator=gen)  # any features will do: this checks the computation
    shifted = torch.cat((torch.zeros(1, width), true[:-1]))
    chains = unrolled(trained, tokens[None], shifted[None], steps)
    hf_hidden, hf_logits = trained(tokens[None], shifted[None], torch.ones(1, n, dtype=torch.long))
    assert torch.allclose(chains[0][1], hf_logits, atol=1e-4)  # step 0: the plain teacher-forced forward
    for start in (0, 3, n - steps):
        runner.add("x")
        hidden = runner.prefill("x", tokens[: start + 1].tolist(), shifted[: start + 1])[-1:]
        for s in range(steps):
            if s:
                logits, hidden = runner.forward_hidden(["x"], [[int(tokens[start + s])]], features=hidden[:, None])
            else:
                logits = runner.model.lm_head(hidden).float()
            assert torch.allclose(logits[0], chains[s][1][0, start + s], atol=1e-4), (start, s)
        runner.release("x")


def test_eagle_greedy_is_lossless_and_accepts(tiny_models, tiny_eagle):
    target = tiny_models["llama"]
    engine = engine_for(target, draft=tiny_eagle / "draft", k=3)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    plain = engine.generate(prompts, GenerationParams(max_tokens=40, method="none"))
    for out, ids in zip(plain, prompts, strict=True):
        assert out.token_ids == hf_greedy(target, ids, 40)  # independent oracle
    for k in (1, 3, 8):
        spec = engine.generate(prompts, GenerationParams(max_tokens=40, method="draft", num_speculative_tokens=k))
        assert [s.token_ids for s in spec] == [p.token_ids for p in plain], k
    # accepted drafts went through the engine too (75 of 1,482 measured; the rate that matters is the
    # real model's, test_real_model.py)
    assert engine.stats.num_accepted_tokens > 0


def test_incremental_proposals_equal_a_recomputation_from_scratch(tiny_models, tiny_eagle):
    """Outcomes are forced (random accepted counts, including all-accepted and undrafted rounds) so every
    path of the feature bookkeeping runs whatever the head's quality; the target supplies true features."""
    target_path, head = tiny_models["llama"], tiny_eagle / "draft"
    cfg = RunnerConfig(max_batch_size=4, max_seq_len=256)
    oracle = ModelRunner(target_path, cfg)
    taps = folder_fuse_layers(head)
    vocab_size = oracle.vocab_size

    def proposer() -> EagleProposer:
        return EagleProposer(ModelRunner(head, cfg), target_vocab=vocab_size, vocab_map=load_vocab(head))

    def features(tokens: list[int]) -> torch.Tensor:  # the target's features at every position
        oracle.add("x")
        f = oracle.prefill("x", tokens, taps=taps)
        oracle.release("x")
        return f

    incremental, scratch = proposer(), proposer()

    def from_scratch(history: list[int], k: int) -> list[int]:
        scratch.add_sequence("x", history, SamplingParams(), features(history[:-1]))
        tokens = scratch.propose(["x"], [k]).draft_tokens[0].tolist()
        scratch.remove_sequence("x")
        return tokens

    tok = oracle.load_tokenizer()
    seqs = {f"s{i}": tok.encode(p) for i, p in enumerate(PROMPTS[:3])}
    for s, ids in seqs.items():
        incremental.add_sequence(s, ids, SamplingParams(), features(ids[:-1]))
    rng = random.Random(0)
    for round_ in range(10):
        k = 1 + round_ % 4
        ids = list(seqs)
        wanted = [0 if round_ % 3 == 2 and i == 2 else k for i in range(len(ids))]  # s2 undrafted every third round
        block = incremental.propose(ids, wanted)
        output = torch.full((len(ids), k + 1), -1, dtype=torch.long)
        accepted = torch.zeros(len(ids), dtype=torch.long)
        feats = torch.zeros((len(ids), k + 1, (len(taps) + 1) * 64), dtype=torch.float16)
        for i, s in enumerate(ids):
            n_drafted = int(block.num_draft_tokens[i])
            drafts = block.draft_tokens[i, :n_drafted].tolist()
            if n_drafted:
                assert drafts == from_scratch(seqs[s], n_drafted), (round_, s)
            n = rng.choice([0, n_drafted, rng.randint(0, n_drafted)])  # rejected, all accepted, or some
            new = drafts[:n] + [rng.randrange(vocab_size)]
            start = len(seqs[s]) - 1  # the previous last token's position
            seqs[s] += new
            output[i, : n + 1], accepted[i] = torch.tensor(new), n
            feats[i, : n + 1] = features(seqs[s][:-1])[start:]
        incremental.observe(VerifyResult(tuple(ids), block.num_draft_tokens, accepted, output, feats))


def test_features_stay_on_the_target_until_a_head_takes_the_sequence_then_travel_in_verify_results(tiny_models):
    """Kept while no head holds the sequence (a plain stretch ships none), handed over whole and in order
    (the prompt's, then each round's kept positions: what a prefill of the context gives), then each round's."""
    runner = ModelRunner(tiny_models["llama"], RunnerConfig())
    verifier = TargetVerifier(runner, features=True)
    assert verifier.add_sequence("s", [5, 6, 7, 8], SamplingParams(), prefill=2) is None  # half the prompt
    first = verifier.continue_prefill("s")  # the rest: the first token, from the prompt's last logits
    kept = verifier.verify(ProposalBlock.make_dummy(["s"], [[9, 10]]))
    assert kept.features is None  # no head holds it yet
    taken = verifier.take_features(["s"])[0]
    context = [5, 6, 7, 8, first, *kept.new_tokens(0)]
    assert taken.shape == (len(context) - 1, 64) and taken.dtype == torch.float16
    oracle = ModelRunner(tiny_models["llama"], RunnerConfig())
    oracle.add("x")
    assert torch.allclose(taken.float(), oracle.prefill("x", context[:-1]).float(), atol=2e-3)
    result = verifier.verify(ProposalBlock.make_dummy(["s"], [[9, 10]]))
    wire = pickle.loads(pickle.dumps(result))
    assert wire.features is not None and torch.equal(wire.features, result.features)
    assert wire.new_features(0).shape == (int(result.num_accepted[0]) + 1, 64)
    verifier.add_sequence("t", [5, 6, 7], SamplingParams())  # kept: a round ships the taken row's alone
    both = verifier.verify(ProposalBlock.make_dummy(["t", "s"], [[], [9]]))
    assert both.features is not None and both.features.shape[0] == 1 and both.feature_rows == (1,)
    assert torch.equal(both.new_features(1), both.features[0, : int(both.num_accepted[1]) + 1])
    with pytest.raises(ValueError, match="no EAGLE head holds"):
        both.new_features(0)
    plain = TargetVerifier(ModelRunner(tiny_models["llama"], RunnerConfig()))
    plain.add_sequence("s", [5, 6], SamplingParams())
    with pytest.raises(ValueError, match="not started for an EAGLE draft"):
        plain.take_features(["s"])


def test_a_head_for_another_target_or_backend_is_refused(tmp_path, tiny_models, tiny_eagle):
    other = make_tiny_model(tmp_path / "wide", "llama", hidden_size=96)
    with pytest.raises(DraftMismatchError, match="EAGLE head: it reads features of size 64 but the target's "
                                                  "hidden_size is 96"):
        check_draft(other, tiny_eagle / "draft")
    shallow = make_tiny_model(tmp_path / "shallow", "llama", layers=1)
    with pytest.raises(DraftMismatchError, match=r"eagle_fuse_layers \[1\] taps the target after layer counts "
                                                  r"outside 1..0"):
        check_draft(shallow, tiny_eagle / "draft")
    config = EngineConfig(model=str(tiny_models["llama"]), backend="neuron",
                          speculation=SpeculationConfig(draft=str(tiny_eagle / "draft")))
    with pytest.raises(ValueError, match="speculation.draft: .* EAGLE head"):
        reads_features(config, tiny_eagle / "draft")


@torch.no_grad()
def test_target_taps_are_the_residual_streams_hf_reports(tmp_path):
    """What an EAGLE-3 head fuses: the target's stream after t layers is HF's ``hidden_states[t]``,
    RMS-normalised; the final state follows them, the logits come from it, and a pass cut at the deepest
    tap gives the same."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "deep", "llama", layers=4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = [5, 9, 11, 40, 7, 3]
    ref = hf(torch.tensor([ids]), output_hidden_states=True)
    runner = ModelRunner(path, RunnerConfig())
    runner.add("s")
    got = runner.prefill("s", ids[:4], taps=(1, 3))
    logits, tail = runner.forward_hidden(["s"], [ids[4:]], logits="all", taps=(1, 3))
    got = torch.cat((got, tail[0]))
    for j, t in enumerate((1, 3)):
        stream = ref.hidden_states[t][0]
        normed = stream / stream.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        assert torch.allclose(got[:, 64 * j: 64 * (j + 1)], normed, atol=1e-4), t
    assert torch.allclose(got[:, -64:], ref.hidden_states[-1][0], atol=1e-4)  # HF's last one is normed
    assert torch.allclose(logits[0], ref.logits[0, 4:], atol=1e-3)
    runner.add("cut")
    cut, _ = runner.hidden_states(["cut"], [ids], taps=(1, 3), depth=3)
    assert torch.allclose(cut[0], got[:, :128], atol=1e-5)


@torch.no_grad()
def test_a_head_given_taps_drafts_as_before_until_trained(tmp_path, tiny_models):
    """``add_taps`` starts ``reduce`` as a pass-through of the final state, so a trained head can be
    extended to fuse the target's layers and fine-tuned without losing what it knew; served too."""
    from serve_app.distill.eagle import init_eagle, save_eagle

    target = tiny_models["llama"]
    vocab = list(range(200))
    head = init_eagle(target, vocab).eval()
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.1)  # not a pass-through itself
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 200, (1, 9), generator=gen)
    final, tapped = torch.randn(1, 9, 64, generator=gen), torch.randn(1, 9, 64, generator=gen) * 30
    mask = torch.ones(1, 9, dtype=torch.long)
    save_eagle(head, vocab, target, tmp_path / "plain")  # rounds the head's layer to bf16, as served
    before = head(tokens, final, mask)[1]
    head.add_taps((1,))
    assert torch.allclose(head(tokens, torch.cat((tapped, final), -1), mask)[1], before, atol=1e-5)
    save_eagle(head, vocab, target, tmp_path / "tapped")
    assert folder_fuse_layers(tmp_path / "tapped") == (1,) and folder_fuse_layers(tmp_path / "plain") == ()
    served = []
    for name, feats in (("plain", final), ("tapped", torch.cat((tapped, final), -1))):
        runner = ModelRunner(tmp_path / name, RunnerConfig(dtype="float32"))
        runner.add("s")
        served.append(runner.forward(["s"], [tokens[0].tolist()], logits="all", features=feats))
    assert torch.allclose(served[0], served[1], atol=1e-3)
    with pytest.raises(ValueError, match=r"--taps \[\]: the head in --init .* fuses the target's layers \[1\]"):
        distill(DistillConfig(target=str(target), out=tmp_path / "run", arch="eagle", init=tmp_path / "tapped",
                              taps=(), max_steps=1, vocab_size=200, max_prompts=1, samples_per_prompt=1,
                              max_new_tokens=4, text_docs=1, text_tokens=16, batch_size=1, gen_batch=2))
