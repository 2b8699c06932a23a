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

One pass per file each way: saving hashes each file's bytes as they are written (never reading a file back, but for
the small config and tokenizer files transformers writes itself), the weight hash computed beside the writes on a
second thread; loading reads each file once (the weights mapped from the page cache), hashes the bytes read (the
weights' on a second thread, while the new tensors' weight hash is computed or the model is built) and takes the
tensors as views of those bytes (no second read, no hash pass before a load pass). A full version of the
architecture a worker holds is copied into its model in place (`load_checkpoint(reuse=...)`), after the new tensors'
weight hash has checked out.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import torch

from pipeline.errors import CheckpointError, InvalidArgumentError
from pipeline.models.lora import ADAPTER_CONFIG_FILE, ADAPTER_FILE, adapter_tensors, is_lora, load_adapter, wrap
from pipeline.models.transformers_backend import TransformersPolicy, load_tokenizer
from pipeline.runtime.durable import (
    file_sha256,
    fsync_directory,
    fsync_file,
    map_file,
    read_hashed,
    sha256_of,
    write_hashed,
)

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


def _tensor_view(tensor: torch.Tensor) -> memoryview:
    """A tensor's raw bytes, without a copy for a contiguous CPU tensor."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over `state` in sorted key order: each tensor's name, dtype, shape and raw bytes."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(_tensor_view(tensor))
    return digest.hexdigest()


def weight_hash(model: torch.nn.Module) -> str:
    """sha256 over the state dict in sorted key order: each tensor's name, dtype, shape and raw bytes. Equal hashes
    mean bit-identical weights (a tied weight counts under each of its names)."""
    return state_hash(model.state_dict())


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


# -- safetensors bytes ---------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write `tensors` as a safetensors file, byte for byte what `safetensors.torch.save_file` writes, and return its
    sha256, hashed block by block as the bytes are written (no copy of the tensors, no reading back).

    The tensors' order and the header's layout are the library's: the order is read from the library's own header
    for one-element stand-ins of the same names and dtypes (it sorts by dtype, then name), and the header written
    here is checked against that one, formatted the same way; should they ever differ, the library serialises the
    whole file instead."""
    from safetensors.torch import save

    probe = save({name: torch.zeros(1, dtype=tensor.dtype) for name, tensor in tensors.items()}, metadata=metadata)
    probe_length = int.from_bytes(probe[:8], "little")
    order = [name for name in json.loads(probe[8 : 8 + probe_length]) if name != "__metadata__"]
    expected_probe = _safetensors_header(order, {name: (tensor.dtype, (1,)) for name, tensor in tensors.items()},
                                         metadata)
    if expected_probe != probe[: 8 + probe_length] or set(order) != set(tensors):
        return write_hashed(path, save(tensors, metadata=metadata))
    header = _safetensors_header(order, {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}, metadata)
    return write_hashed(path, [header, *(_tensor_view(tensors[name]) for name in order)])


def _safetensors_header(order: list[str], described: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                        metadata: dict[str, str] | None) -> bytes:
    """The length prefix and JSON header of a safetensors file holding `described` (dtype, shape) in `order`."""
    codes = {dtype: code for code, dtype in _SAFETENSORS_DTYPES.items()}
    entries: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name in order:
        dtype, shape = described[name]
        length = math.prod(shape) * dtype.itemsize
        entries[name] = {"dtype": codes[dtype], "shape": list(shape), "data_offsets": [offset, offset + length]}
        offset += length
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text


def safetensors_tensors(data: memoryview | bytearray, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes `data`, as views of `data` (no copy); `path` names it in errors.

    The format: an 8-byte little-endian header length, a JSON header `{name: {"dtype", "shape", "data_offsets"}}`,
    then the tensors' bytes (little-endian, offsets relative to the end of the header)."""
    if sys.byteorder != "little":  # the views below would read the bytes in the machine's order
        from safetensors.torch import load

        return load(bytes(data))
    try:
        length = int.from_bytes(data[:8], "little")
        header = json.loads(bytes(data[8 : 8 + length]))
        start = 8 + length
        tensors: dict[str, torch.Tensor] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            shape = [int(size) for size in entry["shape"]]
            begin, end = (int(offset) for offset in entry["data_offsets"])
            count = math.prod(shape)
            if end - begin != count * dtype.itemsize or start + end > len(data) or begin < 0:
                raise CheckpointError(f"{path} is not a readable safetensors file: tensor {name!r} at offsets "
                                      f"{begin}..{end} cannot hold {shape} {entry['dtype']}")
            tensors[name] = (torch.frombuffer(data, dtype=dtype, count=count, offset=start + begin).reshape(shape)
                             if count else torch.empty(shape, dtype=dtype))
    except (ValueError, KeyError, TypeError) as exc:  # a header that is not JSON, or lacks a field
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc!r}") from exc
    return tensors


