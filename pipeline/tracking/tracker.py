"""The tracker: the fold (`pipeline.tracking.fold`) in front of the backends (`pipeline.tracking.backends`), with a
ledger per backend of what it was given, so a restarted tracker, which folds the run again from offset 0, writes
each entry once.

The ledger, `<root>/tracking/<backend>.written`, holds one entry key (kind, tag, step) per line, appended and
fsynced after the backend flushed the entries. A tracker killed between the two writes those entries again when it
restarts (at least once): TensorBoard then shows two points at one step with one value.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from pipeline.tracking.backends import Backend
from pipeline.tracking.fold import Entry, RunTracking, entry_key
from schemas.base import Event


class Ledger:
    """The keys of the entries a backend has been given (and flushed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.keys: set[str] = set(path.read_text(encoding="utf-8").splitlines()) if path.exists() else set()

    def record(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        with self.path.open("a", encoding="utf-8") as file:
            file.write("".join(f"{key}\n" for key in keys))
            file.flush()
            os.fsync(file.fileno())
        self.keys.update(keys)


class Tracker:
    """Feed it events with `add`; `flush` writes what became final to every backend."""

    def __init__(self, backends: Sequence[Backend], root: Path, run_id: str | None = None,
                 samples_per_step: int = 2) -> None:
        self.backends = list(backends)
        self.tracking = RunTracking(run_id, samples_per_step)
        self.ledgers = {backend.name: Ledger(root / "tracking" / f"{backend.name}.written") for backend in backends}
        self.pending: list[Entry] = []
        self.written = 0
        """Entries given to the backends by this tracker (over all backends)."""

    def add(self, event: Event, offset: int) -> None:
        self.pending += self.tracking.add(event, offset)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for backend in self.backends:
            ledger = self.ledgers[backend.name]
            new = [entry for entry in pending if entry_key(entry) not in ledger.keys]
            if new:
                backend.write(new)
            backend.flush()
            ledger.record([entry_key(entry) for entry in new])
            self.written += len(new)

    def close(self) -> None:
        self.flush()
        for backend in self.backends:
            backend.close()
