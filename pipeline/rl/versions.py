"""Where a trainer's versions live on disk and the ids of the events that announce them, without torch: what
`pipeline.rl.trainer` writes and what a restore of the log (`pipeline.run.restore`) checks.

    checkpoints/<role>/v000000/   version 0, then one directory per version
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from schemas.base import Role

_EVENT_NAMESPACE = uuid.UUID("5d3c8a4e-8f57-4f7e-9a43-6a1f0f2b7c11")
_VERSION_DIR = re.compile(r"^v(\d{6})$")


def checkpoints_root(run_dir: Path, role: Role) -> Path:
    return run_dir / "checkpoints" / role


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


def versions_in(root: Path) -> list[int]:
    """The version numbers of the checkpoint directories under `root`, ascending."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _VERSION_DIR.match(p.name)))


def event_id_for(run_id: str, role: Role, version: int, what: str) -> uuid.UUID:
    """Deterministic event id of a version's `PolicyPublished` (`what="policy"`) / `TrainStepCompleted`
    (`what="train-step"`)."""
    return uuid.uuid5(_EVENT_NAMESPACE, f"{run_id}/{role}/{version}/{what}")
