"""Handing a policy version from a trainer to the workers that generate with it, before and after in one run: the
time to publish it (`save_checkpoint`), the time a worker takes to serve it (what `load_published` does with the
version it holds), and the bytes a version takes on disk.

    python benchmarks/policy_handoff.py --quick   # a synthetic state dict of 0.27B parameters, 2 repeats (~1.5 min)
    python benchmarks/policy_handoff.py           # a synthetic state dict of 1.07B parameters, 3 repeats (~5 min)

Sizes (`<size>` in the printed names):
- `tiny`: the tiny preset's model (`build_tiny` with default settings), full fine-tuning, AdamW state included as the
  trainer writes it;
- `smol_full`: SmolLM2-135M-Instruct (the `smollm2-135m-instruct` preset, float32), full fine-tuning, AdamW state;
- `smol_lora`: the same model with a rank-8 LoRA adapter (the default target modules): a version is the adapter and
  its AdamW state, on version 0 (the full base, written once, not timed);
- `synthetic_1b`: a plain state dict (16 float32 tensors; 1.07B parameters, 0.27B with `--quick`), no model, config
  or tokenizer: publish is the safetensors file and the weight hash, pick-up is reading, verifying and copying the
  tensors into new ones (before: the new model stood in by tensors allocated and copied into, without its random
  initialisation) or into the ones held (after), composed of the same functions `save_checkpoint` and
  `load_checkpoint` use (the weight hash beside the writes; the file's sha256 beside the new tensors' weight hash).

`before` is the code path as it was, re-implemented here step for step (`old_save`, `old_load`): `save_file`, then
every file hashed by reading it back and the weight hash over a `tobytes` copy of each tensor; loading hashes every
file (the optimiser state included), then reads the tensors again (`load_file`), builds a new model from its config
(a LoRA version: sets the adapter in place, as it did) and hashes it. `after` is this code: `save_checkpoint` and
`load_published(current=held)`. Both run on the same files in the page cache (each version is read right after it is
written), alternately, `--repeats` times; each printed time is the best of its repeats. The worker generates at
float32 (`generation.precision` float32, the default).

Printed: `publish_s_<size>_before/after`, `publish_speedup_<size>`, `pickup_s_<size>_before/after`,
`pickup_speedup_<size>`, `handoff_s_<size>_after` (publish + pick-up), `bytes_<size>` (one version's files),
`params_<size>`, and `publish_s_<size>=` / `pickup_s_<size>=` (the after figures).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from pipeline.errors import CheckpointError
from pipeline.models.checkpoints import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    MANIFEST,
    MODEL_FILE,
    OPTIMIZER_FILE,
    CheckpointInfo,
    _manifest_bytes,
    _untied_state_dict,
    optimizer_tensors,
    safetensors_tensors,
    save_checkpoint,
    state_hash,
    write_safetensors,
)
from pipeline.models.lora import adapter_tensors, is_lora, load_adapter, with_lora
from pipeline.models.policy_follower import load_published
from pipeline.models.settings import LoraSettings, TinyModelSettings
from pipeline.models.transformers_backend import TransformersPolicy, load_tokenizer
from pipeline.runtime.durable import file_sha256, fsync_directory, fsync_file, map_file, sha256_of
from schemas.base import Producer
from schemas.training import PolicyPublished

# -- the code path as it was --------------------------------------------------------------------------------------


def old_state_hash(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def old_save(directory: Path, policy: TransformersPolicy, optimizer: torch.optim.Optimizer | None,
             base: CheckpointInfo | None = None) -> CheckpointInfo:
    from safetensors.torch import save_file

    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial", dir=directory.parent))
    lora = is_lora(policy.model)
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
    hashed = old_state_hash(policy.model.state_dict())
    manifest = {"format": 1, "files": {p.name: file_sha256(p) for p in sorted(staging.iterdir())},
                "weight_hash": hashed, "metadata": {}, "optimizer_param_groups": param_groups,
                **({"base": {"path": os.path.relpath(base.path, directory), "manifest_sha256": base.manifest_sha256}}
                   if lora and base is not None else {})}
    manifest_bytes = _manifest_bytes(manifest)
    (staging / MANIFEST).write_bytes(manifest_bytes)
    for path in staging.iterdir():
        fsync_file(path)
    fsync_directory(staging)
    os.replace(staging, directory)
    fsync_directory(directory.parent)
    return CheckpointInfo(directory, hashlib.sha256(manifest_bytes).hexdigest(), hashed)


def old_load(directory: Path, expected_sha256: str, reuse: TransformersPolicy | None) -> TransformersPolicy:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    if file_sha256(directory / MANIFEST) != expected_sha256:
        raise CheckpointError(f"{directory}: manifest sha256")
    manifest = json.loads((directory / MANIFEST).read_bytes())
    for name, recorded in sorted(manifest["files"].items()):
        if file_sha256(directory / name) != recorded:
            raise CheckpointError(f"{directory / name}: sha256")
    if "base" in manifest:
        config = json.loads((directory / ADAPTER_CONFIG_FILE).read_bytes())
        tensors = load_file(str(directory / ADAPTER_FILE))
        if reuse is None or not is_lora(reuse.model) or reuse.adapter_config != config:
            raise CheckpointError("this benchmark picks an adapter up on the base it holds")
        load_adapter(reuse.model, tensors)
        if old_state_hash(reuse.model.state_dict()) != manifest["weight_hash"]:
            raise CheckpointError(f"{directory}: weight hash")
        policy = reuse
    else:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
        with torch.random.fork_rng(devices=[]):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(load_file(str(directory / MODEL_FILE)), strict=False)
        model.tie_weights()
        if old_state_hash(model.state_dict()) != manifest["weight_hash"]:
            raise CheckpointError(f"{directory}: weight hash")
        model.eval()
        policy = TransformersPolicy(model, load_tokenizer(directory))
    if OPTIMIZER_FILE in manifest["files"]:
        load_file(str(directory / OPTIMIZER_FILE))
    policy.end_sessions()
    return policy


# -- measuring ----------------------------------------------------------------------------------------------------


def _timed(action: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    gc.collect()
    started = time.perf_counter()
    result = action(*args, **kwargs)
    return time.perf_counter() - started, result


def _event(info: CheckpointInfo, version: int) -> PolicyPublished:
    return PolicyPublished(run_id="bench", producer=Producer(worker="actor_trainer", instance="bench"), role="actor",
                           version=version, step=version, checkpoint_uri=info.path.resolve().as_uri(),
                           sha256=info.manifest_sha256)


def _step(policy: TransformersPolicy, optimizer: torch.optim.Optimizer) -> None:
    """A stand-in for a trainer's update: every trainable parameter moves, the optimiser state fills."""
    for parameter in policy.model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.full_like(parameter, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_policy(size: str, policy: TransformersPolicy, root: Path, repeats: int, *, lora: bool) -> dict[str, Any]:
    """Publish and pick up `repeats` versions each way; the worker holds the previous version of its own path."""
    from pipeline.models.checkpoints import load_checkpoint

    base = None
    if lora:
        base = save_checkpoint(root / "v000000", policy)  # version 0: the full base, not timed
        policy = with_lora(load_checkpoint(base.path).policy, LoraSettings(rank=8, alpha=16))
    optimizer = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=1e-4)
    _step(policy, optimizer)
    first = save_checkpoint(root / "v000001", policy, optimizer=optimizer, base=base)
    held = {"before": load_published(_event(first, 1), "transformers"),
            "after": load_published(_event(first, 1), "transformers")}
    times: dict[str, list[float]] = {f"{what}_{path}": [] for what in ("publish", "pickup")
                                     for path in ("before", "after")}
    version = 1
    for _ in range(repeats):
        for path in ("before", "after"):
            version += 1
            _step(policy, optimizer)
            directory = root / f"v{version:06d}"
            if path == "before":
                spent, info = _timed(old_save, directory, policy, optimizer, base)
                pickup, held["before"] = _timed(old_load, info.path, info.manifest_sha256, held["before"])
            else:
                spent, info = _timed(save_checkpoint, directory, policy, optimizer=optimizer, base=base)
                pickup, held["after"] = _timed(load_published, _event(info, version), "transformers",
                                               current=held["after"])
            assert info.weight_hash == state_hash(policy.model.state_dict())
            times[f"publish_{path}"].append(spent)
            times[f"pickup_{path}"].append(pickup)
    files = sum(p.stat().st_size for p in (root / f"v{version:06d}").iterdir())
    params = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    return {**{key: min(values) for key, values in times.items()}, "bytes": files, "params": params}


