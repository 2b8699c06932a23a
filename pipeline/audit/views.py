"""Read-only DuckDB over a run's Parquet archive.

    crl audit sql runs/demo "SELECT kind, count(*) FROM events GROUP BY kind"
    crl audit events runs/demo --kind TrajectoryCompleted --limit 5
    crl audit experience runs/demo exp-1

Views:
- `events`: every archived event once (deduplicated by `event_id`: a crash between writing a segment and committing
  its offsets archives events twice), with the envelope as columns and the whole event as JSON in `payload`;
- one view per event kind, named in snake case (`trajectory_completed`, `dead_letter`, ...), with the envelope, the
  Kafka coordinates and every field of the event as a column (scalars typed, nested values as JSON).

Run views (`RUN_VIEWS`), plain SQL over the per-kind views, one row per event, for curves and reports:
- `trajectories`: one row per TrajectoryCompleted: trajectory_id, step, split, env_id, task_family, seed, group_id,
  slot, guided, success, reward, num_actions, invalid_actions, truncated, turns (count), response_tokens (over all
  turns), policy_version, bank_offset, served (JSON list of the experience ids in `retrieved`), generation_s, env_s,
  retrieval_s, score (the environment's own, where it keeps one), env_error (why its engine failed it; NULL when it
  ran to its end), occurred_at;
- `family_success`: one row per (step, split, task_family, guided): episodes, successes, success_rate, mean_score,
  engine_failures — the per-family curves of a mixture;
- `train_steps`: one row per TrainStepCompleted: role, step, policy_version, loss, tokens, batch_size (batch events),
  dropped (events dropped at the timeout), timed_out, loss_variant, aggregation, weight_hash_before,
  weight_hash_after, clip_fraction (`train/clip_fraction`), reward_mean (`rollout/reward_mean` for the actor,
  `extractor/reward_mean` for the extractor), success_guided (`rollout/success_guided`), success_free
  (`rollout/success_free`), metrics (JSON, every metric), occurred_at; a metric the step did not record is NULL;
- `policy_versions`: one row per PolicyPublished: role, version, step, checkpoint_uri, sha256, published_at, and the
  loss and weight_hash_after of the TrainStepCompleted with the same role and policy_version (NULL for version 0,
  the initial checkpoint).

Experience views, made by replaying the op log the first time a query reads one of them (the same `replay` as `crl
replay bank`, over the records of the most recently written op log in the archive, which is the log `crl replay bank`
picks when the bank has no live position; the log's id is `Audit.op_log_id`). DuckDB cannot run the bank's rules, and a
replay agrees with the bank by construction: rejected ops (version conflicts, retired or unknown targets) and repeated
op ids are in none of them but `experience_ops`, which lists the log itself. An archive without ops gives empty views.
The replay runs at most once per `Audit` (about a second per 10,000 ops), and not at all for queries that do not name
these views; they are listed in `EXPERIENCE_VIEWS`, apart from `Audit.view_names()`.
- `experience_history`: one row per version of an experience, in log order: experience_id, version, text, op_kind,
  op_id, op_offset (offset in crl.experience-ops), generation_id, extractor_version, source_trajectory_ids (JSON,
  the trajectories this op read), occurred_at (of the op). Adds and merges make version 1, refines the next one;
  retirements make no version (see `experiences`);
- `experiences`: the bank's current state, one row per experience: experience_id, task_family, version, status,
  text, merged_into, parents (JSON), generation_id, extractor_version, retired_reason ("merged" for a merge's
  sources), source_trajectory_ids (JSON), retrievals (TrajectoryCompleted events that list it in `retrieved`),
  guided_successes, guided_failures (of those episodes), retired_op_id, retired_offset (the op that retired it);
- `experience_lineage`: one row per source of an applied merge: source_id, merged_id, source_version (the version
  merged), op_id, op_offset;
- `experience_usage`: one row per (trajectory, served experience) from `trajectory_completed.retrieved`:
  trajectory_id, experience_id, version (served), generation_id, bank_offset, step, env_id, task_family, success,
  reward, num_actions, policy_version, occurred_at;
- `experience_ops`: one row per record of the replayed op log, applied or not, in log order: op_offset, op_id,
  op_kind, generation_id, step. The step is that of the `ExtractionGenerated` with the op's generation id; an op
  without one (capacity evictions have no generation, older generations no step) takes the step of the op before it
  in the log, or 0 at the start of the log. Joined on `op_offset` to `experience_history` or to
  `experiences.retired_offset`, it gives the step of every applied op (the bank figure of `crl report`).

The connection is locked down after the views are made: only SELECT and EXPLAIN statements run, and DuckDB may read
nothing outside the archive directory and write nothing at all.
"""

