"""KubeRay manifests: valid against the v1.7 CRD schema with unknown fields rejected, the operator's
own rules, and serveConfigV2 identical to the matching file in configs/.

No Kubernetes API server runs here, so the CRD's openAPIV3Schema is checked with jsonschema after
making it strict (``additionalProperties: false`` wherever properties are listed), as the API
server's structural pruning would drop unknown fields silently.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from serve_app.builder import parse_config

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT.parent / "shared" / "kuberay" / "crds"
MANIFESTS = {"rayservice-cpu.yaml": "local.yaml", "rayservice-trn2.yaml": "trn2-qwen3-32b.yaml"}
DEPRECATED = {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"}


def strict(schema):
    """The CRD schema with unknown fields rejected and Kubernetes' int-or-string made explicit."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.pop("x-kubernetes-int-or-string", False):
                node.pop("type", None)
                node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def rayservice_schema():
    path = CRDS / "ray.io_rayservices.yaml"
    if not path.is_file():
        pytest.skip(f"{path} not found (the shared CRDs sit beside the repository)")
    crd = yaml.safe_load(path.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(v1["schema"]["openAPIV3Schema"])


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "kuberay" / name).read_text()) if d]


def rayservice(name: str) -> dict:
    (service,) = [d for d in docs(name) if d["kind"] == "RayService"]
    return service


@pytest.mark.parametrize("name", MANIFESTS)
def test_rayservice_validates_against_the_crd(rayservice_schema, name):
    service = rayservice(name)
    assert service["apiVersion"] == "ray.io/v1"
    jsonschema.Draft7Validator(rayservice_schema).validate(service)


def test_the_strict_schema_rejects_unknown_fields(rayservice_schema):
    service = rayservice("rayservice-cpu.yaml")
    service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagee"] = "x"
    with pytest.raises(jsonschema.ValidationError, match="imagee"):
        jsonschema.Draft7Validator(rayservice_schema).validate(service)


@pytest.mark.parametrize("name", MANIFESTS)
def test_operator_rules(name):
    service = rayservice(name)
    assert len(service["metadata"]["name"]) <= 47, "a RayService name is at most 47 characters"
    spec = service["spec"]
    assert not DEPRECATED & set(spec), "deprecated *UnhealthySecondThreshold fields are ignored"
    cluster = spec["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert "name" not in head.get("headService", {}).get("metadata", {}), "headService name must not be set"
    for group in [head, *cluster.get("workerGroupSpecs", [])]:
        for key, value in group.get("rayStartParams", {}).items():
            assert isinstance(value, str), f"rayStartParams.{key} must be a string"
    for group in cluster.get("workerGroupSpecs", []):
        assert group.get("minReplicas", 0) <= group.get("replicas", 0) <= group.get("maxReplicas", 2**31)


@pytest.mark.parametrize("name, config", MANIFESTS.items())
def test_serve_config_is_the_configs_file(name, config):
    embedded = yaml.safe_load(rayservice(name)["spec"]["serveConfigV2"])
    assert embedded == yaml.safe_load((ROOT / "configs" / config).read_text())
    parse_config(embedded["applications"][0]["args"])


def test_trainium_worker_group():
    service = rayservice("rayservice-trn2.yaml")
    config = parse_config(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pod = group["template"]["spec"]
    assert pod["schedulerName"] == "my-scheduler"
    assert any(t["key"] == "aws.amazon.com/neuron" for t in pod["tolerations"])
    (container,) = pod["containers"]
    cores = int(container["resources"]["limits"]["aws.amazon.com/neuroncore"])
    assert cores >= config.placement.draft_cores + config.placement.target_cores  # one replica fits a pod
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert config.engine.model.startswith("/mnt/models/") and "/mnt/models" in mounts
    assert "persistentVolumeClaim" in volumes[mounts["/mnt/neuron-cache"]]
    claims = {d["metadata"]["name"] for d in docs("pvc.yaml") if d["kind"] == "PersistentVolumeClaim"}
    assert {v["persistentVolumeClaim"]["claimName"] for v in volumes.values() if "persistentVolumeClaim" in v} <= claims
    pool = docs("karpenter-trn2.yaml")[0]
    assert pool["kind"] == "NodePool"
    family = [r for r in pool["spec"]["template"]["spec"]["requirements"]
              if r["key"] == "karpenter.k8s.aws/instance-family"]
    assert family[0]["values"] == [pod["nodeSelector"]["karpenter.k8s.aws/instance-family"]]
