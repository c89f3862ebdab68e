"""The house rules, checked so they stay: the package's layers import only downwards and without a
circle, the engine is assembled in one place, every module is imported by some test, and the docs
are short where they must be, complete (every config key) and linked correctly."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "serve_app"

# Lower layers never import higher ones. Folders of one layer may import each other (no circle).
LAYERS = {
    "models": 0,
    "config": 1, "speculation": 1,
    "engine": 2,
    "workers": 3, "distill": 3,
    "serving": 4,
    "builder": 5, "compile": 5, "tune": 5, "cli": 5, "__main__": 5,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every serve_app module ``path`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("serve_app"):
            found.add(node.module)
            for alias in node.names:  # `from serve_app.serving import openai_api` imports a module
                if (ROOT / node.module.replace(".", "/") / f"{alias.name}.py").is_file():
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("serve_app")}
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in imports(p) if i in modules and i != m} for m, p in modules.items()}


def layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else "__init__"


def test_layers_import_only_downwards():
    wrong = [f"{m} -> {i}" for m, targets in graph().items() for i in targets
             if layer(m) in LAYERS and layer(i) in LAYERS and LAYERS[layer(i)] > LAYERS[layer(m)]]
    assert not wrong, "imports that run up a layer:\n" + "\n".join(sorted(wrong))
    assert set(LAYERS) >= {layer(m) for m in graph() if layer(m) != "__init__"}, "a new folder needs a layer"


def test_no_import_circle():
    edges, state, cycles = graph(), {}, []

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(edges[m]):
            if state.get(n) == "open":
                cycles.append(" -> ".join(path[path.index(n):] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_the_engine_is_assembled_in_one_place():
    places = [f"{p.relative_to(ROOT)}:{i + 1}" for d in ("serve_app", "tests", "benchmarks")
              for p in (ROOT / d).rglob("*.py") for i, line in enumerate(p.read_text().splitlines())
              if re.search(r"(?<![\w.])Engine\(", line) and p.name != "test_layout.py"]
    assert len(places) == 1 and places[0].startswith("serve_app/engine/factory.py:"), places


def test_every_module_is_imported_by_some_test():
    imported: set[str] = set()
    for p in (ROOT / "tests").rglob("*.py"):
        imported |= imports(p)
    modules = {module_name(p) for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert not sorted(modules - imported), "modules no test imports: " + ", ".join(sorted(modules - imported))


def test_readme_is_short_and_every_docs_link_resolves():
    assert len((ROOT / "README.md").read_bytes()) <= 8 * 1024
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "kuberay" / "README.md",
             *PACKAGE.glob("drafts/*/README.md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).resolve().exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_configuration_reference_is_generated_and_documents_every_key():
    from serve_app.serving.config_reference import fields, render

    assert (ROOT / "docs" / "configuration.md").read_text() == render(), (
        "regenerate: python -m serve_app.serving.config_reference > docs/configuration.md")
    from serve_app.serving.config import AppConfig

    undocumented = [key for key, _, _, description in fields(AppConfig) if not description]
    assert not undocumented, undocumented


def test_models_are_resolved_in_one_module():
    """The engine plan answers which models a config names and where they are; nothing else resolves
    a source (``serve_app.models.sources.resolve``)."""
    resolvers = []
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "serve_app.models.sources" \
                    and any(a.name == "resolve" for a in node.names):
                resolvers.append(module_name(p))
            elif isinstance(node, ast.Attribute) and node.attr == "resolve" \
                    and isinstance(node.value, ast.Name) and node.value.id == "sources":
                resolvers.append(module_name(p))
    assert resolvers == ["serve_app.engine.plan"], resolvers


def protocol_members() -> set[str]:
    from serve_app.speculation.proposers.base import Proposer
    from serve_app.speculation.verifier import Verifier

    return {name for proto in (Verifier, Proposer) for name in vars(proto) if not name.startswith("_")}


def test_capabilities_are_declared_not_probed():
    """The optional capabilities of the verifier and proposer protocols have default bodies: the engine
    and the serving layer call them, never ``getattr``/``hasattr`` them."""
    members = protocol_members()
    assert {"can_send_ahead", "verify_async", "can_propose_ahead", "propose_ahead"} <= members
    probes = []
    for folder in ("engine", "serving"):
        for p in (PACKAGE / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                        and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                        and isinstance(node.args[1], ast.Constant) and node.args[1].value in members:
                    probes.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not probes, probes


def test_the_engine_module_stays_small():
    assert len((PACKAGE / "engine" / "engine.py").read_text().splitlines()) < 300
