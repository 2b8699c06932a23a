"""Archiver segments and the DuckDB audit views, without a broker (harness + real Parquet + real DuckDB)."""

from __future__ import annotations

import datetime
import uuid

import pyarrow.parquet as pq
import pytest

from pipeline.audit.archive import ARCHIVE_SCHEMA, archive_root, segment_files, write_segments
from pipeline.audit.views import Audit, kind_view_sql, sql_type
from pipeline.errors import AuditQueryError
from pipeline.runtime.harness import MEMORY_LOG_ID, RawRecord, run_worker
from schemas.examples import example_events
from schemas.topics import EVENT_TYPES, TRAJECTORIES
from schemas.trajectories import TrajectoryCompleted
from workers import WORKERS
from workers.archiver import Archiver


@pytest.fixture
def archived(tmp_path):
    """A run dir whose archive holds every example event plus one dead letter, in 3-event segments."""
    events = example_events("audit-run")
    # The garbage record's dead letter, as the runner writes it to crl.dead-letters; the archiver then reads it
    # from there together with everything else (one run, so every record keeps distinct Kafka coordinates).
    letters = run_worker(Archiver(tmp_path / "scratch"),
                            [RawRecord(TRAJECTORIES.name, b"garbage", partition=5)]).dead_letters
    archiver = Archiver(archive_root(tmp_path), flush_rows=3, flush_interval_s=3600)
    run_worker(archiver, [*events, *letters])
    return tmp_path, events


def test_archiver_is_registered_and_reads_every_topic_in_assign_mode():
    assert WORKERS["archiver"] is Archiver
    assert Archiver.consumption == "assign"
    assert {topic.name for topic in Archiver.consumes} == {
        "crl.runs", "crl.control", "crl.tasks", "crl.trajectories", "crl.extractions", "crl.experience-ops",
        "crl.policy", "crl.train-steps", "crl.bank-snapshots", "crl.dead-letters",
    }


def test_archiver_flushes_by_count_and_by_age(tmp_path):
    archiver = Archiver(tmp_path, flush_rows=2, flush_interval_s=5.0)
    assert archiver.flush_due(now=0.0)  # nothing buffered
    events = example_events()
    from pipeline.runtime.runner import Origin

    archiver.handle(events[0], Origin("crl.runs", 0, 0, 1_700_000_000_000, b"k", "log-a"))
    started = archiver._oldest
    assert not archiver.flush_due(started + 4.9)
    assert archiver.flush_due(started + 5.0)
    archiver.handle(events[1], Origin("crl.runs", 0, 1, 1_700_000_000_001, b"k", "log-a"))
    assert archiver.flush_due(started)  # two rows: count reached
    archiver.flush()
    assert [path.name for path in segment_files(tmp_path)] == ["000-000000000000-000000000001-log-a.parquet"]
    assert archiver.flush_due(0.0)


def test_segments_hold_one_row_per_event_with_the_archive_schema(archived):
    run_dir, events = archived
    files = segment_files(archive_root(run_dir))
    assert {path.parent.name for path in files} == {
        "crl.runs", "crl.control", "crl.tasks", "crl.trajectories", "crl.extractions", "crl.experience-ops",
        "crl.policy", "crl.train-steps", "crl.bank-snapshots", "crl.dead-letters",
    }
    tables = [pq.read_table(path) for path in files]
    assert all(table.schema.equals(ARCHIVE_SCHEMA) for table in tables)
    assert sum(table.num_rows for table in tables) == len(events) + 1
    assert not list(archive_root(run_dir).glob("*/.*.tmp"))


def test_events_view_counts_every_kind(archived):
    run_dir, _events = archived
    with Audit(run_dir) as audit:
        columns, rows = audit.query("SELECT kind, count(*) AS n FROM events GROUP BY kind ORDER BY kind")
    assert columns == ["kind", "n"]
    expected = dict.fromkeys(EVENT_TYPES, 1)
    expected["DeadLetter"] = 2  # the example plus the garbage record's
    assert dict(rows) == expected


def test_duplicates_from_a_crash_between_write_and_commit_are_removed(archived):
    run_dir, events = archived
    trajectory = next(event for event in events if isinstance(event, TrajectoryCompleted))
    # After a crash between writing segment 0-0 and committing, the restarted archiver re-reads offset 0 together
    # with a newer record and writes segment 0-1: offset 0 is now archived twice.
    from pipeline.audit.archive import archive_row

    newer = trajectory.model_copy(update={"event_id": uuid.uuid4(), "slot": 3})
    write_segments(archive_root(run_dir), [archive_row(trajectory, TRAJECTORIES.name, 0, 0, 0, b"k", MEMORY_LOG_ID),
                                           archive_row(newer, TRAJECTORIES.name, 0, 1, 0, b"k", MEMORY_LOG_ID)])
    with Audit(run_dir) as audit:
        _, raw = audit.query(
            f"SELECT count(*) FROM read_parquet('{archive_root(run_dir)}/*/*.parquet') "
            f"WHERE event_id = '{trajectory.event_id}'"
        )
        _, deduplicated = audit.query(f"SELECT count(*) FROM events WHERE event_id = '{trajectory.event_id}'")
    assert raw == [(2,)]
    assert deduplicated == [(1,)]


