"""A draft model as proposer: k autoregressive steps of a small model from the same family.

Greedy rows take the draft's argmax. Sampled rows draw from q' = the draft's distribution (the
request's temperature/top-k/top-p), truncated to its ``width`` most likely tokens and renormalised;
q' travels sparsely in the block. Speculative sampling is exact for the q a token was really drawn
from, so truncation changes acceptance, never the output distribution.

KV bookkeeping (DESIGN.md): the draft's cache holds every token of the sequence but the last. After
proposing d_1..d_k it holds d_1..d_{k-1} too. When the target keeps n drafts, the valid prefix is
min(cached, len(history) - 1); the rest is rolled back by a length change. If all k were accepted,
the draft never saw d_k: the next ``propose`` feeds it together with the target's bonus token.

Dynamic block length (``stop_below``): a row stops drafting after a token the draft itself gave less
than this probability (for a greedy row its softmax maximum, for a sampled row q'(token)), since the
target is unlikely to keep what follows; that token is still proposed, as a verify slot costs far less
than a draft step. The decision reads only the draft's own numbers, never the target's, so the stop
is a stopping time of the draft's process and speculative sampling stays exact (SpecDec++, Huang et
al. 2024, arXiv 2405.19715, makes the same decision with a trained acceptance predictor).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from serve_app.models.base import Runner
from serve_app.speculation.proposers.base import Drafted, Proposer, TokenHistory
from serve_app.speculation.sampling import probabilities, sample_rows, truncate_top
from serve_app.speculation.types import PAD_TOKEN, ProposalBlock, SamplingParams, VerifyResult

DRAFT_SEED_OFFSET = 0x5EED  # the draft's generator must not replay the target's random stream


class DraftModelProposer(Proposer):
    can_propose_ahead = True  # overlapped rounds: see propose_ahead
    can_add_later = True
    reads_late = True
    def __init__(self, runner: Runner, width: int = 32, target_vocab: int | None = None,
                 vocab_map: list[int] | None = None, stop_below: float = 0.0):
        """``width``: support size K of the shipped q'. ``target_vocab``: the target's vocabulary size;
        draft rows past it (padding of a larger embedding) are never proposed. ``vocab_map``: for a
        reduced-vocabulary draft (``serve_app.distill``), the target id of each draft id; one extra
        draft row stands for every other target token on input and is never proposed. ``stop_below``:
        the dynamic block length above (0 = always draft the k asked for)."""
        self.runner = runner
        self.width = width
        self.stop_below = stop_below
        self.history = TokenHistory()
        self.generators: dict[str, torch.Generator] = {}
        self.last_block: dict[str, list[int]] = {}  # each sequence's block in verification (overlap)
        self.ahead: dict[str, tuple[int, int]] = {}  # sequences drafted ahead: (block length, guess)
        self.proposable = target_vocab  # draft logits past this column are masked
        self.to_target: torch.Tensor | None = None  # [N] draft id -> target id
        self.to_draft: torch.Tensor | None = None  # [target_vocab] target id -> draft id
        if vocab_map is not None:
            if target_vocab is None:
                raise ValueError("a reduced-vocabulary draft needs the target's vocabulary size")
            self.to_target = torch.tensor(vocab_map, dtype=torch.long)
            self.to_draft = torch.full((target_vocab,), len(vocab_map), dtype=torch.long)
            self.to_draft[self.to_target] = torch.arange(len(vocab_map))
            self.proposable = len(vocab_map)

    def add_sequence(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                     features: torch.Tensor | None = None) -> None:
        self._track(seq_id, prompt_ids, params)
        if len(prompt_ids) > 1:
            self.runner.prefill(seq_id, self._to_draft(prompt_ids[:-1]))

    def _track(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self.history.add(seq_id, prompt_ids, params)
        self.runner.add(seq_id)
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        self.generators[seq_id] = torch.Generator().manual_seed(seed + DRAFT_SEED_OFFSET)

    def remove_sequence(self, seq_id: str) -> None:
        if seq_id in self.generators:
            self.runner.release(seq_id)
            del self.generators[seq_id]
        self.history.remove(seq_id)
        self.last_block.pop(seq_id, None)
        self.ahead.pop(seq_id, None)

    def propose(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> ProposalBlock:
        k = max(num_tokens, default=0)
        batch = len(seq_ids)
        params = [self.history.params[s] for s in seq_ids]
        greedy = all(p.greedy for p in params)
        tokens = torch.full((batch, k), PAD_TOKEN, dtype=torch.long)
        q_ids = None if greedy else torch.full((batch, k, self.width), PAD_TOKEN, dtype=torch.long)
        q_probs = None if greedy else torch.zeros((batch, k, self.width), dtype=torch.float32)

        drafted = [0] * batch
        rows = [i for i in range(batch) if num_tokens[i] > 0]
        feed = [self._to_draft(self.history.tokens[seq_ids[i]][self.runner.length(seq_ids[i]):]) for i in rows]
        carry = self._catch_up([seq_ids[i] for i in rows], feed) if rows else None
        for step in range(k):
            if not rows:
                break
            logits, carry = self._step([seq_ids[i] for i in rows], feed, carry)  # [rows, vocab]
            if self.proposable is not None:
                logits = logits[:, : self.proposable]  # never propose padding or input-only rows
            chosen = self._choose(logits, [seq_ids[i] for i in rows], [params[i] for i in rows])
            for r, i in enumerate(rows):
                token, ids, probs = chosen[r][:3]
                tokens[i, step], drafted[i] = token, step + 1
                if ids is not None and probs is not None and q_ids is not None and q_probs is not None:
                    q_ids[i, step], q_probs[i, step] = ids, probs
            # Rows that still need tokens, and trust the one they just drew, feed it (the last is never fed).
            keep = [r for r, i in enumerate(rows) if step + 1 < num_tokens[i] and chosen[r][3] >= self.stop_below]
            feed = [self._to_draft([int(tokens[rows[r], step])]) for r in keep]
            carry = None if carry is None else carry[keep]
            rows = [rows[r] for r in keep]
        for i, s in enumerate(seq_ids):
            self.last_block[s] = tokens[i, : drafted[i]].tolist()
        return ProposalBlock(tuple(seq_ids), tokens, torch.tensor(drafted, dtype=torch.long), q_ids, q_probs)

    def propose_ahead(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> Callable[[], Drafted]:
        """Drafts ahead now, in this process (see ``_draft_ahead``); the function returns the result."""
        drafted = self._draft_ahead(seq_ids, num_tokens)
        return lambda: drafted

    def _draft_ahead(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> Drafted:
        """Overlapped rounds (PEARL, arXiv 2408.11850, post-verify): while the target verifies the block
        each sequence was just given, draft its next block from the optimistic continuation: that block
        all accepted, then the draft's own guess of the target's next token (its argmax). Returns the
        guesses and the next blocks (``PAD_TOKEN`` guess for rows with nothing to continue). ``observe``
        keeps a row's work when the target kept its whole block and its own token was the guess (a hit),
        and rolls it back otherwise, like any rejected draft."""
        rows = [i for i, s in enumerate(seq_ids) if num_tokens[i] > 0 and self.last_block.get(s)]
        guesses = [PAD_TOKEN] * len(seq_ids)
        if not rows:
            return guesses, ProposalBlock.make_dummy(seq_ids, [[] for _ in seq_ids])
        ids = [seq_ids[i] for i in rows]
        decided = {s: len(self.history.tokens[s]) for s in ids}
        for s in ids:  # optimistic: the block accepted
            self.history.tokens[s].extend(self.last_block[s])
        try:
            feed = [self._to_draft(self.history.tokens[s][self.runner.length(s):]) for s in ids]
            logits, _ = self._step(ids, feed, self._catch_up(ids, feed))
            if self.proposable is not None:
                logits = logits[:, : self.proposable]
            guess = logits.argmax(dim=-1).cpu()
            if self.to_target is not None:
                guess = self.to_target[guess]
            for r, (i, s) in enumerate(zip(rows, ids, strict=True)):
                guesses[i] = int(guess[r])
                self.history.tokens[s].append(guesses[i])
                self.ahead[s] = (len(self.last_block[s]), guesses[i])
            block = self.propose(seq_ids, [k if guesses[i] != PAD_TOKEN else 0 for i, k in enumerate(num_tokens)])
        finally:
            for s in ids:  # the history holds only what the target decided; the cache keeps the work
                del self.history.tokens[s][decided[s]:]
        return guesses, block

    def _catch_up(self, seq_ids: Sequence[str], feed: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """What the first step feeds besides tokens (an EAGLE head's features); None for a decoder."""
        return None

    def _step(self, seq_ids: Sequence[str], feed: Sequence[Sequence[int]], carry: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft forward: (logits after each row's last fed token, what the next step feeds along)."""
        return self.runner.forward(seq_ids, feed), None

    def _to_draft(self, tokens: Sequence[int]) -> list[int]:
        return list(tokens) if self.to_draft is None else self.to_draft[list(tokens)].tolist()

    def _choose(
        self, logits: torch.Tensor, seq_ids: Sequence[str], params: Sequence[SamplingParams]
    ) -> list[tuple[int, torch.Tensor | None, torch.Tensor | None, float]]:
        """Per row: (token, q' support ids, q' probs, the draft's probability of the token); the q'
        entries are None for greedy rows, and the probability is 1 unless ``stop_below`` is set."""
        to_target = self.to_target
        argmax = logits.argmax(dim=-1).cpu()  # only ids (and, to stop early, the top probability) leave the device
        top = (logits.amax(dim=-1) - torch.logsumexp(logits.float(), dim=-1)).exp().cpu().tolist() \
            if self.stop_below else [1.0] * len(logits)  # the softmax maximum, without the softmax
        if to_target is not None:
            argmax = to_target[argmax]
        out: list[tuple[int, torch.Tensor | None, torch.Tensor | None, float]] = [
            (int(t), None, None, p) for t, p in zip(argmax, top, strict=True)]
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        if sampled:
            probs = probabilities(logits[sampled].cpu()[:, None], [params[r] for r in sampled])[:, 0]
            ids, q = truncate_top(probs, self.width)  # [rows, width], draft ids
            if to_target is not None:
                ids = torch.where(ids >= 0, to_target[ids.clamp(min=0)], ids)
            picks = sample_rows(q, [self.generators[seq_ids[r]] for r in sampled]).tolist()
            for j, (r, pick) in enumerate(zip(sampled, picks, strict=True)):
                out[r] = (int(ids[j, pick]), ids[j], q[j], float(q[j, pick]))
        return out

    def observe(self, result: VerifyResult) -> None:
        rows = {s: i for i, s in enumerate(result.seq_ids)}
        for seq_id in self.history.extend(result):
            ahead = self.ahead.pop(seq_id, None)
            if ahead is not None and result.kept_block_then(rows[seq_id], *ahead):
                continue  # the cache holds the sequence and the next block drafted ahead, as after a proposal
            self.last_block.pop(seq_id, None)
            valid = len(self.history.tokens[seq_id]) - 1
            if self.runner.length(seq_id) > valid:
                self.runner.truncate(seq_id, valid)

