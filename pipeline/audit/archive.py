"""The Parquet archive of every event: its layout and how a segment is written durably.

Layout: `RUN_DIR/archive/<topic>/<partition>-<first offset>-<last offset>-<log id>.parquet`, one row per event with
the envelope as columns, the Kafka coordinates (with the topic id of the log the offsets count in: a restarted
embedded broker starts a new log at offset 0, and its segments must not replace the old log's), and the whole event
(after upcasting) as JSON in `payload`. The record's own timestamp is kept exactly in `record_timestamp_ms` (Kafka
allows any 64-bit value; -1 means none) and as a timestamp in `record_timestamp` when it lies in years 1970-9999
(NULL otherwise), so a producer's odd clock never keeps an event out of the archive. A segment
is written to a hidden temporary file, fsynced, renamed into place and its directory fsynced, so a segment either
exists whole or not at all. The archiver commits its input offsets only after that; a crash between the rename and
the commit archives the same events again in a later segment, which the audit views remove by `event_id`.
"""

from __future__ import annotations

import os
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.runtime.durable import fsync_directory, fsync_file
from schemas.base import Event

ARCHIVE_SCHEMA = pa.schema(
    [
        ("event_id", pa.string()),
        ("kind", pa.string()),
        ("schema_version", pa.int32()),
        ("run_id", pa.string()),
        ("occurred_at", pa.timestamp("us", tz="UTC")),
        ("producer_worker", pa.string()),
        ("producer_instance", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("log_id", pa.string()),
        ("record_timestamp", pa.timestamp("ms", tz="UTC")),
        ("record_timestamp_ms", pa.int64()),
        ("record_key", pa.string()),
        ("payload", pa.string()),
    ]
)


LATEST_TIMESTAMP_MS = int(datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC).timestamp() * 1000)
"""The last record timestamp `record_timestamp` holds (Python's and most tools' datetimes end in year 9999)."""


def archive_root(run_dir: Path) -> Path:
    return run_dir / "archive"


def archive_row(event: Event, topic: str, partition: int, offset: int, timestamp_ms: int,
                key: bytes | None, log_id: str = "") -> dict[str, Any]:
    return {
        "event_id": str(event.event_id),
        "kind": event.kind,
        "schema_version": event.schema_version,
        "run_id": event.run_id,
        "occurred_at": event.occurred_at,
        "producer_worker": event.producer.worker,
        "producer_instance": event.producer.instance,
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "log_id": log_id,
        "record_timestamp": timestamp_ms if 0 <= timestamp_ms <= LATEST_TIMESTAMP_MS else None,
        "record_timestamp_ms": timestamp_ms,
        "record_key": key.decode("utf-8", errors="replace") if key is not None else None,
        "payload": event.model_dump_json(),
    }


def write_segments(root: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """Write `rows` as one durable segment per (topic, partition); returns the segment paths."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["topic"], row["partition"], row["log_id"])].append(row)
    paths = []
    for (topic, partition, log_id), group in sorted(groups.items()):
        group.sort(key=lambda row: row["offset"])
        directory = root / topic
        directory.mkdir(parents=True, exist_ok=True)
        # Same log and same offsets means the same records, so replacing such a segment (after a crash before the
        # commit) changes nothing; another log never shares a name.
        name = f"{partition:03d}-{group[0]['offset']:012d}-{group[-1]['offset']:012d}-{log_id or 'unknown-log'}"
        path = directory / f"{name}.parquet"
        temporary = directory / f".{path.name}.{os.getpid()}.tmp"
        pq.write_table(pa.Table.from_pylist(group, schema=ARCHIVE_SCHEMA), temporary, compression="zstd")
        fsync_file(temporary)
        os.replace(temporary, path)
        fsync_directory(directory)
        paths.append(path)
    return paths


def segment_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.parquet"))