from __future__ import annotations

import datetime
import json
import types
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import duckdb
import pyarrow as pa

from pipeline.audit.archive import ARCHIVE_SCHEMA, archive_root, segment_files
from pipeline.bank.state import BankState, ExperienceOp, decode_op
from pipeline.errors import AuditQueryError
from schemas.base import Event, snake_case
from schemas.topics import EVENT_TYPES, EXPERIENCE_OPS_TOPIC

ALLOWED_STATEMENTS = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
CATALOGUE_WORDS = ("show", "describe", "information_schema", "duckdb_views", "duckdb_tables", "duckdb_columns")
"""Queries that list the views: the experience views are made (the bank replayed) before them, so they list those
too (`SHOW TABLES`)."""

_ARROW_TO_SQL = {"string": "VARCHAR", "int32": "INTEGER", "int64": "BIGINT"}
_ENVELOPE_COLUMNS = (
    "event_id", "run_id", "occurred_at", "producer_worker", "producer_instance", "topic", "partition", "offset",
)


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


# -- run views ------------------------------------------------------------------------------------------------------

RUN_VIEWS = ("trajectories", "family_success", "train_steps", "policy_versions")


def _metric(name: str) -> str:
    """A `metrics` entry of TrainStepCompleted as DOUBLE (NULL when the step did not record it)."""
    path = _sql_string('$."' + name + '"')
    return f"TRY_CAST(metrics ->> {path} AS DOUBLE)"


def _timing(name: str) -> str:
    path = _sql_string(f"$.{name}")
    return f"TRY_CAST(timings ->> {path} AS DOUBLE) AS {name}"


RUN_VIEW_SQL = {
    # Token ids are base64 of int32 on the wire (schemas/arrays.py): 4 bytes per token.
    "trajectories": (
        "SELECT trajectory_id, step, split, env_id, task_family, seed, group_id, slot, guided, success, reward, "
        "num_actions, invalid_actions, truncated, coalesce(json_array_length(turns), 0) AS turns, "
        "coalesce(list_sum(list_transform(json_extract_string(turns, '$[*].response_token_ids'), "
        "lambda ids: octet_length(from_base64(ids)) // 4)), 0) AS response_tokens, policy_version, bank_offset, "
        "coalesce(to_json(json_extract_string(retrieved, '$[*].experience_id')), '[]'::JSON) AS served, "
        f"{_timing('generation_s')}, {_timing('env_s')}, {_timing('retrieval_s')}, score, env_error, occurred_at "
        "FROM trajectory_completed ORDER BY step, split, group_id, slot, trajectory_id"
    ),
    "family_success": (
        "SELECT step, split, task_family, guided, count(*) AS episodes, sum(success::INTEGER) AS successes, "
        "avg(success::INTEGER) AS success_rate, avg(score) AS mean_score, count(env_error) AS engine_failures "
        "FROM trajectories GROUP BY ALL ORDER BY ALL"
    ),
    "train_steps": (
        "SELECT role, step, policy_version, loss, tokens, json_array_length(batch_event_ids) AS batch_size, "
        "coalesce(json_array_length(dropped_event_ids), 0) AS dropped, timed_out, loss_variant, aggregation, "
        f"weight_hash_before, weight_hash_after, {_metric('train/clip_fraction')} AS clip_fraction, "
        f"CASE role WHEN 'extractor' THEN {_metric('extractor/reward_mean')} "
        f"ELSE {_metric('rollout/reward_mean')} END AS reward_mean, "
        f"{_metric('rollout/success_guided')} AS success_guided, {_metric('rollout/success_free')} AS success_free, "
        "metrics, occurred_at FROM train_step_completed ORDER BY role, step, occurred_at"
    ),
    # One row per PolicyPublished: a re-recorded step (same role and version) joins once, its first record.
    "policy_versions": (
        "SELECT published.role, published.version, published.step, published.checkpoint_uri, published.sha256, "
        "published.occurred_at AS published_at, trained.loss, trained.weight_hash_after "
        "FROM policy_published AS published LEFT JOIN ("
        "SELECT DISTINCT ON (role, policy_version) role, policy_version, loss, weight_hash_after "
        "FROM train_step_completed ORDER BY role, policy_version, occurred_at, event_id"
        ") AS trained ON trained.role = published.role AND trained.policy_version = published.version "
        "ORDER BY published.role, published.version, published.occurred_at"
    ),
}


