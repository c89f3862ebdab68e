"""What each round cost, as the engine measures it: the k policy's and the planner's input.

A round runs from the proposers' calls (or, for a plain round sent ahead, from when the target could
start it) to its result; the overhead is the engine's and its caller's work between the last result
and this round's start; the interval, result to result, is what the round really cost as served
(not measured across an admission, which is prefill work).
"""

from __future__ import annotations

import time

from serve_app.speculation.policy import RoundCosts
from serve_app.speculation.types import VerifyResult


class RoundTimer:
    def __init__(self) -> None:
        self.last_end: float | None = None  # when the last round's result came
        self.draft_s: dict[str, tuple[int, float]] = {}  # this round's proposer calls: (steps, seconds)

    def reset(self) -> None:
        self.last_end = None

    def overhead(self) -> float | None:
        return None if self.last_end is None else time.perf_counter() - self.last_end

    def verify_start(self, sent: float) -> float:
        """When the target could start a round sent ahead at ``sent``: once the round before it ended."""
        return sent if self.last_end is None else max(sent, self.last_end)

    def drafted(self, method: str, steps: int, seconds: float) -> None:
        self.draft_s[method] = (steps, seconds)

    def finish(self, result: VerifyResult, start: float, verify_start: float, overhead: float | None,
               admitted: bool) -> tuple[float, RoundCosts]:
        """The round's result is in: (seconds since ``start``, what it cost)."""
        previous, self.last_end = self.last_end, time.perf_counter()
        tokens = len(result.seq_ids) + int(result.num_draft_tokens.sum())
        interval = None if previous is None or admitted else self.last_end - previous
        kept = len(result.seq_ids) + int(result.num_accepted.sum())
        k = max((steps for steps, _ in self.draft_s.values()), default=max(result.num_draft_tokens.tolist(), default=0))
        costs = RoundCosts(tokens, self.last_end - verify_start, self.draft_s, overhead, len(result.seq_ids),
                           interval, kept, k)
        self.draft_s = {}
        return self.last_end - start, costs
