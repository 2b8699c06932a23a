"""Input positions of workers that consume in Kafka assign mode, kept in the run's database.

A worker that assigns itself partitions (instead of joining a consumer group) has no group offsets in Kafka, so it
keeps its positions in the `consumer_offsets` table (`infra.db`): one row per (worker, topic, partition) holding the
next offset to read. The runner saves positions only after the outputs of the records before them are flushed to
the broker, so a crash between the flush and the save replays those records: delivery is at least once, and the
handlers downstream must be idempotent.

    store = SqlOffsetStore(engine, worker="bank-0")
    positions = store.load()    # {("crl.experience-ops", 0): LogPosition(next_offset=1234, log_id="01a2...")}
    store.save({("crl.experience-ops", 0): LogPosition(1300, "01a2...")})  # after outputs up to 1299 are flushed

Each position names the log it counts in (`log_id`, the Kafka topic id). Saving is one transaction over all given
partitions, and a position never moves backwards within one log: a lower offset than the stored one in the same log
raises `ValueError` and nothing of that save is written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import NamedTuple

from sqlalchemy import Connection, Engine, Table, select
from sqlalchemy.dialects import postgresql, sqlite

from infra.db import consumer_offsets, transient_database_errors
from pipeline.errors import InvalidArgumentError

TopicPartition = tuple[str, int]
"""A Kafka partition as (topic name, partition number)."""


class LogPosition(NamedTuple):
    """The next offset to read, and the log (Kafka topic id) it counts in."""

    next_offset: int
    log_id: str

# The dialects' own `insert`s: the generic one has no ON CONFLICT clause.
_INSERTS: dict[str, Callable[[Table], postgresql.Insert | sqlite.Insert]] = {
    "postgresql": postgresql.insert, "sqlite": sqlite.insert,
}


class SqlOffsetStore:
    """The positions of one worker instance, read and written in the `consumer_offsets` table."""

    def __init__(self, engine: Engine, worker: str) -> None:
        dialect = engine.dialect.name
        if dialect not in _INSERTS:
            raise InvalidArgumentError(f"SqlOffsetStore does not support the {dialect!r} database; use one of "
                                       f"{sorted(_INSERTS)}")
        self.engine = engine
        self.worker = worker
        self._insert = _INSERTS[dialect]

    def load(self) -> dict[TopicPartition, LogPosition]:
        """Return this worker's position per (topic, partition); partitions it never saved are absent."""
        columns = consumer_offsets.c
        query = select(columns.topic, columns.partition, columns.next_offset, columns.log_id).where(
            columns.worker == self.worker
        )
        with transient_database_errors(f"loading {self.worker}'s positions"), self.engine.connect() as connection:
            return {
                (topic, partition): LogPosition(next_offset, log_id)
                for topic, partition, next_offset, log_id in connection.execute(query)
            }

    def save(self, positions: Mapping[TopicPartition, LogPosition]) -> None:
        """Store the next offset of every given partition in one transaction; other partitions keep theirs.

        Raises `ValueError`, writing none of `positions`, if an offset is negative or lower than the stored one.
        """
        for (topic, partition), (next_offset, _log_id) in positions.items():
            if next_offset < 0:
                raise InvalidArgumentError(f"topic {topic!r} partition {partition}: next offset must be >= 0, "
                                           f"got {next_offset}")
        if not positions:
            return
        updated_at = datetime.now(UTC)
        with transient_database_errors(f"saving {self.worker}'s positions"), self.engine.begin() as connection:
            # A fixed row order keeps two concurrent saves from locking the same rows in opposite orders (deadlock).
            for (topic, partition), position in sorted(positions.items()):
                self._upsert(connection, topic, partition, position, updated_at)

    def _upsert(self, connection: Connection, topic: str, partition: int, position: LogPosition, at: datetime) -> None:
        next_offset = position.next_offset
        insert = self._insert(consumer_offsets).values(
            worker=self.worker, topic=topic, partition=partition, next_offset=next_offset, log_id=position.log_id,
            updated_at=at,
        )
        # The "not backwards" test sits in the upsert's WHERE so check and write are one statement, with no window
        # for another writer between a read and the update. A new log starts counting again, so it may go lower.
        upsert = insert.on_conflict_do_update(
            index_elements=[consumer_offsets.c.worker, consumer_offsets.c.topic, consumer_offsets.c.partition],
            set_={
                "next_offset": insert.excluded.next_offset,
                "log_id": insert.excluded.log_id,
                "updated_at": insert.excluded.updated_at,
            },
            where=(consumer_offsets.c.next_offset <= insert.excluded.next_offset)
            | (consumer_offsets.c.log_id != insert.excluded.log_id),
        )
        # RETURNING yields the row only if it was inserted or updated; rowcount is not reliable for upserts.
        if connection.execute(upsert.returning(consumer_offsets.c.next_offset)).first() is not None:
            return
        stored = connection.execute(
            select(consumer_offsets.c.next_offset).where(
                consumer_offsets.c.worker == self.worker,
                consumer_offsets.c.topic == topic,
                consumer_offsets.c.partition == partition,
            )
        ).scalar_one()
        # Raising inside engine.begin() rolls back the positions this save already wrote.
        raise InvalidArgumentError(
            f"worker {self.worker!r}, topic {topic!r} partition {partition}: stored next offset is {stored}, "
            f"refusing to move it backwards to {next_offset}"
        )


class FromTheStart:
    """An offset store that keeps nothing: a worker whose state is a projection it rebuilds at every start (the
    extractor trainer's join, the scheduler's view of the run) reads its inputs from offset 0 each time."""

    def load(self) -> dict[TopicPartition, LogPosition]:
        return {}

    def save(self, positions: Mapping[TopicPartition, LogPosition]) -> None:
        return None