# -- experience views -----------------------------------------------------------------------------------------------

EXPERIENCE_VIEWS = ("experience_history", "experiences", "experience_lineage", "experience_usage", "experience_ops")

_REPLAYED_TABLES = {
    "versions": pa.schema([
        ("experience_id", pa.string()), ("version", pa.int64()), ("text", pa.string()), ("op_kind", pa.string()),
        ("op_id", pa.string()), ("op_offset", pa.int64()), ("generation_id", pa.string()),
        ("extractor_version", pa.int64()), ("source_trajectory_ids", pa.string()),
        ("occurred_at", pa.timestamp("us", tz="UTC")),
    ]),
    "experiences": pa.schema([
        ("experience_id", pa.string()), ("task_family", pa.string()), ("version", pa.int64()), ("status", pa.string()),
        ("text", pa.string()), ("merged_into", pa.string()), ("parents", pa.string()), ("generation_id", pa.string()),
        ("extractor_version", pa.int64()), ("retired_reason", pa.string()), ("source_trajectory_ids", pa.string()),
        ("retired_op_id", pa.string()), ("retired_offset", pa.int64()),
    ]),
    "lineage": pa.schema([
        ("source_id", pa.string()), ("merged_id", pa.string()), ("source_version", pa.int64()),
        ("op_id", pa.string()), ("op_offset", pa.int64()),
    ]),
    "ops": pa.schema([
        ("op_offset", pa.int64()), ("op_id", pa.string()), ("op_kind", pa.string()), ("generation_id", pa.string()),
    ]),
}

# One row per (TrajectoryCompleted, served experience); `event_id` lets counts ignore an id listed twice.
_SERVED_SQL = (
    "SELECT event_id, trajectory_id, served.experience_id AS experience_id, served.version AS version, "
    "served.generation_id AS generation_id, bank_offset, step, env_id, task_family, success, reward, num_actions, "
    "policy_version, occurred_at FROM (SELECT *, unnest(from_json(retrieved, "
    "'[{\"experience_id\": \"VARCHAR\", \"version\": \"BIGINT\", \"generation_id\": \"VARCHAR\"}]')) AS served "
    "FROM trajectory_completed)"
)

EXPERIENCE_VIEW_SQL = {
    "experience_history": (
        "SELECT experience_id, version, text, op_kind, op_id, op_offset, generation_id, extractor_version, "
        "source_trajectory_ids::JSON AS source_trajectory_ids, occurred_at FROM replayed_bank.versions "
        "ORDER BY op_offset"
    ),
    "experiences": (
        "SELECT bank.experience_id, task_family, version, status, text, merged_into, parents::JSON AS parents, "
        "generation_id, extractor_version, retired_reason, source_trajectory_ids::JSON AS source_trajectory_ids, "
        "coalesce(served.retrievals, 0) AS retrievals, coalesce(served.guided_successes, 0) AS guided_successes, "
        "coalesce(served.guided_failures, 0) AS guided_failures, retired_op_id, retired_offset "
        "FROM replayed_bank.experiences AS bank LEFT JOIN ("
        "SELECT experience_id, count(DISTINCT event_id) AS retrievals, "
        "count(DISTINCT event_id) FILTER (WHERE success) AS guided_successes, "
        "count(DISTINCT event_id) FILTER (WHERE NOT success) AS guided_failures "
        f"FROM ({_SERVED_SQL}) GROUP BY experience_id"
        ") AS served ON served.experience_id = bank.experience_id ORDER BY bank.experience_id"
    ),
    "experience_lineage": (
        "SELECT source_id, merged_id, source_version, op_id, op_offset FROM replayed_bank.lineage "
        "ORDER BY op_offset, source_id"
    ),
    "experience_usage": (
        "SELECT trajectory_id, experience_id, version, generation_id, bank_offset, step, env_id, task_family, "
        f"success, reward, num_actions, policy_version, occurred_at FROM ({_SERVED_SQL}) "
        "ORDER BY step, occurred_at, trajectory_id, experience_id"
    ),
    # A generation's step is its first ExtractionGenerated's; an op without one inherits the last step before it.
    "experience_ops": (
        "SELECT op.op_offset, op.op_id, op.op_kind, op.generation_id, coalesce(last_value(generated.step IGNORE NULLS) "
        "OVER (ORDER BY op.op_offset ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW), 0) AS step "
        "FROM replayed_bank.ops AS op LEFT JOIN ("
        "SELECT generation_id, min(step) AS step FROM extraction_generated GROUP BY generation_id"
        ") AS generated ON generated.generation_id = op.generation_id ORDER BY op.op_offset"
    ),
}


