"""The SQL layer on real databases: migrations (`infra.db`) and the assign-mode offset store
(`pipeline.runtime.offsets`).

Every test taking `db_engine` runs twice, on a SQLite file and on PostgreSQL (see conftest.py). Run with:

    python -m pytest tests/integration/test_sql_layer.py -q
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from alembic import command
from pydantic import ValidationError
from sqlalchemy import BigInteger, DateTime, Engine, Integer, String, func, inspect, select, text

from infra.db import (
    DbSettings,
    alembic_config,
    check_connection,
    consumer_offsets,
    current_revision,
    database_url,
    make_engine,
    migrate,
    session_factory,
)
from pipeline.runtime.offsets import LogPosition, SqlOffsetStore

pytestmark = pytest.mark.integration

HEAD = "0004"


@pytest.fixture
def migrated_engine(db_engine: Engine) -> Engine:
    """The `db_engine` database, migrated to head."""
    assert migrate(db_engine) == HEAD
    return db_engine


# --- migrations --------------------------------------------------------------------------------------------------


def test_migrate_is_idempotent_and_reports_head(db_engine: Engine) -> None:
    assert current_revision(db_engine) is None

    assert migrate(db_engine) == HEAD
    assert current_revision(db_engine) == HEAD
    assert migrate(db_engine) == HEAD
    assert current_revision(db_engine) == HEAD

    with db_engine.connect() as connection:
        assert connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [HEAD]


def test_migration_creates_consumer_offsets_as_declared(migrated_engine: Engine) -> None:
    inspector = inspect(migrated_engine)
    columns = {column["name"]: column for column in inspector.get_columns("consumer_offsets")}

    assert list(columns) == ["worker", "topic", "partition", "next_offset", "log_id", "updated_at"]
    assert isinstance(columns["worker"]["type"], String) and columns["worker"]["type"].length == 128
    assert isinstance(columns["topic"]["type"], String) and columns["topic"]["type"].length == 255
    assert isinstance(columns["partition"]["type"], Integer)
    assert isinstance(columns["next_offset"]["type"], BigInteger)
    assert isinstance(columns["log_id"]["type"], String) and not columns["log_id"]["nullable"]
    assert isinstance(columns["updated_at"]["type"], DateTime)
    assert {name for name, column in columns.items() if not column["nullable"]} == set(columns)
    assert inspector.get_pk_constraint("consumer_offsets")["constrained_columns"] == ["worker", "topic", "partition"]
    # The migration and the model in infra.db describe the same table.
    assert list(columns) == [column.name for column in consumer_offsets.columns]


def test_downgrade_drops_the_table_and_migrate_restores_it(migrated_engine: Engine) -> None:
    with migrated_engine.begin() as connection:
        command.downgrade(alembic_config(connection), "base")
    assert current_revision(migrated_engine) is None
    assert not inspect(migrated_engine).has_table("consumer_offsets")

    assert migrate(migrated_engine) == HEAD
    assert inspect(migrated_engine).has_table("consumer_offsets")


def test_concurrent_migrations_all_reach_head(db_engine: Engine) -> None:
    # Threads of one process, each with its own engine: Alembic's process-global context must not be shared by two
    # migrations at once (separate processes are tested below).
    engines = [make_engine(db_engine.url.render_as_string(hide_password=False)) for _ in range(4)]
    start = threading.Barrier(len(engines))
    revisions: list[str] = []
    errors: list[BaseException] = []

    def start_worker(engine: Engine) -> None:
        start.wait()
        try:
            revisions.append(migrate(engine))
        except BaseException as exc:  # noqa: BLE001 - collected and reported below, from the test's own thread
            errors.append(exc)

    threads = [threading.Thread(target=start_worker, args=(engine,)) for engine in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for engine in engines:
        engine.dispose()

    assert errors == []
    assert revisions == [HEAD] * len(engines)
    with db_engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM alembic_version")).scalar_one() == 1


# --- engine and connection ---------------------------------------------------------------------------------------


def test_check_connection_names_the_database_and_its_version(db_engine: Engine) -> None:
    description = check_connection(db_engine)

    name, version = description.split(" ")
    assert name == db_engine.dialect.name
    assert version == ".".join(str(part) for part in db_engine.dialect.server_version_info)
    if name == "sqlite":
        assert version == sqlite3.sqlite_version


def test_session_factory_sessions_use_the_engine(migrated_engine: Engine) -> None:
    with session_factory(migrated_engine).begin() as session:
        assert session.execute(select(func.count()).select_from(consumer_offsets)).scalar_one() == 0
        assert session.get_bind() is migrated_engine


def test_sqlite_engine_creates_the_directory_and_uses_wal(sqlite_path: Path) -> None:
    assert not sqlite_path.parent.exists()
    engine = make_engine(f"sqlite:///{sqlite_path}")
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar_one() == "wal"
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar_one() == 30_000
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar_one() == 1
    finally:
        engine.dispose()
    assert sqlite_path.is_file()


def test_database_url_defaults_to_a_sqlite_file_in_the_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "demo"

    assert database_url(DbSettings(), run_dir) == f"sqlite:///{run_dir.resolve()}/crl.sqlite3"
    postgres = "postgresql+psycopg://user@db.example:5432/crl"
    assert database_url(DbSettings(url=postgres), run_dir) == postgres


def test_db_settings_are_frozen_and_reject_unknown_fields() -> None:
    with pytest.raises(ValidationError, match="extra_forbidden"):
        DbSettings(uri="sqlite://")  # type: ignore[call-arg]
    settings = DbSettings()
    with pytest.raises(ValidationError, match="frozen"):
        settings.echo = True  # type: ignore[misc]


# --- offset store ------------------------------------------------------------------------------------------------


def _at(offsets: dict[tuple[str, int], int], log_id: str = "log-a") -> dict[tuple[str, int], LogPosition]:
    return {position: LogPosition(offset, log_id) for position, offset in offsets.items()}


def test_positions_round_trip_per_worker(migrated_engine: Engine) -> None:
    bank = SqlOffsetStore(migrated_engine, worker="bank-0")
    learner = SqlOffsetStore(migrated_engine, worker="learner-0")
    bank_positions = _at({("crl.experience-ops", 0): 1234, ("crl.trajectories", 0): 7, ("crl.trajectories", 3): 2**40})
    learner_positions = _at({("crl.trajectories", 0): 99, ("crl.trajectories", 1): 0})

    assert bank.load() == {}
    bank.save(bank_positions)
    learner.save(learner_positions)

    assert bank.load() == bank_positions
    assert learner.load() == learner_positions
    # A new store for the same worker (a restarted process) reads what the old one saved.
    assert SqlOffsetStore(migrated_engine, worker="bank-0").load() == bank_positions


def test_save_overwrites_given_partitions_and_keeps_the_others(migrated_engine: Engine) -> None:
    store = SqlOffsetStore(migrated_engine, worker="bank-0")
    store.save(_at({("crl.trajectories", 0): 10, ("crl.trajectories", 1): 20}))

    store.save(_at({("crl.trajectories", 0): 15}))
    store.save(_at({("crl.trajectories", 1): 20}))  # the same offset again is allowed: nothing was consumed

    assert store.load() == _at({("crl.trajectories", 0): 15, ("crl.trajectories", 1): 20})
    with migrated_engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(consumer_offsets)).scalar_one() == 2


def test_save_refuses_to_move_a_position_backwards(migrated_engine: Engine) -> None:
    store = SqlOffsetStore(migrated_engine, worker="bank-0")
    store.save(_at({("crl.trajectories", 2): 10}))

    with pytest.raises(ValueError, match="backwards") as raised:
        store.save(_at({("crl.trajectories", 2): 9}))

    message = str(raised.value)
    assert "'crl.trajectories'" in message and "partition 2" in message
    assert "10" in message and "9" in message
    assert store.load() == _at({("crl.trajectories", 2): 10})


def test_save_rejects_negative_offsets(migrated_engine: Engine) -> None:
    store = SqlOffsetStore(migrated_engine, worker="bank-0")

    with pytest.raises(ValueError, match="must be >= 0"):
        store.save(_at({("crl.trajectories", 0): -1}))
    assert store.load() == {}


def test_a_failing_save_writes_none_of_its_positions(migrated_engine: Engine) -> None:
    store = SqlOffsetStore(migrated_engine, worker="bank-0")
    store.save(_at({("crl.trajectories", 0): 5, ("crl.trajectories", 2): 5}))

    # Rows are written in (topic, partition) order, so partition 0 is updated and partition 1 inserted before
    # partition 2 is found to move backwards; the transaction must undo both.
    with pytest.raises(ValueError, match="backwards"):
        store.save(_at({("crl.trajectories", 0): 8, ("crl.trajectories", 1): 1, ("crl.trajectories", 2): 3}))

    assert store.load() == _at({("crl.trajectories", 0): 5, ("crl.trajectories", 2): 5})


def test_saving_nothing_writes_nothing(migrated_engine: Engine) -> None:
    store = SqlOffsetStore(migrated_engine, worker="bank-0")
    store.save(_at({}))
    assert store.load() == {}


def test_a_new_log_may_start_lower_and_its_id_is_stored(migrated_engine: Engine) -> None:
    store = SqlOffsetStore(migrated_engine, worker="archiver")
    store.save(_at({("crl.trajectories", 0): 500}, log_id="old-broker"))
    with pytest.raises(ValueError, match="backwards"):
        store.save(_at({("crl.trajectories", 0): 3}, log_id="old-broker"))
    store.save(_at({("crl.trajectories", 0): 3}, log_id="new-broker"))
    assert store.load() == {("crl.trajectories", 0): LogPosition(3, "new-broker")}


def test_concurrent_migrations_from_separate_processes(db_engine: Engine) -> None:
    # Real worker processes, each with its own Alembic and its own connection, racing to migrate one database.
    url = db_engine.url.render_as_string(hide_password=False)
    script = "import sys; from infra.db import make_engine, migrate; print(migrate(make_engine(sys.argv[1])))"
    processes = [
        subprocess.Popen([sys.executable, "-c", script, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=Path(__file__).resolve().parents[2])
        for _ in range(4)
    ]
    outcomes = [process.communicate(timeout=120) for process in processes]
    assert [process.returncode for process in processes] == [0] * 4, [err for _, err in outcomes]
    assert [out.strip() for out, _ in outcomes] == [HEAD] * 4
    with db_engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM alembic_version")).scalar_one() == 1
