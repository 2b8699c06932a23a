"""Which worker processes a run needs, in which order they start and stop, and where the run lives.

The grpo arm has no experience bank, so it starts no bank, extractor or extractor trainer. Workers start consumers
first (archiver, bank, trainers, extractor, rollout) and the scheduler, the run's clock, last; they stop in the
reverse order, the archiver last, so it archives what the others published while stopping.
"""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.settings import Settings

BANK_WORKERS = ("bank", "extractor", "extractor_trainer")
"""Workers only an arm with an experience bank needs (every arm but `grpo`)."""
START_ORDER = ("archiver", "bank", "actor_trainer", "extractor_trainer", "extractor", "rollout", "scheduler")
STOP_ORDER = ("scheduler", "rollout", "extractor", "extractor_trainer", "actor_trainer", "bank", "archiver")


def worker_plan(settings: Settings) -> list[tuple[str, str]]:
    """(kind, instance) of every worker process the run needs, in start order."""
    counts = {"rollout": settings.launch.rollout_workers, "extractor": settings.launch.extractor_workers}
    plan = []
    for kind in START_ORDER:
        if settings.scheduler.arm == "grpo" and kind in BANK_WORKERS:
            continue
        plan += [(kind, f"{kind}-{i}") for i in range(counts.get(kind, 1))]
    return plan


def default_run_dir(config: Path) -> Path:
    return Path("runs") / f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run directory {run_dir} is not empty: a run starts from an empty directory; "
                          "pick another --run-dir")
