"""What each round cost, as the engine measures it: the k policy's and the planner's input.

A round runs from the proposers' calls (or, for a plain round sent ahead, from when the target could
start it) to its result; the overhead is the engine's and its caller's work between the last result
and this round's start; the interval, result to result, is what the round really cost as served
(not measured across an admission, which is prefill work).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from serve_app.speculation.policy import RoundCosts
from serve_app.speculation.types import VerifyResult


class RoundTimer:
    def __init__(self) -> None:
        self.last_end: float | None = None  # when the last round's result came
        self.draft_s: dict[str, tuple[int, float]] = {}  # this round's proposer calls: (steps, seconds)
        self.draft_rows: dict[str, int] = {}  # the rows each proposer drafted for this round

    def reset(self) -> None:
        self.last_end = None

    def overhead(self) -> float | None:
        return None if self.last_end is None else time.perf_counter() - self.last_end

    def verify_start(self, sent: float) -> float:
        """When the target could start a round sent ahead at ``sent``: once the round before it ended."""
        return sent if self.last_end is None else max(sent, self.last_end)

    def drafted(self, method: str, ks: Sequence[int], seconds: float | None) -> None:
        """A proposer's call for blocks of ``ks`` tokens, and its seconds (None: not a measure of a draft
        step: the draft first caught up)."""
        self.draft_rows[method] = sum(k > 0 for k in ks)
        if seconds is not None:
            self.draft_s[method] = (max(ks), seconds)

    def finish(self, result: VerifyResult, start: float, verify_start: float, overhead: float | None,
               admitted: bool, read: int = 0, handed_over: bool = False) -> tuple[float, RoundCosts]:
        """The round's result is in: (seconds since ``start``, what it cost). ``admitted``: it ran beside
        prefill work, so what it took is not what a round costs; ``read``: tokens its draft read first (its
        catch-up); ``handed_over``: held sequences went to the draft, so its interval is not a round's."""
        previous, self.last_end = self.last_end, time.perf_counter()
        tokens = len(result.seq_ids) + int(result.num_draft_tokens.sum())
        took = None if previous is None or admitted else self.last_end - previous
        interval = None if handed_over else took
        catch_up = (read, took) if took is not None and read else None
        kept = len(result.seq_ids) + int(result.num_accepted.sum())
        k = max((steps for steps, _ in self.draft_s.values()), default=max(result.num_draft_tokens.tolist(), default=0))
        costs = RoundCosts(tokens, self.last_end - verify_start, self.draft_s, overhead, len(result.seq_ids),
                           interval, kept, k, self.draft_rows, catch_up)
        self.draft_s, self.draft_rows = {}, {}
        return self.last_end - start, costs
