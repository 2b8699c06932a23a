"""Warm starts before and after the speed work, side by side in one run: float32 as the code was against bfloat16
autocast as it is; their time, their losses and their gates.

    python benchmarks/warm_start_precision.py                    # configs/smol-signpost-corridor.yaml, both roles
    python benchmarks/warm_start_precision.py --quick            # 6 steps per role, no gate (~3 minutes)
    python benchmarks/warm_start_precision.py --config configs/smol-minihack-room.yaml --roles actor

Each role of the config whose warm start is on is warm-started twice from the same initial weights and the same
data, without a cache, at the trainer's thread count, `before` first:
- `before`: float32, with `fine_tune` as it was, re-implemented here step for step (`old_fine_tune`: AdamW's loop of
  elementwise ops, deterministic mode filling every new tensor, autocast off);
- `after`: `precision` bfloat16, `pipeline.rl.warm_start.fine_tune` as it is (autocast on the float32 weights, fused
  AdamW, no fills), what a role whose trainer sets `model.precision: bfloat16` now runs.
The data episodes are played again for each (as a run from an empty cache does); the gate, where the config sets
one, is checked on each result.

Prints per role: `warm_start_s_<role>_before/after` (data, training and gate), `train_s_<role>_before/after` (the
optimiser steps alone), `warm_start_speedup_<role>` and `train_speedup_<role>` (before over after),
`loss_first_<role>_before/after`, `loss_last_<role>_before/after`, `loss_mean_abs_diff_<role>` (the two loss curves,
step by step), `gate_<role>_before/after=passed|MISSED|none` with its checks, and `weights_differ_<role>`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _recorder() -> tuple[Callable[..., None], dict[str, Any]]:
    """A progress callback that notes when training started and ended and every step's loss (`fine_tune` reports
    step 0, then each step with its loss)."""
    marks: dict[str, Any] = {"losses": []}

    def progress(phase: str, done: int, total: int, **fields: Any) -> None:
        if phase == "train":
            if done == 0:
                marks["train_start"] = time.perf_counter()
            else:
                marks["losses"].append(fields["loss"])
            if done == total:
                marks["train_end"] = time.perf_counter()

    return progress, marks


def old_fine_tune(policy: Any, samples: Any, *, steps: int, batch_size: int, lr: float, seed: int, system: str,
                  progress: Any, precision: str = "float32") -> list[float]:
    """`pipeline.rl.warm_start.fine_tune` as it was: float32 (`precision` ignored), AdamW with `foreach=False`,
    deterministic mode's fills on."""
    import random

    import torch

    from pipeline.rl.policy_step import make_optimizer

    rng = random.Random(seed)
    encoded = [(policy.prompt_ids(prompt, system), policy.response_ids(response)) for prompt, response in samples]
    optimizer = make_optimizer(policy.model, lr, 0.0, (0.9, 0.999), 1e-8)
    policy.model.train()
    losses: list[float] = []
    progress("train", 0, steps)
    for _ in range(steps):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        tokens = sum(len(response) for _, response in batch)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for start in range(0, len(batch), policy.micro_batch_size):
            chunk = batch[start:start + policy.micro_batch_size]
            logprobs = policy.token_logprobs([p for p, _ in chunk], [r for _, r in chunk])
            loss = -torch.cat(logprobs).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        optimizer.step()
        losses.append(total)
        progress("train", len(losses), steps, loss=total)
    policy.model.eval()
    return losses


def warm_start(settings: Any, role: str, arm: str, steps: int | None, gate: bool) -> dict[str, Any]:
    from pipeline.models.checkpoints import weight_hash
    from pipeline.rl import warm_start as module
    from pipeline.rl.policy_step import deterministic_torch
    from pipeline.rl.trainer import initial_policy
    from pipeline.rl.warm_start import warm_start_actor, warm_start_extractor

    trainer = settings.trainer(role)
    update: dict[str, Any] = {"cache_dir": None}
    if steps is not None:
        update["steps"] = steps
    if not gate:
        update["gate"] = None
    warm = trainer.warm_start.model_copy(update=update)
    deterministic_torch(trainer.threads)
    progress, marks = _recorder()
    started = time.perf_counter()
    policy = initial_policy(trainer.model)
    precision = "float32" if arm == "before" else "bfloat16"
    current = module.fine_tune
    if arm == "before":
        module.fine_tune = old_fine_tune  # type: ignore[assignment]
    try:
        if role == "actor":
            policy, stats = warm_start_actor(policy, warm, settings.envs.tasks, settings.envs, settings.rollout,
                                             progress, precision=precision)
        else:
            policy, stats = warm_start_extractor(policy, warm, settings.envs.tasks, settings.envs, settings.extractor,
                                                 progress, merges=settings.scheduler.merge_every > 0,
                                                 precision=precision)
    finally:
        module.fine_tune = current
    return {"seconds": time.perf_counter() - started, "train_s": marks["train_end"] - marks["train_start"],
            "losses": marks["losses"], "gate": stats.get("gate"), "passed": stats.get("gate_passed"),
            "weights": weight_hash(policy.model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "smol-signpost-corridor.yaml")
    parser.add_argument("--roles", nargs="+", default=["actor", "extractor"], choices=["actor", "extractor"])
    parser.add_argument("--steps", type=int, default=None, help="Optimiser steps per warm start (the config's).")
    parser.add_argument("--quick", action="store_true", help="6 steps per role, no gate.")
    args = parser.parse_args()
    from pipeline.settings import Settings

    settings = Settings(config=args.config)
    steps = 6 if args.quick and args.steps is None else args.steps
    print(f"config={args.config}")
    for role in args.roles:
        trainer = settings.trainer(role)
        if trainer.warm_start.steps == 0:
            print(f"warm_start_{role}=off")
            continue
        result = {arm: warm_start(settings, role, arm, steps, gate=not args.quick) for arm in ("before", "after")}
        print(f"steps_{role}={len(result['before']['losses'])}")
        for arm, found in result.items():
            print(f"warm_start_s_{role}_{arm}={found['seconds']:.1f}")
            print(f"train_s_{role}_{arm}={found['train_s']:.1f}")
        print(f"warm_start_speedup_{role}={result['before']['seconds'] / result['after']['seconds']:.2f}")
        print(f"train_speedup_{role}={result['before']['train_s'] / result['after']['train_s']:.2f}")
        for arm, found in result.items():
            print(f"loss_first_{role}_{arm}={found['losses'][0]:.4f}")
            print(f"loss_last_{role}_{arm}={found['losses'][-1]:.4f}")
        pairs = list(zip(result["before"]["losses"], result["after"]["losses"], strict=True))
        print(f"loss_mean_abs_diff_{role}={sum(abs(a - b) for a, b in pairs) / len(pairs):.4f}")
        for arm, found in result.items():
            if found["gate"] is None:
                print(f"gate_{role}_{arm}=none")
                continue
            checks = ", ".join(f"{c['name'][4:]} {c['value']:.3f} ({c['samples']})" for c in found["gate"])
            print(f"gate_{role}_{arm}={'passed' if found['passed'] else 'MISSED'}  # {checks}")
        print(f"weights_differ_{role}={result['before']['weights'] != result['after']['weights']}", flush=True)


if __name__ == "__main__":
    main()
