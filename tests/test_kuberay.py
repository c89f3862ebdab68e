"""KubeRay manifests: valid against the v1.7 CRD schema with unknown fields rejected, the operator's
own rules, and serveConfigV2 identical to the matching file in configs/.

No Kubernetes API server runs here, so the CRD's openAPIV3Schema is checked with jsonschema after
making it strict (``additionalProperties: false`` wherever properties are listed), as the API
server's structural pruning would drop unknown fields silently.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from serve_app.builder import parse_config

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT.parent / "shared" / "kuberay" / "crds"
MANIFESTS = {"rayservice-cpu.yaml": "local.yaml", "rayservice-coder.yaml": "coder.yaml",
             "rayservice-trn2.yaml": "trn2-qwen3-32b.yaml",
             "rayservice-trn2-vllm.yaml": "trn2-qwen3-32b-vllm.yaml"}
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


@pytest.mark.parametrize("name", ["rayservice-trn2.yaml", "rayservice-trn2-vllm.yaml"])
def test_trainium_worker_group(name):
    service = rayservice(name)
    config = parse_config(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pod = group["template"]["spec"]
    assert pod["schedulerName"] == "my-scheduler"
    assert any(t["key"] == "aws.amazon.com/neuron" for t in pod["tolerations"])
    (container,) = pod["containers"]
    cores = int(container["resources"]["limits"]["aws.amazon.com/neuroncore"])
    disaggregated = config.engine.kind == "disaggregated"  # vLLM fuses the draft into the target's cores
    assert cores >= config.placement.target_cores + (config.placement.draft_cores if disaggregated else 0)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert config.engine.model.startswith("/mnt/models/") and "/mnt/models" in mounts
    assert "persistentVolumeClaim" in volumes[mounts["/mnt/neuron-cache"]]
    claims = {d["metadata"]["name"] for d in docs("pvc.yaml") if d["kind"] == "PersistentVolumeClaim"}
    assert {v["persistentVolumeClaim"]["claimName"] for v in volumes.values() if "persistentVolumeClaim" in v} <= claims
    assert cores <= 64, "a trn2.48xlarge exposes 64 logical NeuronCores at LNC=2"
    # the compiled artifacts the workers load live on the mounted cache volume
    if disaggregated:
        assert config.engine.neuron.artifacts_dir.startswith("/mnt/neuron-cache/")
    else:
        app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
        assert app["runtime_env"]["env_vars"]["NEURON_COMPILED_ARTIFACTS"].startswith("/mnt/neuron-cache/")


def test_probes_leave_room_for_loading_and_gate_traffic_on_serve():
    (group,) = rayservice("rayservice-trn2.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    live, ready = container["livenessProbe"], container["readinessProbe"]
    assert "local_raylet_healthz" in live["exec"]["command"][-1] and "8000" not in live["exec"]["command"][-1]
    assert live["periodSeconds"] * live["failureThreshold"] >= 600  # 10 min of raylet silence before a restart
    assert "localhost:8000/-/healthz" in ready["exec"]["command"][-1]
    assert {"containerPort": 8000, "name": "serve"} in container["ports"]


def test_karpenter_capacity_matches_the_worker_pods():
    pool, node_class = docs("karpenter-trn2.yaml")
    assert (pool["apiVersion"], pool["kind"]) == ("karpenter.sh/v1", "NodePool")
    assert (node_class["apiVersion"], node_class["kind"]) == ("karpenter.k8s.aws/v1", "EC2NodeClass")
    ref = pool["spec"]["template"]["spec"]["nodeClassRef"]
    assert ref == {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": node_class["metadata"]["name"]}
    # the fields Karpenter's EC2NodeClass CRD requires (karpenter.k8s.aws_ec2nodeclasses.yaml)
    assert {"amiSelectorTerms", "securityGroupSelectorTerms", "subnetSelectorTerms"} <= set(node_class["spec"])
    assert node_class["spec"]["amiSelectorTerms"] == [{"alias": "al2023@latest"}]  # Neuron variant for trn2
    requirements = pool["spec"]["template"]["spec"]["requirements"]
    types = [r for r in requirements if r["key"] == "node.kubernetes.io/instance-type"]
    (group,) = rayservice("rayservice-trn2.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    family = group["template"]["spec"]["nodeSelector"]["karpenter.k8s.aws/instance-family"]
    assert types[0]["values"] == ["trn2.48xlarge"] and family == "trn2"
    taint = pool["spec"]["template"]["spec"]["taints"][0]
    for pod in [group["template"]["spec"], *[job["spec"]["template"]["spec"] for job in jobs() if
                                            "nodeSelector" in job["spec"]["template"]["spec"]]]:
        assert any(t["key"] == taint["key"] and t["effect"] == taint["effect"] for t in pod["tolerations"])
    assert int(pool["spec"]["limits"]["aws.amazon.com/neuron"]) // 16 >= group["maxReplicas"]


# ---- built-in kinds against Kubernetes' own schemas ----------------------------------------------
K8S_VERSION = "1.31"
BUILTIN = ["pvc.yaml", "compile-job.yaml", "download-models-job.yaml"]


def jobs() -> list[dict]:
    return [d for name in ("compile-job.yaml", "download-models-job.yaml") for d in docs(name)]


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_kinds_validate_against_the_kubernetes_schema(name):
    for doc in docs(name):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", MANIFESTS)
def test_rayservice_pod_templates_are_valid_kubernetes_pods(name):
    cluster = rayservice(name)["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "template"}, "spec": group["template"]["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_the_kubernetes_schema_rejects_mistakes():
    (job, *_) = docs("compile-job.yaml")
    job["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError, match="comand"):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


# ---- the compile Job, the image and the runbook agree with the manifests -------------------------
def test_compile_job_compiles_what_the_rayservice_serves():
    (job,) = docs("compile-job.yaml")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:4] == ["python", "-m", "serve_app", "compile"]
    image_config = Path(command[4])
    workdir = re.search(r"^WORKDIR (\S+)", dockerfile(), re.M).group(1)
    assert "COPY configs ./configs" in dockerfile() and image_config.parent == Path(workdir) / "configs"
    served = yaml.safe_load(rayservice("rayservice-trn2.yaml")["spec"]["serveConfigV2"])
    assert yaml.safe_load((ROOT / "configs" / image_config.name).read_text()) == served
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (group,) = rayservice("rayservice-trn2.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    worker_mounts = {m["mountPath"]: m["name"] for m in group["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/mnt/neuron-cache"] == worker_mounts["/mnt/neuron-cache"]
    assert container["image"] == group["template"]["spec"]["containers"][0]["image"] == "${SERVE_APP_IMAGE}"


def dockerfile() -> str:
    return (ROOT / "kuberay" / "Dockerfile.trn2").read_text()


def test_image_is_the_neuron_inference_image_with_this_project():
    design = (ROOT.parent / "shared" / "DESIGN.md")
    base = re.search(r"^FROM (\S+)", dockerfile(), re.M).group(1)
    assert base.startswith("public.ecr.aws/neuron/pytorch-inference-vllm-neuronx:") and "py311" in base
    if design.is_file():
        assert base in design.read_text()
    pinned = re.findall(r'"(ray\[serve\]==[\d.]+)"', dockerfile())
    assert pinned and f'"{pinned[0]}"' in (ROOT / "pyproject.toml").read_text()
    assert rayservice("rayservice-trn2.yaml")["spec"]["rayClusterConfig"]["rayVersion"] == pinned[0].split("==")[1]


RUNBOOK = ROOT / "kuberay" / "README.md"


def runbook_commands() -> str:
    return "\n".join(re.findall(r"```bash\n(.*?)```", RUNBOOK.read_text(), re.S))


def test_runbook_commands_match_the_manifests():
    commands = runbook_commands()
    # every file it applies exists, and every manifest of the deployment is applied
    applied = set(re.findall(r"kuberay/([\w.-]+\.yaml)", commands))
    assert applied == {"karpenter-trn2.yaml", "pvc.yaml", "download-models-job.yaml", "compile-job.yaml",
                       "rayservice-trn2.yaml", "rayservice-trn2-vllm.yaml"}
    assert "docker build -f kuberay/Dockerfile.trn2" in commands
    # each envsubst names exactly the placeholders of its file, and the runbook exports them
    for variables, name in re.findall(r"envsubst '([^']+)' < kuberay/([\w.-]+)", commands):
        placeholders = set(re.findall(r"\$\{(\w+)\}", (ROOT / "kuberay" / name).read_text().split("\n", 1)[1]))
        assert set(re.findall(r"\$\{(\w+)\}", variables)) == placeholders, name
        for var in placeholders:
            assert f"export {var}=" in commands
    # names and namespace
    namespaces = {d["metadata"].get("namespace") for name in applied for d in docs(name)} - {None}
    assert namespaces == {"serve-app"} and "kubectl create namespace serve-app" in commands
    service = rayservice("rayservice-trn2.yaml")["metadata"]["name"]
    assert f"rayservice/{service} -n serve-app" in commands and f"svc/{service}-serve-svc" in commands
    for job in jobs():
        assert f"job/{job['metadata']['name']} -n serve-app" in commands
    # the request names the served model
    served = parse_config(yaml.safe_load(rayservice("rayservice-trn2.yaml")["spec"]["serveConfigV2"])
                          ["applications"][0]["args"])
    assert f'"model": "{served.served_model_id}"' in commands
    # the compile line it shows is what the artifact key looks like for this config
    k = served.engine.speculation.num_speculative_tokens
    engine = served.engine
    assert f"target-tp{served.placement.target_cores}-bs{engine.max_batch_size}-seq{engine.max_seq_len + k + 1}" \
           f"-ctx{engine.max_seq_len}-spec{k + 1}-bf16-lnc2-sdk" in RUNBOOK.read_text()
