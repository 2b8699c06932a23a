"""Policy checkpoints: safetensors weights and optimiser state, config, tokenizer, and a manifest with the sha256 of
every file. Nothing is pickled and nothing is read with `torch.load`.

    info = save_checkpoint(Path("checkpoints/actor/v000001"), policy, optimizer=optimizer, metadata={"step": 1})
    loaded = load_checkpoint(info.path, expected_sha256=info.manifest_sha256)
    load_optimizer_tensors(fresh_optimizer, loaded.optimizer_tensors, loaded.optimizer_param_groups)

A checkpoint directory holds:

    model.safetensors      the state dict; a tied weight is stored once, under the name transformers loads
    config.json            the transformers config
    tokenizer.json, tokenizer_config.json
    optimizer.safetensors  optimiser state as "state.<param index>.<key>" tensors (only with an optimizer)
    manifest.json          {"format", "files": {name: sha256}, "weight_hash", "metadata", "optimizer_param_groups"}

A LoRA version (`pipeline.models.lora`) holds `adapter.safetensors` and `adapter_config.json` instead of
`model.safetensors`, and its manifest names its base, a full checkpoint, by relative path and manifest sha256
(`"base": {"path": "../v000000", "manifest_sha256": ...}`). Loading it loads and verifies the base, or, given a
policy already holding that base (`reuse`), sets the adapter in place without reloading the base; either way the
assembled model's weight hash must equal the manifest's.

The manifest's bytes are deterministic (sorted keys, fixed separators), so the sha256 of `manifest.json` names the
whole checkpoint: it is what `PolicyPublished` carries and what `load_checkpoint(expected_sha256=...)` checks.
Saving is atomic: everything is written and fsynced in a sibling temporary directory, then renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import torch

from pipeline.errors import CheckpointError, InvalidArgumentError
from pipeline.models.lora import ADAPTER_CONFIG_FILE, ADAPTER_FILE, adapter_tensors, is_lora, load_adapter, wrap
from pipeline.models.transformers_backend import TransformersPolicy, load_tokenizer
from pipeline.runtime.durable import file_sha256, fsync_directory, fsync_file

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
CONFIG_FILE = "config.json"
FORMAT = 1


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    manifest_sha256: str
    weight_hash: str


@dataclass
class LoadedCheckpoint:
    policy: TransformersPolicy
    manifest: dict[str, Any]
    optimizer_tensors: dict[str, torch.Tensor] | None
    optimizer_param_groups: list[dict[str, Any]] | None


# -- hashes -------------------------------------------------------------------------------------------------------


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def weight_hash(model: torch.nn.Module) -> str:
    """sha256 over the state dict in sorted key order: each tensor's name, dtype, shape and raw bytes. Equal hashes
    mean bit-identical weights (a tied weight counts under each of its names)."""
    digest = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name]
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def manifest_sha256(directory: Path) -> str:
    """sha256 of the checkpoint's `manifest.json` bytes: the checkpoint's identity."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    return file_sha256(path)


def _manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, sort_keys=True, indent=1, separators=(",", ": "), allow_nan=False) + "\n").encode()


# -- optimiser state ----------------------------------------------------------------------------------------------


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """`optimizer.state_dict()` as flat tensors plus JSON-able param groups.

    State values become tensors named `state.<param index>.<key>`; a non-tensor value (a Python float `step`)
    becomes a 0-d tensor (float64 / int64 / bool, so no precision is lost). A tensor-valued group option (a tensor
    `lr`) is stored as `param_groups.<group index>.<key>` and left out of the JSON groups.
    """
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            tensors[f"state.{index}.{key}"] = _as_tensor(value)
    groups: list[dict[str, Any]] = []
    for g, group in enumerate(state_dict["param_groups"]):
        json_group: dict[str, Any] = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                tensors[f"param_groups.{g}.{key}"] = _as_tensor(value)
            else:
                json_group[key] = list(value) if isinstance(value, tuple) else value
        groups.append(json_group)
    return tensors, groups


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().clone()
    if isinstance(value, bool):
        return torch.tensor(value, dtype=torch.bool)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    raise CheckpointError(f"optimizer state value of type {type(value).__name__} cannot be stored as a tensor")


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], param_groups: list[dict[str, Any]]
) -> None:
    """Inverse of `optimizer_tensors`: load the state into `optimizer` (built over the same parameters in the same
    order). Afterwards a step gives bit-identical weights to the optimizer that was saved."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    groups = [dict(group) for group in param_groups]
    for name, tensor in tensors.items():
        section, index, key = name.split(".", 2)
        if section == "state":
            state.setdefault(int(index), {})[key] = tensor
        elif section == "param_groups":
            groups[int(index)][key] = tensor
        else:
            raise CheckpointError(f"unknown optimizer tensor {name!r} (expected state.* or param_groups.*)")
    # JSON turned tuples (AdamW's betas) into lists: give them back the type the optimizer's own groups use.
    for group, current in zip(groups, optimizer.param_groups, strict=False):
        for key, value in group.items():
            if isinstance(value, list) and isinstance(current.get(key), tuple):
                group[key] = tuple(value)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except ValueError as exc:
        raise CheckpointError(f"optimizer state does not fit this optimizer: {exc}") from exc


# -- save / load --------------------------------------------------------------------------------------------------


def _untied_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each tied tensor kept once, under its first name (transformers' own choice:
    `model.embed_tokens.weight` stays, `lm_head.weight` is re-tied on load)."""
    kept: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tuple(tensor.stride()))
        if identity in seen:
            continue
        seen.add(identity)
        kept[name] = tensor.detach().cpu().contiguous()
    return kept


