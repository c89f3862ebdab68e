"""Speculation statistics, per request and per engine (after vLLM's ``spec_decode/metrics.py``).

Counters:
- ``num_drafts``: rounds in which the sequence had at least one draft token;
- ``num_draft_tokens``: draft tokens proposed; ``num_accepted_tokens``: of those, accepted;
- ``accepted_per_position[j]``: rounds in which draft position j (0-based) was accepted;
- ``target_forward_passes``: target forwards that included the sequence (prefill included).

Derived:
- acceptance rate = num_accepted_tokens / num_draft_tokens;
- mean acceptance length = 1 + num_accepted_tokens / num_drafts: tokens gained per target pass in
  rounds that drafted (the +1 is the target's own recovered or bonus token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    target_forward_passes: int = 0

    def record_round(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.target_forward_passes += 1
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.target_forward_passes += other.target_forward_passes
        extra = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(extra, 0))
        for j, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[j] += n

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "target_forward_passes": self.target_forward_passes,
        }