# -- save / load --------------------------------------------------------------------------------------------------


def _untied_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each tied tensor kept once, under its first name (transformers' own choice:
    `model.embed_tokens.weight` stays, `lm_head.weight` is re-tied on load)."""
    stored = _stored_names(model)
    state = model.state_dict()
    return {name: state[name].detach().cpu().contiguous() for name in state if stored[name] == name}


def _stored_names(model: torch.nn.Module) -> dict[str, str]:
    """For each state dict name, the name its tensor is stored under in a checkpoint: its own, or for a tied tensor
    the first name sharing its memory."""
    first: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    stored: dict[str, str] = {}
    for name, tensor in model.state_dict().items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tuple(tensor.stride()))
        stored[name] = first.setdefault(identity, name)
    return stored


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

    Each file's sha256 is computed as it is written (the weights, adapter, optimiser state and manifest) or, for the
    few small files transformers writes itself (config, tokenizer), read back once; the weight hash is computed from
    the model's tensors on a second thread while the files are written (sha256 releases the GIL).

    An existing `directory` is never overwritten: if its manifest is byte-identical to the one this call would
    write, its info is returned; otherwise `CheckpointError`.
    """
    lora = is_lora(policy.model)
    if lora and base is None:
        raise InvalidArgumentError("a LoRA policy is saved as an adapter on its base checkpoint: pass base=")
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial", dir=directory.parent))
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-hash") as pool:
            hashing = pool.submit(weight_hash, policy.model)
            files: dict[str, str] = {}
            if lora:
                files[ADAPTER_FILE] = write_safetensors(staging / ADAPTER_FILE, adapter_tensors(policy.model),
                                                        metadata={"format": "pt"})
                files[ADAPTER_CONFIG_FILE] = write_hashed(staging / ADAPTER_CONFIG_FILE,
                                                          _manifest_bytes(policy.adapter_config or {}))
            else:
                files[MODEL_FILE] = write_safetensors(staging / MODEL_FILE, _untied_state_dict(policy.model),
                                                      metadata={"format": "pt"})
            param_groups = None
            if optimizer is not None:
                tensors, param_groups = optimizer_tensors(optimizer)
                files[OPTIMIZER_FILE] = write_safetensors(staging / OPTIMIZER_FILE, tensors)
            policy.model.config.save_pretrained(staging)
            policy.tokenizer.save_pretrained(staging)
            for path in staging.iterdir():
                if path.name not in files:  # written by transformers: small, hashed by reading them back once
                    files[path.name] = file_sha256(path)
                    fsync_file(path)
            hashed = hashing.result()
        manifest = {
            "format": FORMAT,
            "files": dict(sorted(files.items())),
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
        info = CheckpointInfo(directory, write_hashed(staging / MANIFEST, manifest_bytes), hashed)
        fsync_directory(staging)
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
                    reuse: TransformersPolicy | None = None, optimizer: bool = True) -> LoadedCheckpoint:
    """Load a checkpoint written by `save_checkpoint`, verifying the manifest's sha256 (when `expected_sha256` is
    given), every listed file's sha256, and the weight hash of the loaded model. Any mismatch or missing file raises
    `CheckpointError` naming the file and both hashes. Each file is read once and hashed from the bytes read (the
    weights, mapped from the page cache, on a second thread beside the work that does not depend on them), and the
    tensors are views of those bytes. `optimizer=False` leaves the optimiser state
    unread (and so unchecked): what a worker that only generates needs.

    `reuse`, a policy already held, gets the new weights in place when it can (the same object is returned):
    - a LoRA version on the base `reuse` holds, with the same adapter configuration: the adapter is set;
    - a full version whose config and tokenizer files are those `reuse` was loaded from: the state dict is copied
      into its parameters, after the weight hash of the new tensors has checked out, so a refused version leaves
      `reuse` as it was.
    Otherwise the model is built anew."""
    directory = Path(directory)
    actual, manifest, files = read_verified(directory, expected_sha256, optimizer=optimizer, later=(MODEL_FILE,))
    if "base" in manifest:
        return _load_adapter_checkpoint(directory, manifest, files, device, reuse)
    for required in (MODEL_FILE, CONFIG_FILE):
        if required not in manifest["files"]:
            raise CheckpointError(f"{directory / MANIFEST} does not list {required}")
    # The weights' sha256 is computed on a second thread while this one hashes the new tensors (in place) or builds
    # the model (anew); nothing is copied into a model before it has checked out.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="file-hash") as pool:
        data = files.pop(MODEL_FILE)
        file_checked = pool.submit(_check_sha256, directory / MODEL_FILE, data, manifest["files"][MODEL_FILE])
        try:
            state = safetensors_tensors(data, directory / MODEL_FILE)
            if reuse is not None and _same_architecture(reuse, manifest):
                _copy_in_place(reuse, state, directory, manifest, file_checked)
                reuse.base_checkpoint, reuse.checkpoint_files = actual, dict(manifest["files"])
                return _loaded(manifest, files, reuse)
            model = _built(directory, state, file_checked)
        except CheckpointError:
            file_checked.result()  # a file that is not the one the manifest names is the error to report
            raise
    del state, data  # the tensors were views of the file's bytes, now copied into the model
    if (loaded_hash := weight_hash(model)) != manifest["weight_hash"]:
        raise CheckpointError(f"{directory / MODEL_FILE}: weight hash {loaded_hash} after loading, manifest says "
                              f"{manifest['weight_hash']}")
    model.eval()
    tokenizer = load_tokenizer(directory)

    policy = TransformersPolicy(model, tokenizer, device=device)
    policy.base_checkpoint, policy.checkpoint_files = actual, dict(manifest["files"])
    return _loaded(manifest, files, policy)


