"""Sequence bookkeeping shared by every runner: which KV slot (NxDI: batch line) a sequence owns and
how many of its tokens are cached. Rolling back is ``truncate``, an O(1) length change: entries past
the new length are overwritten by the next write and never attended to before that."""

from __future__ import annotations

import heapq


class SequenceSlots:
    def __init__(self, slots: int):
        # A min-heap: new sequences take the lowest free slot, so the running set stays a compact range
        # and a forward reads the cache as a view instead of gathering (copying) each sequence's rows.
        self._free_slots = list(range(slots))
        self._slot: dict[str, int] = {}
        self._length: dict[str, int] = {}

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def add(self, seq_id: str) -> None:
        if seq_id in self._slot:
            raise KeyError(f"sequence {seq_id!r} already present")
        if not self._free_slots:
            raise RuntimeError("no free KV-cache slot")
        self._slot[seq_id] = heapq.heappop(self._free_slots)
        self._length[seq_id] = 0

    def release(self, seq_id: str) -> None:
        heapq.heappush(self._free_slots, self._slot.pop(seq_id))
        del self._length[seq_id]

    def length(self, seq_id: str) -> int:
        """Number of tokens whose keys and values are in the cache."""
        return self._length[seq_id]

    def truncate(self, seq_id: str, length: int) -> None:
        """Roll a sequence back to ``length`` cached tokens (O(1))."""
        if not 0 <= length <= self._length[seq_id]:
            raise ValueError(f"cannot truncate {seq_id!r} from {self._length[seq_id]} to {length}")
        self._length[seq_id] = length
