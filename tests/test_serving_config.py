"""The application config: the YAML files in configs/ validate, mistakes name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app.builder import ConfigError, parse_config
from serve_app.config import EMBEDDED_SPECULATION, ENGINE_KINDS
from serve_app.serving.replica import replica_bundles

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def app_args(name: str) -> dict:
    doc = yaml.safe_load((CONFIGS / name).read_text())
    (application,) = doc["applications"]
    assert application["import_path"] == "serve_app.builder:build_app"
    return application["args"]


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_config_file_validates(name):
    config = parse_config(app_args(name))
    assert config.served_model_id
    ServeDeploySchema.model_validate(yaml.safe_load((CONFIGS / name).read_text()))  # what serve run reads


@pytest.mark.parametrize("name", ["local.yaml", "coder.yaml"])
def test_cpu_configs_slow_serves_control_plane_down(name):
    """On a few cores Serve's controller polls beside the model: at its default 0.1 s loop it took 1.6-2.1 CPU
    seconds of a 16-stream load on the real pair (2 cores), and each wake-up stalls the target's threads."""
    env = yaml.safe_load((CONFIGS / name).read_text())["controller_options"]["runtime_env"]["env_vars"]
    assert float(env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]) >= 0.5
    assert int(env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"]) >= 1000


def test_trainium_reference_setup():
    config = parse_config(app_args("trn2-qwen3-32b.yaml"))
    assert config.engine.backend == "neuron"
    assert config.engine.speculation.num_speculative_tokens == 7
    assert config.engine.speculation.method == "draft"
    assert (config.placement.accelerator, config.placement.target_cores) == ("neuron_cores", 32)
    assert not config.placement.fallback_to_cpu
    bundles = replica_bundles(config)
    assert bundles[1]["neuron_cores"] == 32 and bundles[2]["neuron_cores"] == 4


def test_local_config_is_the_embedded_pairing_and_ngram_needs_no_draft_bundle():
    config = parse_config(app_args("local.yaml"))
    spec = config.engine.speculation
    assert {key: getattr(spec, key) for key in EMBEDDED_SPECULATION} == EMBEDDED_SPECULATION  # = --draft auto
    assert spec.method == "draft" and len(replica_bundles(config)) == 3
    ngram = parse_config({"engine": {"speculation": {"draft": "ngram"}}})
    assert len(replica_bundles(ngram)) == 2


@pytest.mark.parametrize(
    "args, message",
    [
        ({"engine": {"modle": "x"}}, "args.engine.modle: unknown key"),
        ({"placement": {"accelerator": "TPU"}}, "args.placement.accelerator"),
        ({"engine": {"speculation": {"num_speculative_tokens": 99}}}, "args.engine.speculation.num_speculative_tokens"),
        ({"deployment": {"num_replicas": 2, "autoscaling_config": {}}}, "either num_replicas or autoscaling_config"),
        ({"deployment": {"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}}, "min_replicas (3)"),
        ({"engine": {"speculation": {"ngram_min": 4, "ngram_max": 2}}}, "ngram_min (4) must be <= ngram_max (2)"),
        ({"exchange": "carrier_pigeon"}, "args.exchange"),
        ({"engine": {"speculation": {"draft": "ngram", "draft_weights": "int8"}}}, "draft_weights applies to a draft"),
        ({"engine": {"dtype": "float32", "speculation": {"draft": "smollm2-135m-instruct", "draft_weights": "int8"}}},
         "speculation.draft_weights: int8 runs on the torch backend on a CPU in bfloat16"),
        ({"engine": {"speculation": {"draft": "smollm2-135m-instruct", "draft_weights": "int4"}}},
         "args.engine.speculation.draft_weights"),
    ],
)
def test_mistakes_name_the_key(args, message):
    with pytest.raises(ConfigError) as err:
        parse_config(args)
    assert message in str(err.value)


def keys_only_of(kind: str) -> list[tuple[str, ...]]:
    """Paths (inside ``engine``) of every key that engine kind takes and the other does not."""
    mine, (other,) = ENGINE_KINDS[kind], [m for k, m in ENGINE_KINDS.items() if k != kind]
    paths = [(name,) for name in mine.model_fields if name not in other.model_fields]
    nested = mine.model_fields["speculation"].annotation, other.model_fields["speculation"].annotation
    paths += [("speculation", name) for name in nested[0].model_fields if name not in nested[1].model_fields]
    return paths


@pytest.mark.parametrize("kind, other", [("disaggregated", "vllm"), ("vllm", "disaggregated")])
def test_every_key_of_one_engine_kind_is_refused_under_the_other_naming_the_key(kind, other):
    paths = keys_only_of(kind)
    assert paths  # each kind has keys of its own
    for path in paths:
        field = ENGINE_KINDS[kind].model_fields[path[0]]
        if len(path) == 2:
            field = field.annotation.model_fields[path[1]]
        value = field.get_default(call_default_factory=True)
        value = value.model_dump() if hasattr(value, "model_dump") else value
        engine = {"kind": other, path[0]: {path[1]: value} if len(path) == 2 else value}
        with pytest.raises(ConfigError) as err:
            parse_config({"engine": engine})
        key = "engine." + ".".join(path)
        assert f"{key} applies to engine.kind: {kind}" in str(err.value), (key, str(err.value))


def test_the_dtype_list_and_the_k_bound_are_written_once():
    from serve_app.config import MAX_SPECULATIVE_TOKENS
    from serve_app.models.dtype import DTYPE_NAMES
    from serve_app.serving.openai_api import CompletionRequest

    assert DTYPE_NAMES == ("float32", "bfloat16")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        parse_config({"engine": {"speculation": {"num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}}})
    with pytest.raises(ValueError):
        CompletionRequest(model="m", prompt="x", num_speculative_tokens=MAX_SPECULATIVE_TOKENS + 1)
