"""The database: engine settings, the `consumer_offsets` table, and the Alembic migrations run from code.

Every worker of a run opens the same database: by default a SQLite file `crl.sqlite3` in the run directory, or any
SQLAlchemy URL (PostgreSQL for multi-host runs). Workers call `migrate(engine)` at start-up; it upgrades the schema to
the newest revision in `infra/migrations/versions` and is safe to call from many processes at once. There is no
`alembic.ini`: the Alembic config is built in code (`alembic_config`).

    engine = make_engine(database_url(DbSettings(), run_dir))
    migrate(engine)            # -> "0003" (the newest revision)
    check_connection(engine)   # -> "sqlite 3.40.1"
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    DateTime,
    Engine,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    create_engine,
    event,
    make_url,
    text,
)
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from infra.errors import ConfigError, RetryableError

SQLITE_FILE_NAME = "crl.sqlite3"
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000

# Any fixed 64-bit key works; every process that migrates must use the same one. This is "crl-migr" in ASCII.
MIGRATION_LOCK_KEY = 0x63726C2D6D696772


class DbSettings(BaseModel):
    """Where the run's database lives and whether to log its SQL."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str | None = Field(
        default=None,
        description=(
            "SQLAlchemy URL of the database. None means a SQLite file `crl.sqlite3` in the run directory; "
            "for several hosts use PostgreSQL, e.g. `postgresql+psycopg://user@host:5432/db`."
        ),
    )
    echo: bool = Field(default=False, description="Log every SQL statement (SQLAlchemy `echo`).")


def database_url(settings: DbSettings, run_dir: Path) -> str:
    """Return the SQLAlchemy URL to open: `settings.url`, or the absolute SQLite file `run_dir/crl.sqlite3`."""
    if settings.url is not None:
        return settings.url
    return f"sqlite:///{(run_dir / SQLITE_FILE_NAME).resolve()}"


def _configure_sqlite_connection(dbapi_connection: Any, connection_record: Any) -> None:
    # Several worker processes share one SQLite file: WAL lets readers run beside the single writer, and the busy
    # timeout makes a writer wait for the lock instead of failing at once with "database is locked".
    # isolation_level=None stops Python's sqlite3 from opening (and silently committing) transactions on its own;
    # `_begin_immediate` opens every SQLAlchemy transaction instead, so DDL is transactional too.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    # SQLite ignores foreign keys unless asked, per connection.
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _begin_immediate(connection: Connection) -> None:
    # Take the write lock when the transaction starts. A deferred transaction that reads and then writes must upgrade
    # its lock, and SQLite answers a contended upgrade with SQLITE_BUSY at once, without honouring the busy timeout.
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str, echo: bool = False) -> Engine:
    """Create the engine for `url`.

    SQLite: creates the file's directory if needed and sets WAL, a 30 s busy timeout and foreign keys on every
    connection. Other databases: `pool_pre_ping`, so connections the server dropped are replaced, not handed out.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, echo=echo, pool_pre_ping=True)
    database = parsed.database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, echo=echo)
    event.listen(engine, "connect", _configure_sqlite_connection)
    event.listen(engine, "begin", _begin_immediate)
    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Return a `sessionmaker` bound to `engine`; `with factory.begin() as session:` is one transaction."""
    return sessionmaker(bind=engine)


metadata = MetaData()

