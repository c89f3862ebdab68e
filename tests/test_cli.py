"""The CLI contract: ``python -m serve_app generate PROMPT [...] --json``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from serve_app.cli import main
from serve_app.speculation.policy import Acceptance
from serve_app.tune import expected_tokens

STATS_KEYS = {
    "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_acceptance_length",
    "accepted_per_position", "target_forward_passes", "tokens_per_second",
}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve_app", "generate", *args],
                          capture_output=True, text=True, timeout=300)


def test_json_output_contract(tiny_models):
    proc = run_cli("def add(a, b):", "--model", str(tiny_models["llama"]), "--draft", str(tiny_models["llama"]),
                   "--num-speculative-tokens", "3", "--max-tokens", "12", "--dtype", "float32", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"text", "token_ids", "finish_reason", "stats"}
    assert set(out["stats"]) == STATS_KEYS
    assert 1 <= len(out["token_ids"]) <= 12
    assert out["finish_reason"] in ("stop", "length")
    assert out["stats"]["acceptance_rate"] == 1.0  # draft == target


def test_greedy_cli_equals_plain(tiny_models):
    common = ["The quick brown fox", "--model", str(tiny_models["qwen3"]), "--max-tokens", "16", "--json"]
    spec = json.loads(run_cli(*common, "--draft", "ngram").stdout)
    plain = json.loads(run_cli(*common, "--draft", "none").stdout)
    assert spec["token_ids"] == plain["token_ids"]
    assert plain["stats"]["num_draft_tokens"] == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model"], "does not exist"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in"),
        (["--num-speculative-tokens", "99"], "num_speculative_tokens"),
    ],
)
def test_bad_options_fail_clearly(tiny_models, args, message):
    base = ["hi", "--model", str(tiny_models["llama"])]
    proc = run_cli(*base, *args) if "--model" not in args else run_cli("hi", *args)
    assert proc.returncode != 0
    assert message in proc.stderr


@pytest.mark.slow
def test_embedded_default_with_chat_template():
    proc = run_cli("Repeat exactly: red green blue", "--chat", "--max-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "red" in out["text"].lower() and out["stats"]["target_forward_passes"] >= 2


def test_tune_measures_and_recommends(tiny_models, tmp_path):
    """``python -m serve_app tune CONFIG``: acceptance per position, measured and expected tok/s for
    every k at each batch size, a recommendation, the Trainium2 projection, and the files."""
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "app", "import_path": "serve_app.builder:build_app",
        "args": {"engine": {"model": str(tiny_models["qwen3"]), "dtype": "float32", "max_seq_len": 256,
                            "speculation": {"draft": str(tiny_models["qwen3"]), "num_speculative_tokens": 2}}}}]}))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nThe quick brown fox\n")
    proc = subprocess.run([sys.executable, "-m", "serve_app", "tune", str(config), "--prompts", str(prompts),
                           "--raw", "--max-tokens", "8", "--batches", "1,2", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert report["acceptance_per_position"] == [1.0, 1.0]  # the draft is the target
    for b in ("1", "2"):
        assert set(report["measured"][b]) == {"0", "1", "2"} and all(v > 0 for v in report["measured"][b].values())
        assert report["recommended_k"][b] in (0, 1, 2)
    assert set(report["projection"]["by_k"]) == {"0", "1", "2"}
    assert report["projection"]["by_k"]["2"]["overlapped_x_plain"] > 1.0  # everything accepted pays there
    assert "recommended: num_speculative_tokens" in proc.stdout
    for b in ("1", "2"):  # the config's own (default) k policy, run after the fixed k's
        policy = report["policy"][b]
        assert policy["tok_s"] > 0 and policy["k"] in (0, 1, 2)
        assert any(rate is not None and rate > 0 for rate in policy["realized_tok_s"])
    assert "the config's k policy:" in proc.stdout
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "out" / "policy.png").exists()

    bad = subprocess.run([sys.executable, "-m", "serve_app", "tune", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "tune:" in bad.stderr


def test_check_draft_in_process(tiny_models, capsys):
    assert main(["check-draft", "--target", str(tiny_models["qwen3"]), "--draft", str(tiny_models["qwen3_near"])]) == 0
    assert capsys.readouterr().out.startswith("ok: ")


def test_the_planners_expected_tokens_per_round():
    """A block of k drafts at per-position acceptance a_j yields 1 + a_1 + a_1 a_2 + ... tokens."""
    assert expected_tokens([1.0, 1.0, 1.0], 3) == 4.0
    assert expected_tokens([0.0, 1.0], 2) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)


def test_tune_on_a_tiny_sample_reports_positions_it_never_reached(tiny_models, tmp_path):
    """A draft the target rejects at once leaves later draft positions never looked at: the planner says
    so (the table, null in the JSON) instead of dividing by an empty count; without matplotlib it
    names the command that adds the plots."""
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "app", "import_path": "serve_app.builder:build_app",
        "args": {"engine": {"model": str(tiny_models["qwen3"]), "dtype": "float32", "max_seq_len": 256,
                            "speculation": {"draft": str(tiny_models["qwen3_draft"]),
                                            "num_speculative_tokens": 4}}}}]}))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nThe quick brown fox\nimport os\nclass A:\n")
    no_matplotlib = tmp_path / "no_matplotlib" / "matplotlib"
    no_matplotlib.mkdir(parents=True)
    (no_matplotlib / "__init__.py").write_text("raise ImportError('matplotlib is not installed (test)')\n")
    proc = subprocess.run([sys.executable, "-m", "serve_app", "tune", str(config), "--prompts", str(prompts), "--raw",
                           "--batches", "1", "--num-prompts", "4", "--max-tokens", "48",
                           "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(no_matplotlib.parent)})
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    acceptance = report["acceptance_per_position"]
    assert len(acceptance) == 4 and None in acceptance  # a position drafted but never looked at
    assert all(a is None or 0.0 <= a <= 1.0 for a in acceptance)
    assert "never reached" in proc.stdout
    assert 'no plots: pip install -e ".[bench]"' in proc.stdout
    assert not list((tmp_path / "out").glob("*.png"))


def test_acceptance_rates_never_divide_by_an_empty_count():
    acceptance = Acceptance(decay=1.0)
    acceptance.add(4, 0)  # position 0 rejected: 1..3 drafted, never looked at
    assert acceptance.measured(0) == 0.0 and acceptance.measured(1) is None and acceptance.measured(9) is None
    assert acceptance.rate(1, 0.3, 0.0) == 0.3  # no count and no prior weight: the prior