def save_checkpoint(
    directory: Path,
    policy: TransformersPolicy,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    metadata: dict[str, Any] | None = None,
    base: CheckpointInfo | None = None,
) -> CheckpointInfo:
    """Write `policy` (and `optimizer`'s state) to `directory` atomically. `metadata` must be JSON-able. A LoRA
    policy is written as its adapter on `base`, the full checkpoint it was wrapped around.

    An existing `directory` is never overwritten: if its manifest is byte-identical to the one this call would
    write, its info is returned; otherwise `CheckpointError`.
    """
    from safetensors.torch import save_file

    lora = is_lora(policy.model)
    if lora and base is None:
        raise InvalidArgumentError("a LoRA policy is saved as an adapter on its base checkpoint: pass base=")
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial", dir=directory.parent))
    try:
        if lora:
            save_file(adapter_tensors(policy.model), str(staging / ADAPTER_FILE), metadata={"format": "pt"})
            (staging / ADAPTER_CONFIG_FILE).write_bytes(_manifest_bytes(policy.adapter_config or {}))
        else:
            save_file(_untied_state_dict(policy.model), str(staging / MODEL_FILE), metadata={"format": "pt"})
        policy.model.config.save_pretrained(staging)
        policy.tokenizer.save_pretrained(staging)
        param_groups = None
        if optimizer is not None:
            tensors, param_groups = optimizer_tensors(optimizer)
            save_file(tensors, str(staging / OPTIMIZER_FILE))
        hashed = weight_hash(policy.model)
        manifest = {
            "format": FORMAT,
            "files": {path.name: file_sha256(path) for path in sorted(staging.iterdir())},
            "weight_hash": hashed,
            "metadata": metadata or {},
            "optimizer_param_groups": param_groups,
            **({"base": {"path": os.path.relpath(base.path, directory), "manifest_sha256": base.manifest_sha256}}
               if lora and base is not None else {}),
        }
        try:
            manifest_bytes = _manifest_bytes(manifest)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"checkpoint metadata and optimizer param groups must be JSON-able: "
                                       f"{exc}") from exc
        (staging / MANIFEST).write_bytes(manifest_bytes)
        for path in staging.iterdir():
            fsync_file(path)
        fsync_directory(staging)
        info = CheckpointInfo(directory, hashlib.sha256(manifest_bytes).hexdigest(), hashed)
        if directory.exists():
            return _existing(directory, info)
        try:
            os.replace(staging, directory)
        except OSError:
            if directory.exists():  # another writer got there first
                return _existing(directory, info)
            raise
        fsync_directory(directory.parent)
        return info
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _existing(directory: Path, info: CheckpointInfo) -> CheckpointInfo:
    if not (directory / MANIFEST).is_file():
        raise CheckpointError(f"{directory} exists without a {MANIFEST} (an unfinished write?); refusing to replace it")
    existing = manifest_sha256(directory)
    if existing != info.manifest_sha256:
        raise CheckpointError(f"{directory} already holds a different checkpoint: manifest sha256 {existing}, "
                              f"this one {info.manifest_sha256}")
    return info


