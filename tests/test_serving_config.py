"""The application config: the YAML files in configs/ validate, mistakes name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serve_app.builder import ConfigError, parse_config
from serve_app.config import EMBEDDED_SPECULATION
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
    ],
)
def test_mistakes_name_the_key(args, message):
    with pytest.raises(ConfigError) as err:
        parse_config(args)
    assert message in str(err.value)
