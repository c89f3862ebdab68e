"""The speculation and engine layers type-check (``[tool.mypy]`` in pyproject.toml), so every
``type: ignore`` left there still silences something (``warn_unused_ignores``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_speculation_and_engine_type_check():
    run = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Success" in run.stdout
