"""Phase 3 of ``distill`` for an EAGLE head: the target's features at every position of the data.

features.pt holds its final-norm hidden states; with taps (EAGLE-3, which fuses low and middle layers
with them) features_after_A_B.pt holds its residual streams after A and B layers, from a pass that
stops after the deeper one, so a head can be extended without recomputing the final states.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoConfig

from serve_app.models.base import RunnerConfig
from serve_app.models.eagle import folder_fuse_layers
from serve_app.models.runner import ModelRunner


def default_taps(layers: int) -> tuple[int, ...]:
    """A low and a middle layer, as EAGLE-3 taps them (after 2 and L / 2 of the target's L layers)."""
    return tuple(sorted({min(2, layers - 1), layers // 2} - {0}))


def head_taps(requested: tuple[int, ...] | None, init: Path | None, target_path: Path) -> tuple[int, ...]:
    """The layers the head fuses: ``--taps``, else the ``--init`` head's, else ``default_taps``."""
    layers = AutoConfig.from_pretrained(target_path).num_hidden_layers
    init_taps = folder_fuse_layers(init) if init is not None else ()
    taps = tuple(requested) if requested is not None else init_taps if init is not None else default_taps(layers)
    if init_taps and taps != init_taps:
        raise ValueError(f"--taps {list(taps)}: the head in --init {init} fuses the target's layers {list(init_taps)}; "
                         "train it with those or start a new head")
    if any(not 0 < n < layers for n in taps):
        raise ValueError(f"--taps {list(taps)}: the target has {layers} layers; tap after 1..{layers - 1} of them")
    return taps


@torch.inference_mode()
def target_features(target_path: Path, teach: dict, taps: tuple[int, ...] = ()) -> dict:
    """Per item, the target's final-norm hidden states over ``ids[:-1]`` (bf16, as it serves); with
    ``taps``, its residual streams after those layer counts instead (the pass stops at the deepest)."""
    runner = ModelRunner(target_path, RunnerConfig(dtype="bfloat16", max_batch_size=8, max_seq_len=1024))
    result = {}
    for split in ("train", "heldout"):
        items, feats, start, tokens = teach[split], [], time.perf_counter(), 0
        for lo in range(0, len(items), 8):
            batch = items[lo: lo + 8]
            ids = [f"f{lo + i}" for i in range(len(batch))]
            for s in ids:
                runner.add(s)
            hidden, lengths = runner.hidden_states(ids, [it["ids"][:-1].tolist() for it in batch], taps=taps,
                                             depth=max(taps) if taps else None)
            for s in ids:
                runner.release(s)
            feats += [hidden[i, :n].clone() for i, n in enumerate(lengths)]
            tokens += sum(lengths)
            if (lo // 8) % 100 == 0:
                print(f"[features] {split}: {lo + len(batch)}/{len(items)} sequences, "
                      f"{tokens / (time.perf_counter() - start):.0f} tok/s", flush=True)
        result[split] = feats
    return result


def with_taps(tapped: dict, final: dict) -> dict:
    """Per item, the tapped streams followed by the final state: the layout the target ships."""
    return {split: [torch.cat((t, f), dim=-1) for t, f in zip(tapped[split], final[split], strict=True)]
            for split in final}
