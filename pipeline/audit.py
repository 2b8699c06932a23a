"""Read-only DuckDB over a run's Parquet archive.

    crl audit sql runs/demo "SELECT kind, count(*) FROM events GROUP BY kind"
    crl audit events runs/demo --kind TrajectoryCompleted --limit 5

Views:
- `events`: every archived event once (deduplicated by `event_id`: a crash between writing a segment and committing
  its offsets archives events twice), with the envelope as columns and the whole event as JSON in `payload`;
- one view per event kind, named in snake case (`trajectory_completed`, `dead_letter`, ...), with the envelope, the
  Kafka coordinates and every field of the event as a column (scalars typed, nested values as JSON).

The connection is locked down after the views are made: only SELECT and EXPLAIN statements run, and DuckDB may read
nothing outside the archive directory and write nothing at all.
"""

from __future__ import annotations

import datetime
import types
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import duckdb

from pipeline.archive import ARCHIVE_SCHEMA, archive_root, segment_files
from schemas.base import Event, snake_case
from schemas.topics import EVENT_TYPES

ALLOWED_STATEMENTS = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}

_ARROW_TO_SQL = {"string": "VARCHAR", "int32": "INTEGER", "int64": "BIGINT"}
_ENVELOPE_COLUMNS = (
    "event_id", "run_id", "occurred_at", "producer_worker", "producer_instance", "topic", "partition", "offset",
)


class AuditQueryError(ValueError):
    """The statement is not allowed or DuckDB rejected it."""


def sql_type(annotation: Any) -> str | None:
    """DuckDB type for a pydantic field annotation, or None when the value is kept as JSON."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return sql_type(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        members = [arg for arg in get_args(annotation) if arg is not type(None)]
        return sql_type(members[0]) if len(members) == 1 else None
    if origin is Literal:
        return sql_type(type(get_args(annotation)[0]))
    if annotation is bool:
        return "BOOLEAN"
    if annotation is int:
        return "BIGINT"
    if annotation is float:
        return "DOUBLE"
    if annotation in (str, uuid.UUID):
        return "VARCHAR"
    if annotation is datetime.datetime:
        return "TIMESTAMPTZ"
    return None


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def kind_view_sql(event_type: type[Event]) -> str:
    """`SELECT` for the per-kind view of `event_type` over the `events` view."""
    columns = [_quote(name) for name in _ENVELOPE_COLUMNS]
    for name in event_type.payload_fields():
        path = _sql_string(f"$.{name}")
        kind = sql_type(event_type.model_fields[name].annotation)
        if kind is None:
            columns.append(f"payload -> {path} AS {_quote(name)}")
        elif kind == "VARCHAR":
            columns.append(f"payload ->> {path} AS {_quote(name)}")
        else:
            # TRY_CAST: one odd value must not make the whole view unreadable (it shows as NULL; `payload` has it).
            columns.append(f"TRY_CAST(payload ->> {path} AS {kind}) AS {_quote(name)}")
    return f"SELECT {', '.join(columns)} FROM events WHERE kind = {_sql_string(event_type.__name__)}"


def _empty_archive_sql() -> str:
    columns = []
    for column in ARCHIVE_SCHEMA:
        if column.name == "payload":
            columns.append("CAST(NULL AS JSON) AS payload")
        elif str(column.type).startswith("timestamp"):
            columns.append(f"CAST(NULL AS TIMESTAMPTZ) AS {_quote(column.name)}")
        else:
            columns.append(f"CAST(NULL AS {_ARROW_TO_SQL[str(column.type)]}) AS {_quote(column.name)}")
    return f"SELECT {', '.join(columns)} WHERE false"


class Audit:
    """A read-only DuckDB connection with the audit views over `run_dir`'s archive."""

    def __init__(self, run_dir: Path) -> None:
        self.root = archive_root(run_dir).resolve()
        self.connection = duckdb.connect(":memory:")
        if segment_files(self.root):
            pattern = _sql_string(str(self.root / "*" / "*.parquet"))
            source = (
                "SELECT * EXCLUDE (payload, duplicate_rank), payload::JSON AS payload FROM ("
                "SELECT *, row_number() OVER (PARTITION BY event_id ORDER BY topic, partition, log_id, \"offset\")"
                f" AS duplicate_rank FROM read_parquet({pattern}, union_by_name = true)"
                ") WHERE duplicate_rank = 1"
            )
        else:
            source = _empty_archive_sql()
        self.connection.execute(f"CREATE VIEW events AS {source}")
        for kind, event_type in sorted(EVENT_TYPES.items()):
            self.connection.execute(f"CREATE VIEW {_quote(snake_case(kind))} AS {kind_view_sql(event_type)}")
        self.connection.execute(f"SET allowed_directories = [{_sql_string(str(self.root) + '/')}]")
        self.connection.execute("SET enable_external_access = false")
        self.connection.execute("SET lock_configuration = true")

    @staticmethod
    def view_names() -> list[str]:
        return ["events"] + sorted(snake_case(kind) for kind in EVENT_TYPES)

    def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only statement; returns (column names, rows)."""
        try:
            statements = self.connection.extract_statements(sql)
        except duckdb.Error as exc:
            raise AuditQueryError(str(exc)) from exc
        if len(statements) != 1:
            raise AuditQueryError(f"expected exactly one statement, got {len(statements)}")
        if statements[0].type not in ALLOWED_STATEMENTS:
            raise AuditQueryError(f"only SELECT / EXPLAIN statements are allowed (got {statements[0].type.name})")
        try:
            cursor = self.connection.execute(sql)
            rows = cursor.fetchall()
        except duckdb.Error as exc:
            raise AuditQueryError(str(exc)) from exc
        return [column[0] for column in cursor.description], rows

    def recent_events(self, kind: str | None = None, limit: int = 20) -> tuple[list[str], list[tuple[Any, ...]]]:
        if kind is not None and kind not in EVENT_TYPES:
            raise AuditQueryError(f"unknown kind {kind!r}; known kinds: {', '.join(sorted(EVENT_TYPES))}")
        where = f"WHERE kind = {_sql_string(kind)}" if kind else ""
        return self.query(
            "SELECT occurred_at, kind, topic, partition, \"offset\", event_id, producer_worker, "
            f"left(CAST(payload AS VARCHAR), 120) AS payload FROM events {where} "
            f"ORDER BY occurred_at, topic, partition, \"offset\" LIMIT {int(limit)}"
        )

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Audit:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
