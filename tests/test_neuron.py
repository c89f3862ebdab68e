"""The Neuron backend without the hardware: NxDI arguments for the reference setup, artifact keys,
padding and positions of short blocks, the clear failure without the SDK, and losslessness of
speculation through the Neuron runner against a FAKE NxDI (tests/fake_nxdi, the SDK boundary only).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serve_app.builder import parse_config
from serve_app.compile import compile_plan
from serve_app.config import EngineConfig, SpeculationConfig
from serve_app.engine.engine import RequestError
from serve_app.engine.factory import eos_token_ids, make_engine
from serve_app.engine.plan import neuron_spec, plan_engine, runner_config
from serve_app.engine.request import GenerationParams
from serve_app.models.base import ModelLoadError, RunnerConfig
from serve_app.models.loader import build_runner
from serve_app.models.neuron.artifacts import artifact_key
from serve_app.models.neuron.runner import NeuronModelRunner
from serve_app.models.neuron.sdk import NeuronSDKMissing
from serve_app.models.neuron.spec import NeuronSpec
from serve_app.speculation.proposers.draft_model import DraftModelProposer
from serve_app.speculation.proposers.registry import proposers_for
from serve_app.speculation.types import SamplingParams
from serve_app.speculation.verifier import TargetVerifier
from tests.helpers import engine_for

ROOT = Path(__file__).resolve().parents[1]
FAKE_SDK = Path(__file__).parent / "fake_nxdi"
SDK_INSTALLED = importlib.util.find_spec("neuronx_distributed_inference") is not None


@pytest.fixture
def fake_nxdi(monkeypatch):
    """Put the FAKE NxDI package on sys.path for one test, and take it away afterwards."""
    monkeypatch.syspath_prepend(str(FAKE_SDK))
    yield importlib.import_module("neuronx_distributed_inference.models.fake_model").FakeNeuronCausalLM
    for name in [m for m in sys.modules if m.startswith("neuronx_distributed_inference")]:
        del sys.modules[name]


def reference_app():
    return parse_config(yaml.safe_load((ROOT / "configs/trn2-qwen3-32b.yaml").read_text())["applications"][0]["args"])


def neuron_engine_config(tmp_path, model, draft="none", k=4, **neuron) -> EngineConfig:
    return EngineConfig(model=str(model), backend="neuron", dtype="float32", max_batch_size=3, max_seq_len=96,
                        speculation=SpeculationConfig(draft=str(draft), num_speculative_tokens=k, k_policy="fixed"),
                        neuron={"artifacts_dir": str(tmp_path / "artifacts"), "compile_if_missing": True,
                                "max_context_length": 64, **neuron})


# ---- config -> NxDI arguments -------------------------------------------------------------------
def test_reference_setup_compiles_a_k_plus_1_scoring_target_and_a_token_generation_draft():
    app = reference_app()
    target = runner_config(app.engine, "target", app.placement.target_cores).neuron
    draft = runner_config(app.engine, "draft", app.placement.draft_cores).neuron
    t, d = target.neuron_config_kwargs(), draft.neuron_config_kwargs()
    assert (t["tp_degree"], d["tp_degree"]) == (32, 4)
    assert (t["speculation_length"], d["speculation_length"]) == (8, 0)  # k = 7
    assert t["enable_fused_speculation"] is False and d["enable_fused_speculation"] is False
    for kw in (t, d):  # logits come back; our sampler decides
        assert kw["on_device_sampling_config"] is None and kw["output_logits"] is False
        assert kw["batch_size"] == kw["tkg_batch_size"] == kw["max_batch_size"] == 4 and kw["ctx_batch_size"] == 1
        assert kw["is_continuous_batching"] and kw["apply_seq_ids_mask"]
        assert kw["torch_dtype"] == "bfloat16" and kw["logical_nc_config"] == 2
        assert kw["max_context_length"] == 2048 and kw["enable_bucketing"]
        assert kw["context_encoding_buckets"] == [128, 256, 512, 1024, 2048]
    assert t["seq_len"] == 2048 + 8 and t["token_generation_buckets"][-1] == 2056  # padded-block headroom
    assert d["seq_len"] == 2048


def test_plain_decoding_target_gets_a_one_token_graph(tmp_path, tiny_models):
    spec = neuron_spec(neuron_engine_config(tmp_path, tiny_models["llama"], draft="none"), "target", 2)
    assert spec.speculation_length == 0 and spec.block_len == 1


def test_neuron_settings_mistakes_fail_at_startup_naming_the_key():
    args = yaml.safe_load((ROOT / "configs/trn2-qwen3-32b.yaml").read_text())["applications"][0]["args"]
    with pytest.raises(Exception, match="neuron_cores"):
        parse_config({**args, "placement": {**args["placement"], "accelerator": "CPU"}})
    with pytest.raises(Exception, match="context_buckets"):
        parse_config({**args, "engine": {**args["engine"], "neuron": {"context_buckets": [512, 128]}}})
    with pytest.raises(Exception, match="max_context_length"):
        parse_config({**args, "engine": {**args["engine"], "neuron": {"max_context_length": 4096}}})
    with pytest.raises(Exception, match="token_buckets"):
        parse_config({**args, "engine": {**args["engine"], "neuron": {"token_buckets": [512, 4096]}}})


def test_configured_buckets_are_topped_by_each_models_own_length(tmp_path, tiny_models):
    cfg = neuron_engine_config(tmp_path, tiny_models["llama"], draft="ngram", k=4, token_buckets=[32, 64, 96],
                               context_buckets=[16, 32])
    target, draft = neuron_spec(cfg, "target", 2), neuron_spec(cfg, "draft", 1)
    assert target.neuron_config_kwargs()["token_generation_buckets"] == [32, 64, 96, 101]  # 96 + k + 1
    assert draft.neuron_config_kwargs()["token_generation_buckets"] == [32, 64, 96]
    assert target.neuron_config_kwargs()["context_encoding_buckets"] == [16, 32, 64]


# ---- artifact keys ------------------------------------------------------------------------------
def test_artifact_keys_change_with_everything_the_artifacts_depend_on(tiny_models):
    model = Path(tiny_models["llama"])
    base = NeuronSpec("target", tp_degree=32, batch_size=4, max_seq_len=2048, max_context_length=2048,
                      speculation_length=8)
    sdk = {"neuronx-distributed-inference": "0.6.0", "neuronx-cc": "2.21.0"}
    key = artifact_key(model, base, sdk)
    assert key == artifact_key(model, base, dict(sdk))  # stable
    assert key.startswith(f"{model.name}-") and "/target-tp32-bs4-seq2056-ctx2048-spec8-bf16-lnc2-sdk0.6.0-" in key
    variants = [
        artifact_key(model, NeuronSpec("target", 16, 4, 2048, 2048, 8), sdk),
        artifact_key(model, NeuronSpec("target", 32, 8, 2048, 2048, 8), sdk),
        artifact_key(model, NeuronSpec("target", 32, 4, 4096, 2048, 8), sdk),
        artifact_key(model, NeuronSpec("target", 32, 4, 2048, 2048, 5), sdk),
        artifact_key(model, NeuronSpec("target", 32, 4, 2048, 1024, 8), sdk),
        artifact_key(model, NeuronSpec("target", 32, 4, 2048, 2048, 8, logical_nc_config=1), sdk),
        artifact_key(model, base, {**sdk, "neuronx-cc": "2.22.0"}),
        artifact_key(model, base, {**sdk, "neuronx-distributed-inference": "0.7.0"}),
        artifact_key(Path(tiny_models["qwen3"]), base, sdk),
    ]
    assert len({key, *variants}) == len(variants) + 1


# ---- without the SDK ----------------------------------------------------------------------------
@pytest.mark.skipif(SDK_INSTALLED, reason="the Neuron SDK is installed here")
def test_choosing_neuron_without_the_sdk_says_what_to_install(tmp_path, tiny_models):
    cfg = neuron_engine_config(tmp_path, tiny_models["llama"])
    with pytest.raises(NeuronSDKMissing, match=r"pip install neuronx-distributed-inference.*engine.backend: torch"):
        build_runner(tiny_models["llama"], runner_config(cfg, "target", 2))


def test_missing_artifacts_name_the_compile_command(tmp_path, tiny_models, fake_nxdi):
    cfg = neuron_engine_config(tmp_path, tiny_models["llama"], compile_if_missing=False)
    with pytest.raises(ModelLoadError, match="python -m serve_app compile CONFIG"):
        build_runner(tiny_models["llama"], runner_config(cfg, "target", 2))


# ---- padding, positions, rollback ---------------------------------------------------------------
def test_short_block_is_padded_with_consecutive_positions_and_masked_context(tmp_path, tiny_models, fake_nxdi):
    cfg = neuron_engine_config(tmp_path, tiny_models["llama"], draft="ngram", k=4)
    runner = build_runner(tiny_models["llama"], runner_config(cfg, "target", 2))
    torch_runner = build_runner(tiny_models["llama"], RunnerConfig(max_batch_size=3, max_seq_len=96))
    for r in (runner, torch_runner):
        r.add("a")
        r.add("b")
        r.prefill("a", [5, 6, 7, 8, 9])
        r.prefill("b", [10, 11, 12])
    fake_nxdi.calls.clear()
    logits = runner.forward(["a", "b"], [[20, 21], [30, 31, 32, 33, 34]], logits="all")
    (call,) = fake_nxdi.calls
    assert call["graph"] == "speculation"
    assert call["input_ids"].tolist() == [[20, 21, 21, 21, 21], [30, 31, 32, 33, 34]]  # k + 1 = 5 columns
    assert call["position_ids"].tolist() == [[5, 6, 7, 8, 9], [3, 4, 5, 6, 7]]
    assert call["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert (runner.length("a"), runner.length("b")) == (7, 8)
    expected = torch_runner.forward(["a", "b"], [[20, 21], [30, 31, 32, 33, 34]], logits="all")
    assert (logits[0, :2] - expected[0, :2]).abs().max() < 1e-4 and (logits[1] - expected[1]).abs().max() < 1e-4
    assert not logits[0, 2:].any()  # padding's logits are not returned

    # Roll back (a rejected draft): the dead entries are overwritten and never attended to.
    for r in (runner, torch_runner):
        r.truncate("a", 6)
    fake_nxdi.calls.clear()
    again = runner.forward(["a"], [[40]], logits="last")
    assert fake_nxdi.calls[0]["position_ids"].tolist() == [[6, 7, 8, 9, 10]]
    assert (again - torch_runner.forward(["a"], [[40]])).abs().max() < 1e-4


def test_blocks_longer_than_the_compiled_length_run_in_chunks(tmp_path, tiny_models, fake_nxdi):
    cfg = neuron_engine_config(tmp_path, tiny_models["llama"], draft="ngram", k=2)  # blocks of 3
    runner = build_runner(tiny_models["llama"], runner_config(cfg, "target", 2))
    runner.add("a")
    runner.prefill("a", [5, 6])
    fake_nxdi.calls.clear()
    out = runner.forward(["a"], [[1, 2, 3, 4, 5, 6, 7]], logits="all")
    assert [c["position_ids"][0, 0].item() for c in fake_nxdi.calls] == [2, 5, 8]
    assert out.shape[1] == 7 and runner.length("a") == 9


def test_draft_runner_uses_prefill_then_one_token_steps(tmp_path, tiny_models, fake_nxdi):
    cfg = neuron_engine_config(tmp_path, tiny_models["llama"], draft="ngram", k=4)
    runner = build_runner(tiny_models["llama"], runner_config(cfg, "draft", 1))
    runner.add("a")
    fake_nxdi.calls.clear()
    runner.forward(["a"], [[5, 6, 7]])
    runner.forward(["a"], [[8, 9]])
    assert [c["graph"] for c in fake_nxdi.calls] == ["context_encoding", "token_generation", "token_generation"]
    assert [c["position_ids"].tolist() for c in fake_nxdi.calls] == [[[0, 1, 2]], [[3]], [[4]]]


# ---- losslessness through the Neuron runners ----------------------------------------------------
def neuron_engine(tmp_path, target, draft, k):
    cfg = neuron_engine_config(tmp_path, target, draft=draft, k=k)
    t = build_runner(target, runner_config(cfg, "target", 2))
    tok = t.load_tokenizer()
    d = None
    if draft not in ("none", "ngram"):
        d = DraftModelProposer(build_runner(draft, runner_config(cfg, "draft", 1)), 8, target_vocab=t.vocab_size)
    return make_engine(plan_engine(cfg, 2, 1), TargetVerifier(t), proposers_for(cfg.speculation, d), tok,
                       eos_token_ids(Path(target), tok))


@pytest.mark.parametrize("request_k", [1, 4, 6])  # below, at and above the compiled k = 4
def test_greedy_speculation_through_the_neuron_runners_equals_plain_torch_decoding(
        tmp_path, tiny_models, fake_nxdi, request_k):
    target, draft = tiny_models["qwen3"], tiny_models["qwen3_near"]
    engine = neuron_engine(tmp_path, target, draft, k=4)
    plain = engine_for(target, draft="none", k=0)
    prompts = [[7], [5, 6, 7, 8], list(range(20, 40))]  # a 1-token prompt has no prefill
    want = [o.token_ids for o in plain.generate(prompts, GenerationParams(max_tokens=24, method="none"))]
    for method in ("draft", "ngram", "none"):
        got = engine.generate(prompts, GenerationParams(max_tokens=24, method=method, num_speculative_tokens=request_k))
        assert [o.token_ids for o in got] == want, method
    assert {c["graph"] for c in fake_nxdi.calls} >= {"context_encoding", "speculation", "token_generation"}


def test_prompts_longer_than_the_prefill_graph_are_refused_up_front(tmp_path, tiny_models, fake_nxdi):
    engine = neuron_engine(tmp_path, tiny_models["qwen3"], tiny_models["qwen3_near"], k=4)  # max_context_length 64
    with pytest.raises(RequestError, match="64 tokens the compiled prefill graph takes"):
        engine.add_request(list(range(10, 75)), GenerationParams(max_tokens=4))
    out = engine.generate([list(range(10, 74))], GenerationParams(max_tokens=4))[0]  # 64 tokens fit
    assert len(out.token_ids) == 4


def test_sampled_speculation_through_the_neuron_runners_is_reproducible(tmp_path, tiny_models, fake_nxdi):
    engine = neuron_engine(tmp_path, tiny_models["qwen3"], tiny_models["qwen3_near"], k=4)
    params = GenerationParams(max_tokens=16, method="draft", sampling=SamplingParams(temperature=0.8, seed=3))
    first = engine.generate([[5, 6, 7]], params)[0].token_ids
    assert engine.generate([[5, 6, 7]], params)[0].token_ids == first and len(first) == 16


# ---- compile command ----------------------------------------------------------------------------
def test_compile_command_writes_keyed_artifacts_that_workers_load(tmp_path, tiny_models, fake_nxdi):
    args = yaml.safe_load((ROOT / "configs/trn2-qwen3-32b.yaml").read_text())["applications"][0]["args"]
    args["engine"].update(model=str(tiny_models["qwen3"]), speculation={"draft": str(tiny_models["qwen3"]),
                          "num_speculative_tokens": 3}, max_seq_len=64,
                          neuron={"artifacts_dir": str(tmp_path / "cache")})
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "x", "import_path": "serve_app.builder:build_app",
                                                          "args": args}]}))
    env = {"PYTHONPATH": f"{FAKE_SDK}:{ROOT}", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-m", "serve_app", "compile", str(config)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    folders = sorted(p.parent for p in (tmp_path / "cache").rglob("serve_app_artifact.json"))
    assert [f.name.split("-")[0] for f in folders] == ["draft", "target"]
    assert "tp4-" in folders[0].name and "tp32-" in folders[1].name and "spec4-" in folders[1].name
    assert str(folders[1]) in run.stdout
    again = subprocess.run([sys.executable, "-m", "serve_app", "compile", str(config)], capture_output=True,
                           text=True, env=env, timeout=300)
    assert again.returncode == 0 and "already compiled" in again.stdout
    # A worker with this configuration finds and loads them without compiling.
    app = parse_config(args)
    runner = build_runner(tiny_models["qwen3"], runner_config(app.engine, "target", app.placement.target_cores))
    assert isinstance(runner, NeuronModelRunner) and runner.artifacts == folders[1]
    plan = compile_plan(app)  # what the command compiled: the target, then the draft
    assert [(path, spec.role, spec.tp_degree) for path, spec in plan] == [
        (tiny_models["qwen3"], "target", 32), (tiny_models["qwen3"], "draft", 4)]