def test_kind_views_have_typed_field_columns(archived):
    run_dir, events = archived
    trajectory = next(event for event in events if isinstance(event, TrajectoryCompleted))
    with Audit(run_dir) as audit:
        _, rows = audit.query(
            "SELECT trajectory_id, step, reward, success, guided, bank_offset, policy_version, "
            "json_array_length(turns), retrieved->0->>'experience_id', timings->>'generation_s' "
            "FROM trajectory_completed"
        )
        _, types = audit.query("SELECT column_name, column_type FROM (DESCRIBE trajectory_completed)")
        _, occurred = audit.query("SELECT occurred_at FROM trajectory_completed")
    assert rows == [("traj-step1-task0-2", 1, 1.0, True, True, 12, 1, 2, "exp-1", "0.21")]
    types = dict(types)
    assert (types["step"], types["reward"], types["success"], types["goal"], types["turns"]) == (
        "BIGINT", "DOUBLE", "BOOLEAN", "VARCHAR", "JSON")
    assert occurred[0][0] == trajectory.occurred_at
    assert isinstance(occurred[0][0], datetime.datetime)


def test_every_kind_has_a_view_with_every_field(archived):
    run_dir, _ = archived
    with Audit(run_dir) as audit:
        for view in Audit.view_names()[1:]:
            columns, rows = audit.query(f"SELECT * FROM {view}")
            kind = next(k for k in EVENT_TYPES if view == "".join(
                "_" + c.lower() if c.isupper() else c for c in k).lstrip("_"))
            assert set(EVENT_TYPES[kind].payload_fields()) <= set(columns), view
            assert len(rows) >= 1, view


def test_dead_letter_view_shows_the_reason(archived):
    run_dir, _ = archived
    with Audit(run_dir) as audit:
        _, rows = audit.query(
            "SELECT source_topic, source_partition, source_offset, error_class, raw_size FROM dead_letter "
            "WHERE source_partition = 5"
        )
    assert rows == [("crl.trajectories", 5, 0, "MalformedPayloadError", 7)]


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("COPY events TO 'out.csv'", "only SELECT / EXPLAIN"),
        ("CREATE TABLE x AS SELECT 1", "only SELECT / EXPLAIN"),
        ("SELECT 1; SELECT 2", "exactly one statement"),
        ("SELECT * FROM read_csv('/etc/passwd')", "Permission"),
        ("SELECT * FROM no_such_view", "no_such_view"),
    ],
)
def test_audit_is_read_only(archived, sql, message):
    run_dir, _ = archived
    with Audit(run_dir) as audit, pytest.raises(AuditQueryError, match=message):
        audit.query(sql)


def test_empty_archive_has_every_view(tmp_path):
    with Audit(tmp_path) as audit:
        _, rows = audit.query("SELECT count(*) FROM events")
        _, trajectories = audit.query("SELECT count(*) FROM trajectory_completed")
    assert rows == [(0,)]
    assert trajectories == [(0,)]


def test_recent_events_filters_by_kind_and_rejects_unknown(archived):
    run_dir, _ = archived
    with Audit(run_dir) as audit:
        columns, rows = audit.recent_events("PolicyPublished", limit=5)
        assert columns[:3] == ["occurred_at", "kind", "topic"]
        assert [row[1] for row in rows] == ["PolicyPublished"]
        with pytest.raises(AuditQueryError, match="unknown kind 'Nope'"):
            audit.recent_events("Nope")


def test_sql_types_follow_the_annotations():
    from schemas.experiences import ExperienceRetired

    fields = ExperienceRetired.model_fields
    assert sql_type(fields["expected_version"].annotation) == "BIGINT"
    assert sql_type(fields["reason"].annotation) == "VARCHAR"
    assert sql_type(fields["extractor_version"].annotation) == "BIGINT"  # int | None
    assert sql_type(fields["generation_id"].annotation) == "VARCHAR"
    assert "TRY_CAST(payload ->> '$.expected_version' AS BIGINT)" in kind_view_sql(ExperienceRetired)


def test_rewriting_a_segment_with_the_same_range_replaces_it_atomically(tmp_path):
    from pipeline.audit.archive import archive_row

    events = example_events()[:2]
    rows = [archive_row(event, "crl.runs", 0, offset, 0, None) for offset, event in enumerate(events)]
    first = write_segments(tmp_path, rows)
    second = write_segments(tmp_path, rows)
    assert first == second
    assert pq.read_table(first[0]).num_rows == 2


def test_segments_of_another_log_never_replace_the_archived_ones(tmp_path):
    """A restarted embedded broker numbers its new log from 0 again: same topic, partition and offsets."""
    from pipeline.audit.archive import archive_row

    first, second = example_events()[:2]
    old = write_segments(tmp_path, [archive_row(first, "crl.runs", 0, 0, 0, None, "log-before-restart")])
    new = write_segments(tmp_path, [archive_row(second, "crl.runs", 0, 0, 0, None, "log-after-restart")])
    assert old != new
    assert len(segment_files(tmp_path)) == 2
    run_dir = tmp_path.parent / "run-with-two-logs"
    (run_dir / "archive").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "archive").symlink_to(tmp_path)
    with Audit(run_dir) as audit:
        _, rows = audit.query("SELECT log_id, event_id FROM events ORDER BY log_id")
    assert rows == [("log-after-restart", str(second.event_id)), ("log-before-restart", str(first.event_id))]