def checkpoint_path(uri: str) -> Path:
    """The local directory of a `checkpoint_uri` (file:// URI or plain path)."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(url2pathname(parsed.path))
    if parsed.scheme in ("", None):
        return Path(uri)
    raise CheckpointError(f"checkpoint uri {uri!r}: only local files (file:// or a path) are supported")


def load_checkpoint(directory: Path, expected_sha256: str | None = None, device: str = "cpu", *,
                    reuse: TransformersPolicy | None = None) -> LoadedCheckpoint:
    """Load a checkpoint written by `save_checkpoint`, verifying the manifest's sha256 (when `expected_sha256` is
    given), every listed file's sha256, and the weight hash of the loaded model. Any mismatch or missing file raises
    `CheckpointError` naming the file and both hashes. For a LoRA version, `reuse` (a LoRA policy on the same base
    with the same adapter configuration) gets the new adapter in place instead of a fresh load of the base."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    actual = manifest_sha256(directory)
    if expected_sha256 is not None and actual != expected_sha256:
        raise CheckpointError(f"{directory / MANIFEST}: sha256 {actual}, expected {expected_sha256}")
    manifest = json.loads((directory / MANIFEST).read_bytes())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{directory / MANIFEST}: format {manifest.get('format')!r}, this code reads {FORMAT}")
    for name, recorded in sorted(manifest["files"].items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in the manifest (sha256 {recorded}) but missing")
        if (found := file_sha256(path)) != recorded:
            raise CheckpointError(f"{path}: sha256 {found}, manifest says {recorded}")
    if "base" in manifest:
        return _load_adapter_checkpoint(directory, manifest, device, reuse)
    for required in (MODEL_FILE, CONFIG_FILE):
        if required not in manifest["files"]:
            raise CheckpointError(f"{directory / MANIFEST} does not list {required}")

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.float32
    # The initial weights are overwritten; forking keeps the caller's RNG stream where it was.
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = load_file(str(directory / MODEL_FILE))
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    # A name missing from the file is fine only when it is tied to (shares memory with) a stored one.
    loaded_state = model.state_dict()
    stored_pointers = {loaded_state[name].data_ptr() for name in state}
    untied = [name for name in missing if loaded_state[name].data_ptr() not in stored_pointers]
    if unexpected or untied:
        raise CheckpointError(f"{directory / MODEL_FILE} does not fit its config: missing {untied}, "
                              f"unexpected {sorted(unexpected)}")
    if (loaded_hash := weight_hash(model)) != manifest["weight_hash"]:
        raise CheckpointError(f"{directory / MODEL_FILE}: weight hash {loaded_hash} after loading, manifest says "
                              f"{manifest['weight_hash']}")
    model.eval()
    tokenizer = load_tokenizer(directory)

    policy = TransformersPolicy(model, tokenizer, device=device)
    policy.base_checkpoint = actual
    return _loaded(directory, manifest, policy)


def _loaded(directory: Path, manifest: dict[str, Any], policy: TransformersPolicy) -> LoadedCheckpoint:
    from safetensors.torch import load_file

    optimizer_state = None
    if OPTIMIZER_FILE in manifest["files"]:
        optimizer_state = load_file(str(directory / OPTIMIZER_FILE))
    return LoadedCheckpoint(policy=policy, manifest=manifest, optimizer_tensors=optimizer_state,
                            optimizer_param_groups=manifest["optimizer_param_groups"])


def _load_adapter_checkpoint(directory: Path, manifest: dict[str, Any], device: str,
                             reuse: TransformersPolicy | None) -> LoadedCheckpoint:
    """A LoRA version: its adapter on its base (loaded and verified, or the base `reuse` already holds)."""
    from safetensors.torch import load_file

    for required in (ADAPTER_FILE, ADAPTER_CONFIG_FILE):
        if required not in manifest["files"]:
            raise CheckpointError(f"{directory / MANIFEST} names a base but does not list {required}")
    base = manifest["base"]
    config = json.loads((directory / ADAPTER_CONFIG_FILE).read_bytes())
    tensors = load_file(str(directory / ADAPTER_FILE))
    if (reuse is not None and is_lora(reuse.model) and reuse.base_checkpoint == base["manifest_sha256"]
            and reuse.adapter_config == config):
        policy, previous = reuse, adapter_tensors(reuse.model)
    else:
        base_policy = load_checkpoint((directory / base["path"]).resolve(), base["manifest_sha256"], device).policy
        policy = TransformersPolicy(wrap(base_policy.model, config), base_policy.tokenizer, device=device)
        policy.base_checkpoint, policy.adapter_config, previous = base["manifest_sha256"], config, None
    try:
        load_adapter(policy.model, tensors)
        loaded_hash = weight_hash(policy.model)
        if loaded_hash != manifest["weight_hash"]:
            raise CheckpointError(f"{directory / ADAPTER_FILE}: weight hash {loaded_hash} after loading on base "
                                  f"{base['manifest_sha256'][:12]}, manifest says {manifest['weight_hash']}")
    except Exception:
        if previous is not None:
            load_adapter(policy.model, previous)  # the policy in use keeps the version it had
        raise
    policy.model.eval()
    return _loaded(directory, manifest, policy)
