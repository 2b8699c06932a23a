"""Archiver: every event of every topic into Parquet segments under `RUN_DIR/archive/<topic>/`.

    crl worker archiver --run-dir runs/demo          # follows the broker of `crl stack up --run-dir runs/demo`

It reads every partition in assign mode with its positions in the run's SQL database, buffers rows, and closes
segments every `CRL_ARCHIVER__FLUSH_ROWS` events or `CRL_ARCHIVER__FLUSH_INTERVAL_S` seconds. A segment is durable
(fsync + rename) before the offsets it covers are committed. Dead letters are archived like any other event, so
`crl audit` sees poison records too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.audit.archive import archive_root, archive_row, write_segments
from pipeline.runtime.context import WorkerContext
from pipeline.runtime.runner import Origin, Worker
from schemas.base import Event
from schemas.topics import TOPICS

log = logging.getLogger(__name__)


class Archiver(Worker):
    name = "archiver"
    consumes = TOPICS
    consumption = "assign"

    def __init__(self, root: Path, flush_rows: int = 2000, flush_interval_s: float = 2.0) -> None:
        self.root = root
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self._rows: list[dict[str, Any]] = []
        self._oldest: float | None = None
        self.segments_written = 0

    @classmethod
    def build(cls, context: WorkerContext) -> Archiver:
        settings = context.settings.archiver
        return cls(archive_root(context.run_dir), settings.flush_rows, settings.flush_interval_s)

    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        if self._oldest is None:
            self._oldest = time.monotonic()
        self._rows.append(
            archive_row(event, origin.topic, origin.partition, origin.offset, origin.timestamp_ms, origin.key,
                        origin.log_id)
        )
        return ()

    def flush_due(self, now: float) -> bool:
        if not self._rows:
            return True  # nothing buffered: offsets of dead-lettered records may be committed at once
        return len(self._rows) >= self.flush_rows or now - (self._oldest or now) >= self.flush_interval_s

    def flush(self) -> None:
        if not self._rows:
            return
        paths = write_segments(self.root, self._rows)
        self.segments_written += len(paths)
        log.info("archived %d events in %d segments", len(self._rows), len(paths))
        self._rows = []
        self._oldest = None
