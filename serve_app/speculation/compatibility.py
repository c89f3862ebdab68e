"""Can this draft serve this target? Checked at startup and by ``python -m serve_app check-draft``.

Speculation exchanges token ids, so the draft must read and write the target's ids: the same
token -> id map over the target's vocabulary, the same special tokens, and a vocabulary size the
engine can reconcile (a larger draft embedding is masked; a reduced-vocabulary draft maps its ids
through ``draft_vocab.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from serve_app.models.eagle import FEATURE_KEY, FUSE_KEY, fuse_layers

VOCAB_FILE = "draft_vocab.json"
SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


class DraftMismatchError(ValueError):
    """The draft cannot serve the target; the message names what differs."""


def load_vocab(path: Path) -> list[int] | None:
    """A reduced-vocabulary draft's target ids (draft id i <-> target id ids[i]), else None."""
    f = Path(path) / VOCAB_FILE
    return json.loads(f.read_text())["target_ids"] if f.is_file() else None


def check_draft(target_path: Path, draft_path: Path) -> list[str]:
    """Raise ``DraftMismatchError`` listing every difference; return notes on what was reconciled."""
    target_tok = AutoTokenizer.from_pretrained(target_path)
    draft_tok = AutoTokenizer.from_pretrained(draft_path)
    problems, notes = [], []

    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    differing = [t for t, i in target_vocab.items() if draft_vocab.get(t) != i]
    if differing:
        examples = ", ".join(f"{t!r}: target {target_vocab[t]} vs draft {draft_vocab.get(t)}" for t in differing[:3])
        problems.append(f"tokenizer: {len(differing)} of {len(target_vocab)} target tokens have another id "
                        f"in the draft ({examples})")
    for name in SPECIAL:
        t, d = getattr(target_tok, name), getattr(draft_tok, name)
        if t != d:
            problems.append(f"special token {name}: target {t!r} vs draft {d!r}")

    target_cfg, draft_cfg = AutoConfig.from_pretrained(target_path), AutoConfig.from_pretrained(draft_path)
    vocab_map = load_vocab(draft_path)
    if vocab_map is not None:
        if max(vocab_map) >= target_cfg.vocab_size or len(set(vocab_map)) != len(vocab_map):
            problems.append(f"{VOCAB_FILE}: ids must be distinct and below the target's vocab_size "
                            f"{target_cfg.vocab_size}")
        if draft_cfg.vocab_size != len(vocab_map) + 1:
            problems.append(f"{VOCAB_FILE} lists {len(vocab_map)} ids but the draft's vocab_size is "
                            f"{draft_cfg.vocab_size} (expected {len(vocab_map) + 1})")
        notes.append(f"reduced vocabulary: the draft proposes {len(vocab_map)} of {target_cfg.vocab_size} tokens")
    elif draft_cfg.vocab_size < len(target_tok):
        problems.append(f"vocab_size: the draft embeds {draft_cfg.vocab_size} ids but the target's tokenizer "
                        f"has {len(target_tok)}")
    elif draft_cfg.vocab_size != target_cfg.vocab_size:
        notes.append(f"vocab_size {draft_cfg.vocab_size} vs {target_cfg.vocab_size}: draft rows past the "
                     "target's vocabulary are never proposed")
    feature_size = getattr(draft_cfg, FEATURE_KEY, None)
    if feature_size is not None:
        taps = fuse_layers(draft_cfg)
        if feature_size != target_cfg.hidden_size:
            problems.append(f"EAGLE head: it reads features of size {feature_size} but the target's hidden_size "
                            f"is {target_cfg.hidden_size} (it was trained for another target)")
        else:
            tapped = f" (its residual streams after {', '.join(map(str, taps))} layers, then its final state)" \
                if taps else ""
            notes.append(f"EAGLE head: the target ships its hidden states{tapped} with every verify result")
        layers = target_cfg.num_hidden_layers
        if any(not 0 < n < layers for n in taps):
            problems.append(f"EAGLE head: {FUSE_KEY} {list(taps)} taps the target after layer counts outside "
                            f"1..{layers - 1} (it was trained for a deeper target)")
    if problems:
        raise DraftMismatchError(f"draft {draft_path} cannot serve target {target_path}:\n  - "
                                 + "\n  - ".join(problems))
    return notes
