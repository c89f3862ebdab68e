"""Which proposer drafts: the registry keyed by ``SpeculationMethod`` (STYLE: a registry, not a god
class). Used where proposers are built: the engine's assembly and the draft worker."""

from __future__ import annotations

from pathlib import Path

from serve_app.config import SpeculationConfig, SpeculationMethod
from serve_app.models.base import FeatureRunner, Runner
from serve_app.models.eagle import is_eagle_folder
from serve_app.speculation.compatibility import load_vocab
from serve_app.speculation.proposers.base import NoProposer, Proposer
from serve_app.speculation.proposers.draft_model import DraftModelProposer
from serve_app.speculation.proposers.eagle import EagleProposer
from serve_app.speculation.proposers.hybrid import HybridProposer
from serve_app.speculation.proposers.ngram import NgramProposer


def draft_proposer(runner: Runner, path: Path, width: int, target_vocab: int, stop_below: float = 0.0
                   ) -> DraftModelProposer:
    """The proposer for a draft model folder: an EAGLE head or a standalone decoder."""
    vocab_map = load_vocab(path)
    if not is_eagle_folder(path):
        return DraftModelProposer(runner, width, target_vocab=target_vocab, vocab_map=vocab_map, stop_below=stop_below)
    if not isinstance(runner, FeatureRunner):
        raise ValueError(f"{path} is an EAGLE head, which runs on the torch runner (it reads and returns features)")
    return EagleProposer(runner, width, target_vocab=target_vocab, vocab_map=vocab_map, stop_below=stop_below)


def proposers_for(spec: SpeculationConfig, draft: Proposer | None = None) -> dict[SpeculationMethod, Proposer]:
    """The proposer registry of an engine: plain decoding and n-gram lookup always (a request may ask
    for either), and the draft (in this process or on its actor), behind n-gram lookup with
    ``ngram_first``."""
    proposers: dict[SpeculationMethod, Proposer] = {
        "none": NoProposer(),
        "ngram": NgramProposer(spec.ngram_min, spec.ngram_max),
    }
    if draft is not None:
        proposers["draft"] = draft
        if spec.ngram_first:
            proposers["draft"] = HybridProposer(NgramProposer(spec.ngram_min, spec.ngram_max), draft, spec.ngram_match)
    return proposers
