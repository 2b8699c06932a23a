"""The worker processes of a run: each a `crl worker` subprocess in its own session (a terminal Ctrl-C reaches only
`crl run`), tied to the supervisor with PR_SET_PDEATHSIG, logging under `logs/`, listed in `workers.json`, and the
metrics lines each writes under `metrics/`, from which the live view and the drain rule read lag."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class WorkerProcess:
    kind: str
    instance: str
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def last_metrics(run_dir: Path, instance: str, count: int = 2) -> list[dict[str, Any]]:
    """The last `count` metrics lines the worker wrote (`metrics/<instance>.jsonl`)."""
    path = run_dir / "metrics" / f"{instance}.jsonl"
    if not path.exists():
        return []
    with path.open("rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - 16384))
        lines = handle.read().decode("utf-8", "replace").splitlines()
    if size > 16384:
        lines = lines[1:]  # the first line read may be a partial one
    parsed: list[dict[str, Any]] = []
    for line in lines[-count:]:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return parsed