def measure_synthetic(size: str, root: Path, parameters: int, repeats: int) -> dict[str, Any]:
    """A plain state dict: publish = safetensors file + its sha256 + the weight hash; pick-up = read, verify, copy."""
    from safetensors.torch import load_file, save_file

    count = 16
    rows = parameters // count // 4096
    generator = torch.Generator().manual_seed(0)
    state = {f"layers.{i:02d}.weight": torch.rand((rows, 4096), generator=generator) for i in range(count)}
    held = {name: tensor.clone() for name, tensor in state.items()}  # what the worker holds
    times: dict[str, list[float]] = {f"{what}_{path}": [] for what in ("publish", "pickup")
                                     for path in ("before", "after")}

    def publish_before(path: Path) -> tuple[str, str]:
        save_file(state, str(path), metadata={"format": "pt"})
        fsync_file(path)
        return file_sha256(path), old_state_hash(state)

    def pickup_before(path: Path, recorded: tuple[str, str]) -> dict[str, torch.Tensor]:
        if file_sha256(path) != recorded[0]:
            raise CheckpointError(f"{path}: sha256")
        loaded = load_file(str(path))
        # The new model: tensors allocated and the loaded ones copied in, as `load_state_dict` does (no random init).
        fresh = {name: torch.empty_like(tensor).copy_(tensor) for name, tensor in loaded.items()}
        if old_state_hash(fresh) != recorded[1]:
            raise CheckpointError(f"{path}: weight hash")
        return fresh

    def publish_after(path: Path) -> tuple[str, str]:
        with ThreadPoolExecutor(max_workers=1) as pool:
            hashing = pool.submit(state_hash, state)
            return write_safetensors(path, state, metadata={"format": "pt"}), hashing.result()

    def pickup_after(path: Path, recorded: tuple[str, str]) -> None:
        data = map_file(path)
        with ThreadPoolExecutor(max_workers=1) as pool:  # as `load_checkpoint` does for the weights of a version
            file_hash = pool.submit(sha256_of, data)
            tensors = safetensors_tensors(data, path)
            new_hash = state_hash(tensors)
            if file_hash.result() != recorded[0]:
                raise CheckpointError(f"{path}: sha256")
        if new_hash != recorded[1]:
            raise CheckpointError(f"{path}: weight hash")
        with torch.no_grad():
            for name, tensor in tensors.items():
                held[name].copy_(tensor)

    for repeat in range(repeats):
        for path_name, publish, pickup in (("before", publish_before, pickup_before),
                                           ("after", publish_after, pickup_after)):
            file = root / f"{path_name}-{repeat}.safetensors"
            spent, recorded = _timed(publish, file)
            taken, _ = _timed(pickup, file, recorded)
            times[f"publish_{path_name}"].append(spent)
            times[f"pickup_{path_name}"].append(taken)
            size_on_disk = file.stat().st_size
            file.unlink()
            gc.collect()
    assert all(torch.equal(held[name], state[name]) for name in state)
    return {**{key: min(values) for key, values in times.items()}, "bytes": size_on_disk,
            "params": sum(t.numel() for t in state.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 0.27B synthetic state dict; 2 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="versions each way per size (3; --quick: 2)")
    parser.add_argument("--sizes", nargs="*", default=["tiny", "smol_full", "smol_lora", "synthetic_1b"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    synthetic_params = 16 * 4096 * (4096 if args.quick else 16384)
    print(f"threads={args.threads}")
    print(f"synthetic_1b_params_measured={synthetic_params}" + (" (--quick: smaller than 1B)" if args.quick else ""))
    for size in args.sizes:
        repeats = args.repeats or (2 if args.quick else 3)
        with tempfile.TemporaryDirectory(prefix=f"handoff-{size}-") as scratch:
            root = Path(scratch)
            if size == "tiny":
                from pipeline.models import build_tiny

                result = measure_policy(size, build_tiny(TinyModelSettings()), root, repeats, lora=False)
            elif size in ("smol_full", "smol_lora"):
                from pipeline.models.presets import prepared_preset

                smol = TransformersPolicy.from_pretrained(prepared_preset("smollm2-135m-instruct"))
                result = measure_policy(size, smol, root, repeats, lora=size == "smol_lora")
                del smol
            elif size == "synthetic_1b":
                result = measure_synthetic(size, root, synthetic_params, repeats)
            else:
                raise SystemExit(f"unknown size {size!r}; valid values: tiny, smol_full, smol_lora, synthetic_1b")
        gc.collect()
        print(f"repeats_{size}={repeats}")
        print(f"params_{size}={result['params']}" + (" (trainable: the adapter)" if size == "smol_lora" else ""))
        print(f"bytes_{size}={result['bytes']}")
        for what in ("publish", "pickup"):
            before, after = result[f"{what}_before"], result[f"{what}_after"]
            print(f"{what}_s_{size}_before={before:.3f}")
            print(f"{what}_s_{size}_after={after:.3f}")
            print(f"{what}_s_{size}={after:.3f}")
            print(f"{what}_speedup_{size}={before / after:.2f}")
        print(f"handoff_s_{size}_after={result['publish_after'] + result['pickup_after']:.3f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
