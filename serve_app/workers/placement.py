"""Where a replica's workers run: placement-group bundles and the accelerator cores Ray assigns.

One placement group per Serve replica (STRICT_PACK, so draft, target and replica share a node):
bundle 0 holds the replica (the engine), then one bundle per worker. Workers ask for
``neuron_cores`` (Trainium: Ray sets NEURON_RT_VISIBLE_CORES per actor), ``GPU``, or only CPUs.

The Neuron runtime wants a contiguous, increasing core range, and Ray writes a comma list that can
come unsorted: a worker sorts it, checks it is contiguous and fails clearly if not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

Accelerator = Literal["neuron_cores", "GPU", "CPU"]
NEURON_VISIBLE_CORES = "NEURON_RT_VISIBLE_CORES"


class PlacementError(RuntimeError):
    """Cores a worker cannot use, or a cluster that cannot host the configured workers."""


def parse_core_ids(value: str) -> list[int]:
    """Parse "0-3,5", "3,1,2" or "" into core ids (unsorted, as written)."""
    ids: list[int] = []
    for part in filter(None, (p.strip() for p in value.split(","))):
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            if hi < lo:
                raise PlacementError(f"core range {part!r} runs backwards")
            ids.extend(range(lo, hi + 1))
        else:
            ids.append(int(part))
    return ids


def contiguous_range(ids: list[int], who: str) -> tuple[int, int]:
    """Sort ``ids`` and return (first, last); raise if they are not one contiguous range."""
    if not ids:
        raise PlacementError(f"{who}: no NeuronCores assigned")
    ordered = sorted(ids)
    if len(set(ordered)) != len(ordered) or ordered[-1] - ordered[0] + 1 != len(ordered):
        raise PlacementError(
            f"{who}: assigned NeuronCores {ordered} are not one contiguous range; the Neuron runtime "
            "needs e.g. 4-7. Give every worker of a node core counts that tile it (e.g. 2 + 6 on 8 cores) "
            "and do not mix other neuron_cores consumers on that node."
        )
    return ordered[0], ordered[-1]


def claim_neuron_cores(who: str) -> tuple[int, int]:
    """Inside a worker: read the cores Ray assigned, check them, and rewrite the variable sorted."""
    value = os.environ.get(NEURON_VISIBLE_CORES)
    if value is None:
        raise PlacementError(f"{who}: {NEURON_VISIBLE_CORES} is not set; was the actor given neuron_cores?")
    first, last = contiguous_range(parse_core_ids(value), who)
    os.environ[NEURON_VISIBLE_CORES] = f"{first}-{last}" if last > first else str(first)
    return first, last


def worker_resources(accelerator: Accelerator, cores: int, cpus: float) -> dict[str, float]:
    bundle: dict[str, float] = {"CPU": cpus}
    if accelerator != "CPU":
        bundle[accelerator] = cores
    return bundle


def available_cpus() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup CPU quota (a Kubernetes pod's
    ``limits.cpu`` leaves the affinity at every core of the host)."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_cpu_quota()
    return cpus if quota is None else max(1, min(cpus, int(quota)))


def _cgroup_cpu_quota() -> float | None:
    """The cgroup's CPU quota in CPUs (v2 ``cpu.max``, else v1 ``cfs_quota_us / cfs_period_us``);
    None when unlimited or unreadable."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
    except (OSError, ValueError):
        try:
            with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as q, open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as p:
                quota, period = q.read().strip(), p.read().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or int(period) <= 0:
        return None
    return int(quota) / int(period)


# Weights past which one forward is long enough that every core pays (measured here, bf16, batch 1):
# the 0.5 B draft (0.99 GB) steps in 95 ms on one core and 58 on two, the 1.5 B target (3.1 GB) in 255
# and 144; SmolLM2-135M (0.27 GB) in 17 ms on one and 20 on two as served, the stall of sharing a core
# with the replica and the ingress outweighing the second core.
HEAVY_WEIGHT_BYTES = 768 * 2**20


@dataclass(frozen=True)
class ThreadPlan:
    """torch intra-op threads per forward, by the tokens it processes.

    A small served target leaves one core to the replica, the HTTP ingress and the draft for its small
    steps: a compute thread sharing a core with them stalls every parallel region it joins (batch 1
    on 2 cores: 20 ms a step with 2 threads against 17 with 1). A large forward (a batch of 16, a
    prefill) is worth that core: 26-31 ms with 2 threads against 39 with 1 at batch 16 (measured here,
    bf16, SmolLM2-135M). ``threads(None)`` is a prefill.
    """

    narrow: int
    wide: int
    wide_from_tokens: int = 8

    @classmethod
    def for_worker(cls, role: str, weight_bytes: int, alone: bool, cpus: int | None = None) -> ThreadPlan:
        """``alone``: the other worker never computes while this one does (sequential rounds). A heavy
        model alone then takes every core for every forward (``HEAVY_WEIGHT_BYTES``); otherwise the
        target leaves a core to the rest and the draft keeps to one."""
        cpus = available_cpus() if cpus is None else cpus
        if alone and weight_bytes >= HEAVY_WEIGHT_BYTES:
            return cls(cpus, cpus)
        return cls(max(1, cpus - 1), cpus) if role == "target" else cls(1, 1)

    @classmethod
    def fixed(cls, threads: int) -> ThreadPlan:
        return cls(threads, threads)

    def every_core(self, cpus: int | None = None) -> bool:
        """Whether each of its forwards takes every core: another worker's work beside it stalls both."""
        return self.narrow >= (available_cpus() if cpus is None else cpus)

    def threads(self, tokens: int | None) -> int:
        return self.wide if tokens is None or tokens >= self.wide_from_tokens else self.narrow
