"""`crl track`: a run's archive through the tracker, so a run that had no tracker (or another backend) loads into
one with the entries a live tracker would have written (`pipeline.tracking.fold` does not depend on the order
across topics; within a partition the archive gives the log's order)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import duckdb

from pipeline.audit.archive import archive_root, segment_files
from pipeline.errors import ConfigError
from pipeline.tracking.backends import open_backends
from pipeline.tracking.settings import TrackerSettings
from pipeline.tracking.tracker import Tracker
from schemas.base import Event
from schemas.codec import DEFAULT_MAX_PAYLOAD_BYTES, EventDecodeError, decode
from schemas.runs import RunStarted
from schemas.topics import TOPICS


def archived_events(run_dir: Path, batch: int = 500,
                    undecodable: Counter[str] | None = None) -> Iterator[tuple[Event, int]]:
    """Every archived record as (event, offset), per topic and partition in offset order. A record archived twice
    (in two segments, or in the log a restored broker continued) comes twice, as a consumer would have read a
    retry: the fold counts the first. Rows that do not decode (an older schema no upcaster knows) are skipped, as
    the live tracker's runner dead-letters them, and counted by topic in `undecodable` when given."""
    files = segment_files(archive_root(run_dir))
    if not files:
        raise ConfigError(f"{run_dir} has no archive (no Parquet segments under {archive_root(run_dir)})")
    topics = {topic.name: topic for topic in TOPICS}
    listing = ", ".join("'" + str(path).replace("'", "''") + "'" for path in files)
    connection = duckdb.connect()
    try:
        cursor = connection.execute(
            f"SELECT topic, \"offset\", payload FROM read_parquet([{listing}]) "
            "ORDER BY topic, partition, \"offset\", log_id")
        while rows := cursor.fetchmany(batch):
            for topic, offset, payload in rows:
                if topic not in topics:
                    continue
                data = payload.encode()
                try:
                    # The archive keeps each event whole, claim-checked arrays included: no payload cap applies.
                    event = decode(topics[topic], data, max_bytes=max(len(data), DEFAULT_MAX_PAYLOAD_BYTES))
                except EventDecodeError:
                    if undecodable is not None:
                        undecodable[topic] += 1
                    continue
                yield event, offset
    finally:
        connection.close()


def _run_started(run_dir: Path) -> RunStarted:
    for event, _ in archived_events(run_dir):
        if isinstance(event, RunStarted):
            return event
    raise ConfigError(f"the archive of {run_dir} has no RunStarted: it is not a run's archive, or the run never "
                      "started")


def track_archive(run_dir: Path, backends: Sequence[str], out: Path, settings: TrackerSettings,
                  undecodable: Counter[str] | None = None) -> Tracker:
    """Write the entries of `run_dir`'s archive to `backends` under `out` (the run directory itself, or another);
    entries the ledgers under `out` already list are not written again. Returns the closed tracker. Archived rows
    that do not decode are counted by topic in `undecodable`."""
    started = _run_started(run_dir)
    opened = open_backends(backends, out, started.run_id, started.config, settings)
    tracker = Tracker(opened, out, started.run_id, settings.samples_per_step)
    try:
        for event, offset in archived_events(run_dir, undecodable=undecodable):
            tracker.add(event, offset)
    finally:
        tracker.close()
    return tracker
