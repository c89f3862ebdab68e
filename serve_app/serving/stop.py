"""``python -m serve_app stop``: stop this machine's ``serve run`` with every request in flight finished.

Ray's ``serve run`` blocks until it gets SIGINT (Ctrl-C); then it shuts Serve down and exits, taking
with it the Ray instance it started (one it joined with ``--address`` stays up). That shutdown does
not wait for streams in flight (the proxies go down with the replicas), ``serve shutdown`` leaves
``serve run`` waiting, and after ``ray stop`` it only exits when it gives up on the lost cluster
(about a minute). So this command first deletes the cluster's Serve applications and waits: each
replica stops taking requests and finishes those in flight, for up to its
``deployment.graceful_shutdown_timeout_s``, while the proxies keep streaming. Then it sends SIGINT to
each ``serve run``, then SIGTERM, then SIGKILL to its process tree, ``SIGNAL_WAIT_S`` apart, until
it is gone.
"""

from __future__ import annotations

import logging
import os
import signal

import psutil

log = logging.getLogger(__name__)
SIGNAL_WAIT_S = 15.0  # how long serve run gets to exit after each signal, once its applications are drained


def serve_run_processes() -> list[psutil.Process]:
    """This machine's ``serve run`` processes (the ``serve`` script, or ``python -m ray.serve.scripts``)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info["cmdline"] or []
        for i, arg in enumerate(argv[:3]):
            if (os.path.basename(arg) == "serve" or arg == "ray.serve.scripts") and argv[i + 1: i + 2] == ["run"]:
                if proc.pid != os.getpid():
                    found.append(proc)
                break
    return found


def drain(address: str = "auto") -> list[str]:
    """Delete every Serve application of the cluster at ``address``, waiting for each replica to finish
    its requests; returns the applications deleted. A cluster it cannot reach is left alone (logged)."""
    import ray
    from ray import serve

    try:
        ray.init(address=address, namespace="serve", logging_level="ERROR", log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - no cluster, or not ours to reach: serve run's own shutdown follows
        log.warning("could not reach the Ray cluster to drain its applications (%s); stopping without draining", e)
        return []
    try:
        apps = list(serve.status().applications)
        for name in apps:
            serve.delete(name, _blocking=True)
        return apps
    finally:
        ray.shutdown()


def stop(wait_s: float = SIGNAL_WAIT_S, address: str | None = "auto") -> list[tuple[int, str]]:
    """Drain the applications of the cluster at ``address`` (None: do not drain), then stop every
    ``serve run`` here; returns (pid, how it ended) for each."""
    procs = serve_run_processes()
    if not procs:
        return []
    if address is not None:
        log.warning("drained and deleted %s", drain(address) or "no application")
    trees = {p.pid: _tree(p) for p in procs}
    outcome = {}
    alive = procs
    # SIGINT is serve run's own stop (Ctrl-C), but a serve run started in the background without job
    # control ignores it, and its exit (Ray's shutdown of the instance it started) can hang, on SIGTERM
    # too. With its applications drained nothing is lost, so the last resort is SIGKILL of its tree.
    for sig in (signal.SIGINT, signal.SIGTERM):
        told = [p for p in alive if not (sig == signal.SIGINT and _ignores(p, sig))]
        for p in told:
            _signal(p, sig)
        gone, _ = psutil.wait_procs(told, timeout=wait_s)
        outcome.update({p.pid: f"exited after {sig.name}" for p in gone})
        alive = [p for p in alive if p not in gone]
    for p in alive:
        tree = [p, *trees[p.pid]]
        for q in tree:
            _signal(q, signal.SIGKILL)
        psutil.wait_procs(tree, timeout=wait_s)
        outcome[p.pid] = f"killed with its process tree (no exit within {wait_s:.0f} s of SIGTERM)"
    return [(p.pid, outcome[p.pid]) for p in procs]


def _ignores(proc: psutil.Process, sig: signal.Signals) -> bool:
    """Whether ``proc`` ignores ``sig`` (Linux: the SigIgn mask of /proc/PID/status)."""
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(mask >> (sig - 1) & 1)


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _signal(proc: psutil.Process, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass  # gone already