consumer_offsets = Table(
    "consumer_offsets",
    metadata,
    # The worker instance that owns the position, e.g. "bank-0".
    Column("worker", String(128), nullable=False),
    Column("topic", String(255), nullable=False),
    Column("partition", Integer, nullable=False),
    # The offset of the next record to read: one past the last record whose outputs were flushed.
    Column("next_offset", BigInteger, nullable=False),
    # Which log the offset counts in: the Kafka topic id, new at every topic creation. A restarted embedded broker
    # (memory only) or a re-created topic is a new log, in which an old offset means nothing.
    Column("log_id", String(64), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    PrimaryKeyConstraint("worker", "topic", "partition", name="pk_consumer_offsets"),
)
"""Input positions of workers that consume in Kafka "assign mode" and so keep them here, not in consumer groups."""

# --- the experience bank (migration 0002; written by `pipeline.bank.store`) ------------------------------------------
# A projection of crl.experience-ops: `crl replay bank` rebuilds it from the log. List-valued columns hold JSON text
# so that SQLite and PostgreSQL store them the same way.

experiences = Table(
    "experiences",
    metadata,
    Column("experience_id", String(256), nullable=False),
    Column("task_family", String(256), nullable=False),
    Column("text", Text, nullable=False),
    Column("version", Integer, nullable=False),
    # "active" or "retired".
    Column("status", String(16), nullable=False),
    Column("merged_into", String(256), nullable=True),
    # JSON list of the experience ids merged into this one.
    Column("parents", Text, nullable=False),
    Column("generation_id", String(256), nullable=False),
    Column("extractor_version", Integer, nullable=False),
    # JSON list of trajectory ids.
    Column("source_trajectory_ids", Text, nullable=False),
    Column("retired_reason", String(64), nullable=True),
    Column("key_model", String(256), nullable=False),
    Column("key_dim", Integer, nullable=False),
    # The key vector as little-endian float16 bytes (`key_dim * 2` of them).
    Column("key", LargeBinary, nullable=False),
    # JSON list of the offsets in crl.experience-ops of every op that touched the experience.
    Column("op_offsets", Text, nullable=False),
    Column("retrievals", Integer, nullable=False),
    Column("trainings", Integer, nullable=False),
    Column("last_trained_step", BigInteger, nullable=True),
    PrimaryKeyConstraint("experience_id", name="pk_experiences"),
    Index("ix_experiences_task_family_status", "task_family", "status"),
)
"""The bank's experiences at their current version (`pipeline.bank.state.Experience` without its history)."""

experience_versions = Table(
    "experience_versions",
    metadata,
    Column("experience_id", String(256), nullable=False),
    Column("version", Integer, nullable=False),
    Column("text", Text, nullable=False),
    Column("op_id", String(256), nullable=False),
    Column("op_kind", String(64), nullable=False),
    Column("op_offset", BigInteger, nullable=False),
    Column("generation_id", String(256), nullable=False),
    Column("extractor_version", Integer, nullable=False),
    # JSON list of trajectory ids.
    Column("source_trajectory_ids", Text, nullable=False),
    PrimaryKeyConstraint("experience_id", "version", name="pk_experience_versions"),
)
"""Every version of every experience's text and the op that wrote it; rows are only ever added."""

bank_position = Table(
    "bank_position",
    metadata,
    Column("topic", String(255), nullable=False),
    Column("partition", Integer, nullable=False),
    # The first op offset the stored view does not include yet.
    Column("next_offset", BigInteger, nullable=False),
    # The Kafka topic id of the op log the offset counts in.
    Column("log_id", String(64), nullable=False),
    # BankState.state_hash() of the stored view, for comparison with a rebuild (`crl replay bank`).
    Column("state_hash", String(64), nullable=False),
    Column("applied", BigInteger, nullable=False),
    Column("duplicates", BigInteger, nullable=False),
    Column("rejected", BigInteger, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    PrimaryKeyConstraint("topic", "partition", name="pk_bank_position"),
)
"""Where in the op log the stored bank stands; written in the same transaction as the rows it describes."""

experience_served = Table(
    "experience_served",
    metadata,
    Column("trajectory_id", String(256), nullable=False),
    Column("experience_id", String(256), nullable=False),
    # The version served and the generation that wrote it (credit for the episode's outcome goes there).
    Column("version", Integer, nullable=False),
    Column("generation_id", String(256), nullable=False),
    Column("bank_offset", BigInteger, nullable=True),
    Column("step", BigInteger, nullable=False),
    Column("success", Boolean, nullable=False),
    Column("reward", Float, nullable=False),
    PrimaryKeyConstraint("trajectory_id", "experience_id", name="pk_experience_served"),
)
"""Every experience served to a guided episode, from TrajectoryCompleted; keyed by trajectory so re-delivered
trajectories count once. `experiences.retrievals` is the number of rows here."""

extraction_events = Table(
    "extraction_events",
    metadata,
    Column("event_id", String(64), nullable=False),
    Column("generation_id", String(256), nullable=False),
    PrimaryKeyConstraint("event_id", name="pk_extraction_events"),
)
"""ExtractionGenerated event id -> generation id: how an extractor training batch (event ids) names generations."""

extractor_batches = Table(
    "extractor_batches",
    metadata,
    Column("step", BigInteger, nullable=False),
    Column("event_id", String(64), nullable=False),
    PrimaryKeyConstraint("step", "event_id", name="pk_extractor_batches"),
)
"""The ExtractionGenerated events of every extractor training step (TrainStepCompleted with role extractor).
`experiences.trainings` counts the steps whose batch holds a generation that wrote one of the experience's versions."""

# --- consumer-group commits (migration 0004; written by `pipeline.runtime.group_commits`) -----------------------------
group_commits = Table(
    "group_commits",
    metadata,
    Column("id", Integer, nullable=False, autoincrement=True),
    Column("group_id", String(255), nullable=False),
    Column("instance", String(255), nullable=False),
    Column("topic", String(255), nullable=False),
    Column("partition", Integer, nullable=False),
    # The committed offset: the next record the group reads on that partition.
    Column("next_offset", BigInteger, nullable=False),
    Column("log_id", String(64), nullable=False),
    # JSON {"topic/partition": end}: one past the last record this instance had produced there, acknowledged before
    # the commit. A commit is only as good as the outputs behind it: restored from a log that ends before them, it
    # would skip inputs whose outputs are gone.
    Column("produced_ends", Text, nullable=False),
    Column("committed_at", DateTime(timezone=True), nullable=False),
    PrimaryKeyConstraint("id", name="pk_group_commits"),
    Index("ix_group_commits_group_partition", "group_id", "topic", "partition"),
)
"""Every offset commit of a consumer-group worker (rollout, extractor), beside the one in Kafka: what `crl run
--resume` needs to carry a group on after a memory-only broker lost its commits with its log."""


def alembic_config(connection: Connection | None = None) -> Config:
    """Build the Alembic config for `infra/migrations` in code; `connection`, if given, is what env.py migrates."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


# Alembic keeps the running migration in a process-global proxy (`alembic.context`), so two threads must not migrate
# at once; processes are kept apart by the database lock below.
_ALEMBIC_IN_PROCESS = threading.Lock()


def _lock_migrations(connection: Connection) -> None:
    # Many workers start at once and each calls migrate(); without a lock two of them can both see an empty schema
    # and both run CREATE TABLE. On SQLite the transaction already holds the write lock (BEGIN IMMEDIATE). The
    # PostgreSQL advisory lock lasts until the surrounding transaction ends.
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})


def migrate(engine: Engine) -> str:
    """Upgrade the database to the newest migration and return the revision it is at (e.g. "0001").

    Idempotent, and safe to run from several processes and threads at once: the whole upgrade is one transaction
    holding a migration lock (a PostgreSQL transaction-level advisory lock, or SQLite's write lock).
    """
    with _ALEMBIC_IN_PROCESS, engine.begin() as connection:
        _lock_migrations(connection)
        command.upgrade(alembic_config(connection), "head")
        revision = MigrationContext.configure(connection).get_current_revision()
    if revision is None:
        raise ConfigError(f"no migrations found under {MIGRATIONS_DIR}")
    return revision


def current_revision(engine: Engine) -> str | None:
    """Return the migration revision the database is at, or None if it was never migrated."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def check_connection(engine: Engine) -> str:
    """Run `SELECT 1` and describe the server, e.g. "sqlite 3.40.1" or "postgresql 15.19".

    Raises the SQLAlchemy error (e.g. `OperationalError`) when the database cannot be reached.
    """
    with engine.connect() as connection:
        connection.execute(text("SELECT 1")).scalar_one()
    version = ".".join(str(part) for part in engine.dialect.server_version_info or ())
    return f"{engine.dialect.name} {version}".strip()


@contextmanager
def transient_database_errors(what: str) -> Iterator[None]:
    """Raise the database errors a retry can outlive — the server stopped or restarting, a dropped connection, SQLite
    busy — as `RetryableError` (the worker runner retries them with backoff); any other error stays what it is.

    The pool is pre-pinged (`make_engine`), so after a restart the next attempt gets a fresh connection."""
    try:
        yield
    except (OperationalError, InterfaceError) as exc:
        raise RetryableError(f"{what}: the database is unavailable: {str(exc.orig or exc).strip()}") from exc
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        raise RetryableError(f"{what}: the connection was lost: {str(exc.orig or exc).strip()}") from exc
