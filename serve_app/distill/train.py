"""``python -m serve_app distill``: train a draft for a target by distillation, without downloads.

Phases, each saved in ``--out`` so an interrupted run resumes where it stopped:
1. data.pt: on-policy chat responses of the target (greedy, plus sampled variants) generated with
   the engine's own batched decoding, for prompts composed in ``prompts.py``; held-out prompts
   (topics and instructions never trained on) for evaluation; stdlib docstrings as plain text.
2. teacher.pt: the target teacher-forced over every sequence in batches; per position the top-K of
   its distribution, mapped into the draft's reduced vocabulary (chosen from token frequencies).
3. features.pt (``--arch eagle`` only): the target's final-norm hidden state at every position, and
   features_after_A_B.pt: its residual streams after A and B layers, which the head fuses with it
   (``--taps``, EAGLE-3; from a pass that stops after the deeper one).
4. checkpoint.pt + draft/: the draft trained on soft cross-entropy to those distributions: a small
   decoder (``draft_model.py``, ``--arch decoder``) or an EAGLE head reading the target's features
   (``eagle.py``, ``--arch eagle``, plus a smooth-L1 loss on the predicted feature, with its
   ``--unroll`` drafting steps trained as they run); progress shows tokens, loss, agreement on
   held-out and on as many training responses, mean acceptance length and time left.

Held-out agreement a = P(draft argmax == target's greedy token) at the first drafting step. For an
EAGLE head the mean acceptance length at k = 4 is measured by unrolling its four drafting steps from
every held-out position and walking them as greedy decoding would (``decoding_walk``); for a decoder
it is estimated as 1 + a + a^2 + a^3 + a^4 (Leviathan et al. 2023, with a constant a). The saved draft
is the checkpoint with the highest. Agreement on as many training responses is shown next to the
held-out one: a wide gap means the draft is short of data, not of steps (``data_note``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from serve_app.config import EngineConfig, SpeculationConfig
from serve_app.distill.batches import eagle_steps, padded_inputs
from serve_app.distill.draft_model import coverage, init_draft, save_draft, select_vocab
from serve_app.distill.eagle import init_eagle, load_eagle, save_eagle
from serve_app.distill.evaluate import acceptance, data_note
from serve_app.distill.features import head_taps, target_features, with_taps
from serve_app.distill.prompts import chat_prompts, stdlib_text, usable_prompts, user_turn_prefix
from serve_app.engine.plan import model_folder
from serve_app.engine.request import GenerationParams
from serve_app.models.base import RunnerConfig
from serve_app.models.eagle import fuse_layers
from serve_app.models.runner import ModelRunner
from serve_app.speculation.compatibility import load_vocab
from serve_app.speculation.types import SamplingParams

log = logging.getLogger(__name__)
# EAGLE: the loss weight of drafting step s is STEP_DECAY ** s (a later step matters only if earlier ones hit)
STEP_DECAY = 0.8


@dataclass
class DistillConfig:
    target: str
    out: Path
    minutes: float = 60.0  # training time
    max_steps: int | None = None  # set: stop after this many steps and schedule by steps (reproducible runs)
    arch: str = "eagle"  # "eagle": a head on the target's features; "decoder": a small standalone decoder
    vocab_size: int = 8192
    max_prompts: int | None = None
    samples_per_prompt: int = 2  # one greedy response + sampled ones
    synth_prompts: int = 0  # candidate prompts the target writes itself (Magpie)
    max_new_tokens: int = 160
    text_docs: int = 600
    text_tokens: int = 192
    top_k: int = 32  # teacher support kept per position
    batch_size: int = 16
    lr: float = 1e-3
    gen_batch: int = 32
    eval_every: int = 200
    feature_noise: float = 0.2  # EAGLE: uniform noise of this width on input features
    feature_loss: float = 1.0  # EAGLE: weight of the smooth-L1 feature loss (cross-entropy has 1)
    unroll: int = 4  # EAGLE: drafting steps trained, each reading the previous one's prediction (1: true features only)
    taps: tuple[int, ...] | None = None  # EAGLE: target layer counts fused with its final state (None: default_taps)
    init: Path | None = None  # start from this trained draft folder (same target, same vocabulary)
    seed: int = 0


def say(msg: str) -> None:
    print(msg, flush=True)


# ---- phase 1: data ------------------------------------------------------------------------------
def run_jobs(engine, jobs: list[tuple[list[int], GenerationParams]], label: str) -> list[list[int]]:
    """Generate every job at once (continuous batching refills each freed slot); outputs in job order."""
    ids = {engine.add_request(prompt, params): i for i, (prompt, params) in enumerate(jobs)}
    outputs: list[list[int]] = [[] for _ in jobs]
    start, done, tokens = time.perf_counter(), 0, 0
    while engine.has_work:
        for out in engine.step():
            if not out.finished:
                continue
            outputs[ids[out.request_id]] = out.token_ids
            done += 1
            tokens += len(out.token_ids)
            if done % 200 == 0 or done == len(jobs):
                rate = tokens / (time.perf_counter() - start)
                left = (len(jobs) - done) * tokens / done / rate
                say(f"[data] {label}: {done}/{len(jobs)}, {tokens} tokens, {rate:.0f} tok/s, ~{left / 60:.1f} min left")
    return outputs


def synthesize_prompts(engine, n: int, seed: int, exclude: list[str]) -> list[str]:
    """n candidate user prompts written by the target itself from the user-turn prefix (Magpie)."""
    tok = engine.tokenizer
    prefix = tok.encode(user_turn_prefix(tok), add_special_tokens=False)
    jobs = [(prefix, GenerationParams(max_tokens=48, sampling=SamplingParams(temperature=1.0, seed=seed + i)))
            for i in range(n)]
    texts = [tok.decode(out, skip_special_tokens=True) for out in run_jobs(engine, jobs, "synthetic prompts")]
    kept = usable_prompts(texts, exclude)
    say(f"[data] synthetic prompts: kept {len(kept)} of {n} (distinct, >= 4 words, not near a held-out prompt)")
    return kept


def generate(cfg: DistillConfig, target_path: Path) -> dict:
    from serve_app.engine.factory import build_engine

    engine = build_engine(EngineConfig(model=str(target_path), dtype="bfloat16", max_batch_size=cfg.gen_batch,
                                       max_seq_len=512, speculation=SpeculationConfig(draft="none")))
    tok = engine.tokenizer

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)

    heldout = chat_prompts("heldout")
    train = chat_prompts("train", cfg.seed)[: cfg.max_prompts]
    if cfg.synth_prompts:
        train += synthesize_prompts(engine, cfg.synth_prompts, cfg.seed, exclude=heldout)
    data: dict = {"train": [], "heldout": [], "text": []}
    for split, texts in (("train", train), ("heldout", heldout)):
        samples = 1 if split == "heldout" else cfg.samples_per_prompt
        jobs = [(chat(t), GenerationParams(max_tokens=cfg.max_new_tokens, sampling=SamplingParams() if s == 0
                                           else SamplingParams(temperature=0.8, seed=cfg.seed + i)))
                for i, t in enumerate(texts) for s in range(samples)]
        outputs = run_jobs(engine, jobs, f"{split} responses")
        data[split] = [(prompt, out, params.sampling.greedy)
                       for (prompt, params), out in zip(jobs, outputs, strict=True)]
    for doc in stdlib_text(cfg.text_docs):
        ids = tok.encode(doc)[: cfg.text_tokens]
        if len(ids) > 16:
            data["text"].append(ids)
    say(f"[data] text: {len(data['text'])} docstrings")
    return data


# ---- phase 2: teacher -----------------------------------------------------------------------------
def sequences(data: dict, split: str) -> list[tuple[list[int], int]]:
    """(token ids, first position whose next-token distribution is trained on)."""
    out = [(prompt + resp, len(prompt) - 1) for prompt, resp, _ in data[split] if resp]
    if split == "train":
        out += [(ids, 0) for ids in data["text"]]
    return out


@torch.inference_mode()
def teacher(cfg: DistillConfig, target_path: Path, data: dict, vocab: list[int]) -> dict:
    runner = ModelRunner(target_path, RunnerConfig(dtype="bfloat16", max_batch_size=4, max_seq_len=1024))
    to_draft = torch.full((runner.vocab_size,), -1, dtype=torch.long)
    to_draft[torch.tensor(vocab)] = torch.arange(len(vocab))
    result = {}
    for split in ("train", "heldout"):
        seqs = sequences(data, split)
        items, start, tokens = [], time.perf_counter(), 0
        for lo in range(0, len(seqs), 4):
            batch = seqs[lo: lo + 4]
            ids = [f"t{lo + i}" for i in range(len(batch))]
            for s in ids:
                runner.add(s)
            logits = runner.forward(ids, [seq[:-1] for seq, _ in batch], logits="all")  # [b, T, V]
            for s in ids:
                runner.release(s)
            for i, (seq, first) in enumerate(batch):
                rows = logits[i, first: len(seq) - 1]  # predicts seq[first + 1:]
                probs = torch.softmax(rows, dim=-1)
                top_p, top_i = probs.topk(cfg.top_k, dim=-1)
                mapped = to_draft[top_i]
                top_p = torch.where(mapped >= 0, top_p, 0.0)  # mass outside the draft vocab is unreachable
                items.append({"ids": torch.tensor(seq), "first": first, "q_ids": mapped.clamp(min=0).int(),
                              "q_probs": (top_p / top_p.sum(-1, keepdim=True).clamp(min=1e-9)).half(),
                              "greedy": rows.argmax(-1)})
                tokens += len(seq) - 1 - first
            if (lo // 4) % 50 == 0:
                say(f"[teacher] {split}: {lo + len(batch)}/{len(seqs)} sequences, "
                    f"{tokens / (time.perf_counter() - start):.0f} tok/s")
        result[split] = items
    return result


# ---- phase 3: train -------------------------------------------------------------------------------
def soft_ce(logits: torch.Tensor, items, skip: int = 0) -> torch.Tensor:
    """Cross-entropy to the teacher's top-K at each item's trained positions, after the first ``skip``."""
    logp = F.log_softmax(logits.float(), dim=-1)
    losses = []
    for i, it in enumerate(items):
        rows = logp[i, it["first"] + skip: len(it["ids"]) - 1]  # [positions, N]
        losses.append(-(rows.gather(-1, it["q_ids"][skip:].long()) * it["q_probs"][skip:].float()).sum(-1))
    return torch.cat(losses).mean()


def batch_loss(draft, items, feats, to_draft: torch.Tensor, n_vocab: int, cfg: DistillConfig) -> torch.Tensor:
    if feats is None:
        inputs, mask = padded_inputs(items, to_draft, n_vocab)
        return soft_ce(draft(input_ids=inputs, attention_mask=mask).logits[..., :n_vocab], items)
    chains, f_target, mask = eagle_steps(draft, items, feats, to_draft, n_vocab, cfg.unroll, cfg.feature_noise)
    total, weights = 0.0, 0.0
    for s, (hidden, logits) in enumerate(chains):  # step s at p: the (s+1)-th token of a draft begun at p - s
        per_position = F.smooth_l1_loss(hidden.float(), f_target, reduction="none").mean(-1)[:, s:]
        feature_loss = (per_position * mask[:, s:]).sum() / mask[:, s:].sum()
        total = total + STEP_DECAY ** s * (soft_ce(logits[..., :n_vocab], items, s) + cfg.feature_loss * feature_loss)
        weights += STEP_DECAY ** s
    return total / weights


def train(cfg: DistillConfig, target_path: Path, teach: dict, vocab: list[int], feats: dict | None = None,
          taps: tuple[int, ...] = ()) -> None:
    torch.manual_seed(cfg.seed)
    ckpt = cfg.out / "checkpoint.pt"
    eagle = cfg.arch == "eagle"
    save = save_eagle if eagle else save_draft
    if cfg.init is not None:  # warm start from a trained draft of the same kind and vocabulary
        if load_vocab(cfg.init) != vocab:
            raise ValueError(f"--init {cfg.init}: its vocabulary differs from this run's (other data or --vocab-size)")
        draft = load_eagle(cfg.init) if eagle else LlamaForCausalLM.from_pretrained(cfg.init, dtype=torch.float32)
        say(f"[train] starting from {cfg.init}")
        if eagle and taps and not fuse_layers(draft.lm.config):  # head_taps allowed only this change
            draft.add_taps(taps)
            say(f"[train] the head now fuses the target's streams after {list(taps)} layers with its final state")
    else:
        draft = init_eagle(target_path, vocab, taps) if eagle else init_draft(target_path, vocab)
    n_vocab = len(vocab)
    from transformers import AutoConfig

    to_draft = torch.full((AutoConfig.from_pretrained(target_path).vocab_size,), n_vocab, dtype=torch.long)
    to_draft[torch.tensor(vocab)] = torch.arange(n_vocab)
    to_target = torch.tensor(vocab)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.01)
    state = {"step": 0, "tokens": 0, "seconds": 0.0, "best": 0.0}
    if ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(saved["draft"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        say(f"[train] resumed at step {state['step']} ({state['seconds'] / 60:.1f} min trained)")
    budget = cfg.minutes * 60
    train_items = list(range(len(teach["train"])))
    # as many training responses as held-out ones, to show how much better the draft fits what it saw
    chat = [i for i in train_items if teach["train"][i]["first"] > 0]
    fit_items = random.Random(cfg.seed).sample(chat, min(len(chat), len(teach["heldout"])))
    rng = random.Random(cfg.seed + state["step"])
    start = time.perf_counter() - state["seconds"]
    draft.train()

    def done() -> bool:
        return time.perf_counter() - start >= budget or (cfg.max_steps is not None and state["step"] >= cfg.max_steps)

    while not done():
        picked = rng.sample(train_items, min(cfg.batch_size, len(train_items)))
        items = [teach["train"][i] for i in picked]
        batch_feats = None if feats is None else [feats["train"][i] for i in picked]
        frac = state["step"] / cfg.max_steps if cfg.max_steps else (time.perf_counter() - start) / budget
        for group in opt.param_groups:  # warm-up then cosine decay over the budget
            group["lr"] = cfg.lr * min(1.0, (state["step"] + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(frac, 1)))
        loss = batch_loss(draft, items, batch_feats, to_draft, n_vocab, cfg)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        state["tokens"] += sum(len(it["ids"]) - 1 - it["first"] for it in items)
        if state["step"] % cfg.eval_every == 0 or done():
            draft.eval()
            agree, score = acceptance(draft, teach["heldout"], None if feats is None else feats["heldout"],
                                      to_draft, to_target, n_vocab)
            fit, _ = acceptance(draft, [teach["train"][i] for i in fit_items],  # agreement only: one step
                                None if feats is None else [feats["train"][i] for i in fit_items],
                                to_draft, to_target, n_vocab, k=1)
            draft.train()
            state["seconds"] = time.perf_counter() - start
            left = max(budget - state["seconds"], 0)
            kind = "estimated" if feats is None else "drafting unrolled"
            say(f"[train] step {state['step']}, {state['tokens']} tokens, loss {loss.item():.3f}, held-out "
                f"agreement {agree:.3f} (training {fit:.3f}), mean acceptance length at k=4 {score:.2f} ({kind}), "
                f"{left / 60:.1f} min left")
            with open(cfg.out / "log.jsonl", "a") as f:
                f.write(json.dumps({**state, "loss": loss.item(), "heldout_agreement": agree, "train_agreement": fit,
                                    "tokens_per_pass_k4": score}) + "\n")
            if done() and (note := data_note(fit, agree)):
                say(f"[train] {note}")
            if score >= state["best"]:
                state["best"] = score
                save(draft, vocab, target_path, cfg.out / "draft")
            torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)


def cached(path: Path, label: str, compute):
    """A phase's result: loaded from ``path`` when an earlier run saved it, else computed and saved."""
    if path.is_file():
        say(f"[{label}] reusing {path}")
        return torch.load(path, weights_only=False)
    result = compute()
    torch.save(result, path)
    return result