def _json_list(values: Sequence[str]) -> str:
    """Compact, like the JSON in `payload`, so equal lists compare equal as text."""
    return json.dumps(list(values), separators=(",", ":"))


def replayed_tables(state: BankState, ops: dict[int, ExperienceOp]) -> dict[str, list[dict[str, Any]]]:
    """Rows of the `replayed_bank` tables from a replayed `state`; `ops` maps every replayed offset to its op (every
    record of the log, applied or not: each is a row of `ops`)."""
    versions, experiences, lineage = [], [], []
    for experience_id in sorted(state.experiences):
        experience = state.experiences[experience_id]
        for version in experience.history:
            versions.append({
                "experience_id": experience_id, "version": version.version, "text": version.text,
                "op_kind": version.op_kind, "op_id": version.op_id, "op_offset": version.op_offset,
                "generation_id": version.generation_id, "extractor_version": version.extractor_version,
                "source_trajectory_ids": _json_list(version.source_trajectory_ids),
                "occurred_at": ops[version.op_offset].occurred_at,
            })
        # Retiring is the last thing that can happen to an experience, so its op is the last one that touched it.
        retired_offset = experience.op_offsets[-1] if not experience.active else None
        experiences.append({
            "experience_id": experience_id, "task_family": experience.task_family, "version": experience.version,
            "status": experience.status, "text": experience.text, "merged_into": experience.merged_into,
            "parents": _json_list(experience.parents), "generation_id": experience.generation_id,
            "extractor_version": experience.extractor_version, "retired_reason": experience.retired_reason,
            "source_trajectory_ids": _json_list(experience.source_trajectory_ids),
            "retired_op_id": ops[retired_offset].op_id if retired_offset is not None else None,
            "retired_offset": retired_offset,
        })
        created = experience.history[0]
        for parent in experience.parents:
            # A merged source is retired, so its final version is the one that was merged.
            lineage.append({"source_id": parent, "merged_id": experience_id,
                            "source_version": state.experiences[parent].version, "op_id": created.op_id,
                            "op_offset": created.op_offset})
    records = [{"op_offset": offset, "op_id": op.op_id, "op_kind": op.kind,
                "generation_id": op.generation_id} for offset, op in sorted(ops.items())]
    return {"versions": versions, "experiences": experiences, "lineage": lineage, "ops": records}


