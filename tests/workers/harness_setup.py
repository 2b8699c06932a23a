"""What the worker harness tests share: small settings, and a tiny policy published as a real checkpoint.

Imported by the tests of this folder (`from harness_setup import ...`; pytest puts the folder on the path)."""

from __future__ import annotations

from pathlib import Path

from tiny_models import TINY

from pipeline.models import build_tiny, save_checkpoint
from pipeline.settings import Settings
from schemas.base import Producer, Role
from schemas.training import PolicyPublished

RUN = "harness-run"


def settings_for(run_dir: Path, **sections: object) -> Settings:
    """Small, fast settings: the tiny model above, short episodes, no warm starts."""
    base: dict[str, object] = {
        "run_dir": run_dir, "run_id": RUN,
        "envs": {"tasks": [{"env_id": "MiniHack-Room-Random-5x5-v0", "max_turns": 3}], "train_pool_size": 8,
                 "eval_tasks_per_env": 2},
        "actor_trainer": {"model": {"tiny": TINY.model_dump()}, "group_size": 2, "groups_per_step": 1,
                          "warmup_steps": 0, "threads": 1, "lr": 1e-3},
        "extractor_trainer": {"model": {"tiny": TINY.model_dump()}, "buffer_size": 2, "threads": 1, "lr": 1e-3},
        "rollout": {"generation": {"max_new_tokens": 4, "micro_batch": 8}, "max_concurrent_episodes": 8},
        "extractor": {"generation": {"max_new_tokens": 24, "micro_batch": 8}, "batch_size": 4},
        "bank": {"snapshot_every": 2},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values} if isinstance(values, dict) else values  # type: ignore[dict-item]
    return Settings(**base)  # type: ignore[arg-type]


def publish_policy(tmp_path: Path, role: Role, version: int = 0, seed: int = 0) -> PolicyPublished:
    """A tiny policy saved as a verified checkpoint, and the event that publishes it."""
    path = tmp_path / "published" / f"{role}-v{version}"
    info = save_checkpoint(path, build_tiny(TINY.model_copy(update={"seed": seed})))
    return PolicyPublished(run_id=RUN, producer=Producer(worker="test", instance="test-0"), role=role,
                           version=version, step=version, checkpoint_uri=path.resolve().as_uri(),
                           sha256=info.manifest_sha256)
