"""Where a compiled model lives: one folder per everything the artifacts depend on.

NxDI artifacts are specific to the model weights, the tensor-parallel degree, batch size, sequence
and context lengths, buckets, speculation length, dtype, logical-core setting and the SDK version.
The folder name spells the common ones out, so an operator can see what is cached; a short digest
of the rest keeps two configurations from ever sharing a folder.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

from serve_app.models.neuron.spec import NeuronSpec

SDK_PACKAGES = ("neuronx-cc", "torch-neuronx", "neuronx-distributed", "neuronx-distributed-inference")
DONE_MARKER = "serve_app_artifact.json"


def sdk_versions() -> dict[str, str]:
    """Installed Neuron SDK package versions ("none" where absent)."""
    versions = {}
    for name in SDK_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "none"
    return versions


def model_fingerprint(model_path: Path) -> str:
    """Digest of config.json and the weight files' names and sizes (hashing 64 GB of weights at every
    start would take minutes; a changed checkpoint changes its sizes or config in practice)."""
    h = hashlib.sha256()
    h.update((model_path / "config.json").read_bytes())
    for f in sorted(model_path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:10]


def artifact_key(model_path: Path, spec: NeuronSpec, versions: dict[str, str]) -> str:
    """``<model>-<fingerprint>/<role>-tp<T>-bs<B>-seq<S>-ctx<C>-spec<N>-<dtype>-lnc<L>-sdk<V>-<digest>``."""
    kwargs = spec.neuron_config_kwargs()
    digest = hashlib.sha256(json.dumps({"neuron_config": kwargs, "sdk": versions}, sort_keys=True).encode())
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(spec.dtype, spec.dtype)
    name = (f"{spec.role}-tp{spec.tp_degree}-bs{spec.batch_size}-seq{spec.seq_len}-ctx{spec.max_context_length}"
            f"-spec{spec.speculation_length}-{dtype}-lnc{spec.logical_nc_config}"
            f"-sdk{versions.get('neuronx-distributed-inference', 'none')}-{digest.hexdigest()[:8]}")
    return f"{model_path.name}-{model_fingerprint(model_path)}/{name}"


def artifact_dir(model_path: Path, spec: NeuronSpec, versions: dict[str, str] | None = None) -> Path:
    return Path(spec.artifacts_dir) / artifact_key(model_path, spec, versions or sdk_versions())


def is_complete(folder: Path) -> bool:
    """A compile writes its marker last, so a half-written folder (a killed Job) is not loaded."""
    return (folder / DONE_MARKER).is_file()


def mark_complete(folder: Path, model_path: Path, spec: NeuronSpec, versions: dict[str, str]) -> None:
    record = {"model": str(model_path), "neuron_config": spec.neuron_config_kwargs(), "sdk": versions}
    (folder / DONE_MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
