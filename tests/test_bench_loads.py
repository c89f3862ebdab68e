"""How ``benchmarks/bench_serve.py`` hands prompts to its loads: every load of a server gets prompts that
server has never seen (its warm-up requests included), so a server with a prefix cache (vLLM's automatic
prefix caching, on by default) is not credited for a prompt the benchmark itself sent it before."""

import pytest

from benchmarks.harness import Load, split_loads


def test_every_load_and_its_warm_up_get_prompts_no_other_load_has_seen():
    prompts = [f"p{i}" for i in range(40)]
    loads = split_loads(prompts, [2, 4, 16], warmups=2)
    assert [len(load.prompts) for load in loads] == [2, 4, 16]
    assert all(len(load.warmups) == 2 for load in loads)
    sent = [p for load in loads for p in (*load.warmups, *load.prompts)]
    assert len(sent) == len(set(sent)) == 28  # nothing sent twice, in order
    assert loads[0] == Load(["p0", "p1"], ["p2", "p3"])


def test_too_few_prompts_fail_before_any_server_starts_naming_what_is_missing():
    with pytest.raises(SystemExit, match="needs 30 distinct prompts.*has 20"):
        split_loads([f"p{i}" for i in range(20)], [4, 16], warmups=5)


def test_a_config_rewritten_in_float32_still_validates_and_keeps_its_own_file_where_it_is_already(tmp_path):
    """``bench_serve --dtype float32`` (and ``bench_policy``'s float32 servers): the pair's int8 draft weights
    run in bfloat16 only, so float32 serves the draft's own weights, and the config still starts."""
    from pathlib import Path

    import yaml

    from benchmarks.harness import dtype_config
    from serve_app.builder import parse_config

    coder = Path(__file__).resolve().parents[1] / "configs" / "coder.yaml"
    assert dtype_config(coder, tmp_path / "same.yaml", "bfloat16") == coder
    out = dtype_config(coder, tmp_path / "f32.yaml", "float32")
    (app,) = yaml.safe_load(out.read_text())["applications"]
    config = parse_config(app["args"])
    assert config.engine.dtype == "float32" and config.engine.speculation.draft_weights == "model"
    assert config.engine.speculation.draft == "qwen2.5-coder-0.5b-instruct"  # nothing else changed