def load_for_generation(directory: Path, expected_sha256: str, device: str = "cpu", *,
                        current: TransformersPolicy | None = None, precision: str = "float32",
                        micro_batch_size: int = 8) -> TransformersPolicy:
    """The version in `directory`, verified (`load_checkpoint` without the optimiser state), as a generating worker
    samples from it at `precision` (`TransformersPolicy.for_generation`): what `load_published` does for the
    transformers backend. `current`, the policy the worker holds (or, for a generation copy, the float32 policy it was
    made from), gets the new weights in place whenever `load_checkpoint(reuse=...)` can, and its generation copy
    too."""
    reuse = current.full_precision if current is not None and current.full_precision is not None else current
    loaded = load_checkpoint(directory, expected_sha256=expected_sha256, device=device, reuse=reuse,
                             optimizer=False).policy
    loaded.end_sessions()  # a policy loaded in place forgets the keys and values of its previous weights
    policy = loaded.for_generation(precision, reuse=current)
    policy.micro_batch_size = micro_batch_size
    return policy


def _check_sha256(path: Path, data: memoryview, recorded: str) -> None:
    if (found := sha256_of(data)) != recorded:
        raise CheckpointError(f"{path}: sha256 {found}, manifest says {recorded}")


def _built(directory: Path, state: dict[str, torch.Tensor], file_checked: Future[None]) -> Any:
    """A new model from the checkpoint's config, holding `state` once `file_checked` has passed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.float32
    # The initial weights are overwritten; forking keeps the caller's RNG stream where it was.
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    file_checked.result()
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    # A name missing from the file is fine only when it is tied to (shares memory with) a stored one.
    loaded_state = model.state_dict()
    stored_pointers = {loaded_state[name].data_ptr() for name in state if name in loaded_state}
    untied = [name for name in missing if loaded_state[name].data_ptr() not in stored_pointers]
    if unexpected or untied:
        raise CheckpointError(f"{directory / MODEL_FILE} does not fit its config: missing {untied}, "
                              f"unexpected {sorted(unexpected)}")
    return model


def read_verified(directory: Path, expected_sha256: str | None = None, *, optimizer: bool = True,
                  later: tuple[str, ...] = ()) -> tuple[str, dict[str, Any], dict[str, memoryview]]:
    """The manifest sha256, the manifest, and the bytes of every file it lists (the optimiser state only with
    `optimizer`), each file hashed as it is read and checked against the manifest (`CheckpointError` naming the
    file and both hashes). The files named in `later` are mapped (`map_file`) but not hashed: the caller checks them."""
    if not (directory / MANIFEST).is_file():
        raise CheckpointError(f"{directory / MANIFEST} is missing")
    manifest_data, actual = read_hashed(directory / MANIFEST)
    if expected_sha256 is not None and actual != expected_sha256:
        raise CheckpointError(f"{directory / MANIFEST}: sha256 {actual}, expected {expected_sha256}")
    manifest = json.loads(bytes(manifest_data))
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{directory / MANIFEST}: format {manifest.get('format')!r}, this code reads {FORMAT}")
    files: dict[str, memoryview] = {}
    for name, recorded in sorted(manifest["files"].items()):
        if name == OPTIMIZER_FILE and not optimizer:
            continue
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in the manifest (sha256 {recorded}) but missing")
        if name in later:
            files[name] = map_file(path)
            continue
        data, found = read_hashed(path)
        if found != recorded:
            raise CheckpointError(f"{path}: sha256 {found}, manifest says {recorded}")
        files[name] = data
    return actual, manifest, files


def same_architecture(files: dict[str, str] | None, manifest: dict[str, Any]) -> bool:
    """Whether a checkpoint with the manifest `files` (sha256 by name) describes the same model and tokenizer as
    `manifest`: every file but the weights and optimiser state has the same sha256."""
    def described(listed: dict[str, str]) -> dict[str, str]:
        return {name: sha for name, sha in listed.items() if name not in (MODEL_FILE, OPTIMIZER_FILE)}

    return files is not None and described(files) == described(manifest["files"])


def _same_architecture(held: TransformersPolicy, manifest: dict[str, Any]) -> bool:
    """Whether a full version can be copied into `held`: a plain (not LoRA) model loaded from a checkpoint of the
    same architecture."""
    return not is_lora(held.model) and held.full_precision is None and same_architecture(held.checkpoint_files,
                                                                                          manifest)


def _copy_in_place(held: TransformersPolicy, state: dict[str, torch.Tensor], directory: Path,
                   manifest: dict[str, Any], file_checked: Future[None]) -> None:
    """Copy the tensors of a full version into `held`'s parameters and buffers. Everything is checked first (the
    file's sha256, names, shapes, dtypes, and the weight hash the model will have), so a refused version changes
    nothing."""
    target = held.model.state_dict()
    stored = _stored_names(held.model)
    unfit = sorted(set(state) ^ {stored[name] for name in target})
    unfit += [name for name in state if name in target
              and (state[name].shape != target[name].shape or state[name].dtype != target[name].dtype)]
    if unfit:
        raise CheckpointError(f"{directory / MODEL_FILE} does not fit the model held (names, shapes or dtypes "
                              f"differ: {unfit[:5]})")
    # The hash of the model after the copy, from the new tensors: a tied weight counts under each of its names.
    new_hash = state_hash({name: state[stored[name]] for name in target})
    file_checked.result()
    if new_hash != manifest["weight_hash"]:
        raise CheckpointError(f"{directory / MODEL_FILE}: weight hash {new_hash} after loading, manifest says "
                              f"{manifest['weight_hash']}")
    with torch.no_grad():
        for name, tensor in state.items():
            target[name].copy_(tensor)
    held.model.eval()


def _loaded(manifest: dict[str, Any], files: dict[str, memoryview], policy: TransformersPolicy) -> LoadedCheckpoint:
    optimizer_state = None
    if OPTIMIZER_FILE in files:
        # Cloned: views of the file's bytes would keep all of them alive for as long as any one tensor lives.
        optimizer_state = {name: tensor.clone() for name, tensor in
                           safetensors_tensors(files[OPTIMIZER_FILE], Path(OPTIMIZER_FILE)).items()}
    return LoadedCheckpoint(policy=policy, manifest=manifest, optimizer_tensors=optimizer_state,
                            optimizer_param_groups=manifest["optimizer_param_groups"])


def _load_adapter_checkpoint(directory: Path, manifest: dict[str, Any], files: dict[str, memoryview], device: str,
                             reuse: TransformersPolicy | None) -> LoadedCheckpoint:
    """A LoRA version: its adapter on its base (loaded and verified, or the base `reuse` already holds)."""
    for required in (ADAPTER_FILE, ADAPTER_CONFIG_FILE):
        if required not in manifest["files"]:
            raise CheckpointError(f"{directory / MANIFEST} names a base but does not list {required}")
    base = manifest["base"]
    config = json.loads(bytes(files[ADAPTER_CONFIG_FILE]))
    tensors = safetensors_tensors(files[ADAPTER_FILE], directory / ADAPTER_FILE)
    if (reuse is not None and is_lora(reuse.model) and reuse.base_checkpoint == base["manifest_sha256"]
            and reuse.adapter_config == config):
        policy, previous = reuse, adapter_tensors(reuse.model)
    else:
        base_policy = load_checkpoint((directory / base["path"]).resolve(), base["manifest_sha256"], device,
                                      optimizer=False).policy
        policy = TransformersPolicy(wrap(base_policy.model, config), base_policy.tokenizer, device=device)
        policy.base_checkpoint, policy.adapter_config, previous = base["manifest_sha256"], config, None
        policy.checkpoint_files = base_policy.checkpoint_files
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
    return _loaded(manifest, files, policy)
