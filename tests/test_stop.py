"""``python -m serve_app stop`` on stand-in processes shaped like ``serve run``: one that exits on
SIGINT as ``serve run`` does, one that ignores SIGINT as a backgrounded one does. (The whole stop,
with a real ``serve run`` draining a stream, is in test_serve_run.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from serve_app.serving.stop import _ignores, serve_run_processes, stop

IGNORES_SIGINT = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)"
EXITS_ON_SIGINT = "import time; time.sleep(120)"


def fake_serve_run(tmp_path, code: str) -> subprocess.Popen:
    """A process whose command line is ``python .../serve run configs/x.yaml``, as the serve script's."""
    script = tmp_path / code.count("SIG_IGN").__str__() / "serve"
    script.parent.mkdir(exist_ok=True)
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script), "run", "configs/x.yaml"])
    deadline = time.monotonic() + 10
    while proc.pid not in {p.pid for p in serve_run_processes()} and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def test_stop_ends_each_serve_run_with_the_gentlest_signal_it_heeds(tmp_path):
    polite = fake_serve_run(tmp_path, EXITS_ON_SIGINT)
    deaf = fake_serve_run(tmp_path, IGNORES_SIGINT)
    time.sleep(0.5)  # the deaf one has installed its SIG_IGN
    assert not _ignores(psutil.Process(polite.pid), signal.SIGINT)
    assert _ignores(psutil.Process(deaf.pid), signal.SIGINT)
    outcome = dict(stop(wait_s=10, address=None))
    assert outcome == {polite.pid: "exited after SIGINT", deaf.pid: "exited after SIGTERM"}
    assert not psutil.pid_exists(polite.pid) and not psutil.pid_exists(deaf.pid)
    assert stop(wait_s=1, address=None) == []  # nothing left to stop