def distill(cfg: DistillConfig) -> Path:
    cfg.out.mkdir(parents=True, exist_ok=True)
    target_path = model_folder(cfg.target)
    # a mistake in --taps fails before any phase runs
    taps = head_taps(cfg.taps, cfg.init, target_path) if cfg.arch == "eagle" else ()
    data = cached(cfg.out / "data.pt", "data", lambda: generate(cfg, target_path))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_path)
    responses = [resp for _, resp, _ in data["train"]]
    vocab = select_vocab(responses + data["text"], tok.all_special_ids, cfg.vocab_size)
    held = [resp for _, resp, _ in data["heldout"]]
    say(f"[vocab] {len(vocab)} tokens cover {coverage(responses, vocab):.1%} of training responses, "
        f"{coverage(held, vocab):.1%} of held-out responses")
    teach = cached(cfg.out / "teacher.pt", "teacher", lambda: teacher(cfg, target_path, data, vocab))
    feats = None
    if cfg.arch == "eagle":
        feats = cached(cfg.out / "features.pt", "features", lambda: target_features(target_path, teach))
        if taps:
            name = "features_after_" + "_".join(map(str, taps)) + ".pt"
            feats = with_taps(cached(cfg.out / name, "features", lambda: target_features(target_path, teach, taps)),
                              feats)
    train(cfg, target_path, teach, vocab, feats, taps)
    say(f"[done] draft written to {cfg.out / 'draft'}")
    return cfg.out / "draft"