@dataclass(frozen=True)
class ExperienceRecord:
    """Everything the audit views know about one experience (rows as column -> value dicts)."""

    state: dict[str, Any]
    """Its `experiences` row."""
    versions: list[dict[str, Any]]
    """Its `experience_history` rows, oldest first."""
    merged_from: list[dict[str, Any]]
    """`experience_lineage` rows of the merge that made it (empty unless it came from a merge)."""
    merged_into: dict[str, Any] | None
    """The `experience_lineage` row of the merge it went into, if any."""
    episodes: list[dict[str, Any]]
    """Its `experience_usage` rows: the episodes it guided, in step order."""

    @property
    def successes(self) -> int:
        return sum(1 for episode in self.episodes if episode["success"])

    @property
    def success_rate(self) -> float | None:
        return self.successes / len(self.episodes) if self.episodes else None

    @property
    def mean_reward(self) -> float | None:
        return sum(episode["reward"] for episode in self.episodes) / len(self.episodes) if self.episodes else None


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
        for name in RUN_VIEWS:
            self.connection.execute(f"CREATE VIEW {name} AS {RUN_VIEW_SQL[name]}")
        self.run_id = self._run_id()
        """The run the archive records (its first `RunStarted`); the bank replays apply only its ops."""
        self.op_log_id = self._newest_op_log()
        """The op log the experience views replay (None: the archive holds no experience ops)."""
        self._experience_views_ready = False
        self.connection.execute(f"SET allowed_directories = [{_sql_string(str(self.root) + '/')}]")
        self.connection.execute("SET enable_external_access = false")
        self.connection.execute("SET lock_configuration = true")

    def _run_id(self) -> str | None:
        rows = self.connection.execute(
            "SELECT run_id FROM events WHERE kind = 'RunStarted' ORDER BY log_id, \"offset\" LIMIT 1").fetchall()
        return rows[0][0] if rows else None

    def _newest_op_log(self) -> str | None:
        """The op log `crl replay bank` replays when the bank has no live position: the last one written."""
        rows = self.connection.execute(
            "SELECT log_id FROM events WHERE topic = ? GROUP BY log_id "
            "ORDER BY max(record_timestamp) DESC NULLS LAST, log_id DESC LIMIT 1",
            [EXPERIENCE_OPS_TOPIC.name],
        ).fetchall()
        return rows[0][0] if rows else None

    def _archived_ops(self, log_id: str) -> Iterator[tuple[int, ExperienceOp]]:
        """Every archived record of op log `log_id` once per offset, like `pipeline.audit.bank_replay.ops_from_archive`.

        Records, not the `events` view: the same event at two offsets (a producer retry) reached the bank twice.
        """
        pattern = _sql_string(str(self.root / EXPERIENCE_OPS_TOPIC.name / "*.parquet"))
        rows = self.connection.execute(
            f"SELECT \"offset\", any_value(payload) FROM read_parquet({pattern}) WHERE log_id = ? "
            "GROUP BY \"offset\" ORDER BY \"offset\"",
            [log_id],
        ).fetchall()
        for offset, payload in rows:
            yield offset, decode_op(payload.encode())

    def _create_experience_views(self) -> None:
        from pipeline.bank.replay import replay

        ops: dict[int, ExperienceOp] = {}

        def remembered(log_id: str) -> Iterator[tuple[int, ExperienceOp]]:
            for offset, op in self._archived_ops(log_id):
                ops[offset] = op
                yield offset, op

        state = (replay(remembered(self.op_log_id), run_id=self.run_id).state if self.op_log_id is not None
                 else BankState(self.run_id))
        self.connection.execute("CREATE SCHEMA replayed_bank")
        for name, rows in replayed_tables(state, ops).items():
            self.connection.register("replayed_rows", pa.Table.from_pylist(rows, schema=_REPLAYED_TABLES[name]))
            self.connection.execute(f"CREATE TABLE replayed_bank.{name} AS SELECT * FROM replayed_rows")
            self.connection.unregister("replayed_rows")
        for name in EXPERIENCE_VIEWS:
            self.connection.execute(f"CREATE VIEW {name} AS {EXPERIENCE_VIEW_SQL[name]}")

    @staticmethod
    def view_names() -> list[str]:
        """`events` and the per-kind views (the others are `RUN_VIEWS` and `EXPERIENCE_VIEWS`)."""
        return ["events", *sorted(snake_case(kind) for kind in EVENT_TYPES)]

    def columns(self) -> dict[str, list[tuple[str, str]]]:
        """Every view, `events` first, then the run views, the experience views and the per-kind views, with its
        columns as (name, SQL type)."""
        self._experience_views()
        names = ["events", *RUN_VIEWS, *EXPERIENCE_VIEWS, *self.view_names()[1:]]
        return {name: [(str(column), str(kind)) for column, kind, *_ in
                       self.connection.execute(f"DESCRIBE {_quote(name)}").fetchall()] for name in names}

    def _experience_views(self) -> None:
        if not self._experience_views_ready:
            # The replay costs ~1 s per 10,000 ops: paid once, and only by queries that read these views.
            self._create_experience_views()
            self._experience_views_ready = True

    def query(self, sql: str, parameters: Sequence[Any] = ()) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only statement (with `?` placeholders bound to `parameters`); returns (column names, rows)."""
        try:
            statements = self.connection.extract_statements(sql)
        except duckdb.Error as exc:
            raise AuditQueryError(str(exc)) from exc
        if len(statements) != 1:
            raise AuditQueryError(f"expected exactly one statement, got {len(statements)}")
        if statements[0].type not in ALLOWED_STATEMENTS:
            raise AuditQueryError(f"only SELECT / EXPLAIN statements are allowed (got {statements[0].type.name})")
        lowered = sql.lower()
        if any(name in lowered for name in (*EXPERIENCE_VIEWS, "replayed_bank", *CATALOGUE_WORDS)):
            self._experience_views()
        try:
            cursor = self.connection.execute(sql, list(parameters))
            rows = cursor.fetchall()
        except duckdb.Error as exc:
            raise AuditQueryError(str(exc)) from exc
        return [column[0] for column in cursor.description], rows

    def every_copy(self, kind: str) -> Iterator[str]:
        """The payload of every archived record of `kind` once per log position, in log order (topic, partition,
        log, offset): unlike the `events` view, the same event id published again at another offset (an extraction
        distilled again, an episode played again) is kept, so a caller can choose the copy a worker used."""
        if not segment_files(self.root):
            return
        pattern = _sql_string(str(self.root / "*" / "*.parquet"))
        rows = self.connection.execute(
            f"SELECT any_value(payload) FROM read_parquet({pattern}, union_by_name = true) WHERE kind = ? "
            "GROUP BY topic, partition, log_id, \"offset\" ORDER BY topic, partition, log_id, \"offset\"",
            [kind]).fetchall()
        for (payload,) in rows:
            yield payload

    def recent_events(self, kind: str | None = None, limit: int = 20) -> tuple[list[str], list[tuple[Any, ...]]]:
        if kind is not None and kind not in EVENT_TYPES:
            raise AuditQueryError(f"unknown kind {kind!r}; known kinds: {', '.join(sorted(EVENT_TYPES))}")
        where = f"WHERE kind = {_sql_string(kind)}" if kind else ""
        return self.query(
            "SELECT occurred_at, kind, topic, partition, \"offset\", event_id, producer_worker, "
            f"left(CAST(payload AS VARCHAR), 120) AS payload FROM events {where} "
            f"ORDER BY occurred_at, topic, partition, \"offset\" LIMIT {int(limit)}"
        )

    def _records(self, sql: str, parameters: Sequence[Any]) -> list[dict[str, Any]]:
        columns, rows = self.query(sql, parameters)
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def experience_record(self, experience_id: str) -> ExperienceRecord | None:
        """What the experience views hold about `experience_id`, or None if the replayed bank never had it."""
        state = self._records("SELECT * FROM experiences WHERE experience_id = ?", [experience_id])
        if not state:
            return None
        lineage = "SELECT * FROM experience_lineage WHERE {} = ? ORDER BY source_id"
        merged_into = self._records(lineage.format("source_id"), [experience_id])
        return ExperienceRecord(
            state=state[0],
            versions=self._records("SELECT * FROM experience_history WHERE experience_id = ? ORDER BY version",
                                   [experience_id]),
            merged_from=self._records(lineage.format("merged_id"), [experience_id]),
            merged_into=merged_into[0] if merged_into else None,
            episodes=self._records("SELECT * FROM experience_usage WHERE experience_id = ? "
                                   "ORDER BY step, occurred_at, trajectory_id", [experience_id]),
        )

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Audit:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def view_columns() -> dict[str, list[tuple[str, str]]]:
    """Every view an audit has, with its columns (`Audit.columns` over an empty archive): what `crl audit sql --help`
    lists."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="crl-views-") as empty, Audit(Path(empty)) as audit:
        return audit.columns()
