"""The experience bank in SQL: experiences, every version of their text, and the bank's position in the op log.

The bank worker keeps its state in memory (`pipeline.bank.state.BankState`) and writes it here at every commit point:

    store = BankStore(engine)                  # after infra.db.migrate(engine)
    store.save(state, changed={"e1", "m1"}, position=BankPosition(
        topic="crl.experience-ops", partition=0, next_offset=state.next_offset, log_id=log_id,
        state_hash=state.state_hash(), applied=state.applied, duplicates=state.duplicates, rejected=state.rejected))
    store.position("crl.experience-ops")       # BankPosition(next_offset=..., state_hash=..., ...)
    store.experience("e1")                     # {"experience_id": "e1", "version": 2, "key": array(float16), ...}
    store.versions("e1")                       # [{"version": 1, "op_id": ..., "text": ...}, {"version": 2, ...}]
    store.load_state()                         # a BankState with the same state_hash() as the one saved

Tables (`infra.db`, migration 0002): `experiences` holds each experience at its current version, `experience_versions`
every version ever written with the op that wrote it, and `bank_position` the next op offset, log id, state hash and
counts of the stored view.

This is a projection, not a system of record: the op log `crl.experience-ops` is, and `crl replay bank` rebuilds the
bank from it. As in eventsourcing's tracking records, the position is written in the same transaction as the rows it
describes: one `save` per applied batch, all or nothing, so a crash leaves the rows and the position of one batch
boundary together. Re-applying ops after a restart is idempotent: experience rows are upserted with their current
values, versions are insert-or-ignore on (experience_id, version), and the position row is overwritten.

The op ids the state machine has seen (`BankState.seen_op_ids`, its duplicate filter) are not stored here. A state
from `load_state()` therefore treats a re-delivered op as new; to continue applying the log, start from a snapshot
(`pipeline.bank.snapshots`, which carries them) or replay from offset 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, RowMapping, Table, case, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from infra.db import (
    bank_position,
    experience_served,
    experience_versions,
    experiences,
    extraction_events,
    extractor_batches,
)
from pipeline.bank.state import BankState, Experience, ExperienceVersion
from pipeline.errors import (
    HashMismatchError,
    InvalidArgumentError,
    UnknownItemError,
)
from schemas.topics import EXPERIENCE_OPS_TOPIC

# The dialects' own `insert`s: the generic one has no ON CONFLICT clause.
_INSERTS: dict[str, Callable[[Table], postgresql.Insert | sqlite.Insert]] = {
    "postgresql": postgresql.insert, "sqlite": sqlite.insert,
}

# Ids per `IN (...)` list: well below SQLite's bound-parameter limit, whatever the batch size.
_IDS_PER_QUERY = 500

_JSON_TUPLES = ("parents", "source_trajectory_ids")
"""List-valued columns that `Experience` and `ExperienceVersion` hold as tuples."""


@dataclass
class TrainingUsage:
    """What the extractor trained on, as the bank worker read it since its last save."""

    extractions: dict[str, str] = field(default_factory=dict)
    """ExtractionGenerated event id -> generation id."""
    batches: list[tuple[int, str]] = field(default_factory=list)
    """(extractor training step, ExtractionGenerated event id) for every event in the step's batch."""

    def __bool__(self) -> bool:
        return bool(self.extractions or self.batches)


@dataclass(frozen=True)
class BankPosition:
    """Where the stored bank stands in one partition of the op log, and what it looked like there."""

    topic: str
    partition: int
    next_offset: int
    """The first op offset the stored view does not include yet."""
    log_id: str
    """The Kafka topic id of the log `next_offset` counts in."""
    state_hash: str
    """`BankState.state_hash()` of the stored view."""
    applied: int
    duplicates: int
    rejected: int


def _json(values: Iterable[Any]) -> str:
    return json.dumps(list(values), ensure_ascii=False, separators=(",", ":"))


def _key_bytes(key: np.ndarray) -> bytes:
    return np.asarray(key).astype("<f2").tobytes()


def _key_array(raw: bytes | memoryview) -> np.ndarray:
    key = np.frombuffer(bytes(raw), dtype="<f2").copy()
    key.setflags(write=False)  # as in BankState: keys are shared with the index and never edited in place
    return key


def _chunks(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


class BankStore:
    """The bank's SQL projection: `save` one batch at a time, read it back row by row or as a whole `BankState`."""

    def __init__(self, engine: Engine) -> None:
        dialect = engine.dialect.name
        if dialect not in _INSERTS:
            raise InvalidArgumentError(f"BankStore does not support the {dialect!r} database; use one of "
                                       f"{sorted(_INSERTS)}")
        self.engine = engine
        insert = _INSERTS[dialect]

        upsert = insert(experiences)
        self._upsert_experiences = upsert.on_conflict_do_update(
            index_elements=[experiences.c.experience_id],
            set_={column.name: upsert.excluded[column.name] for column in experiences.c if not column.primary_key},
        )
        self._insert_versions = insert(experience_versions).on_conflict_do_nothing(
            index_elements=[experience_versions.c.experience_id, experience_versions.c.version]
        )
        self._insert_served = insert(experience_served).on_conflict_do_nothing(
            index_elements=[experience_served.c.trajectory_id, experience_served.c.experience_id]
        )
        self._insert_extractions = insert(extraction_events).on_conflict_do_nothing(
            index_elements=[extraction_events.c.event_id])
        self._insert_batches = insert(extractor_batches).on_conflict_do_nothing(
            index_elements=[extractor_batches.c.step, extractor_batches.c.event_id])
        upsert = insert(bank_position)
        self._upsert_position = upsert.on_conflict_do_update(
            index_elements=[bank_position.c.topic, bank_position.c.partition],
            set_={column.name: upsert.excluded[column.name] for column in bank_position.c if not column.primary_key},
        )

    # -- writing --------------------------------------------------------------------------------------------------

    def save(self, state: BankState, changed: Iterable[str], position: BankPosition,
             served: Sequence[Mapping[str, Any]] = (), usage: TrainingUsage | None = None) -> None:
        """Write the experiences `changed` since the last save, their new versions and `position`, in one transaction.

        `changed` must name every experience whose row differs from the stored one: those an applied op touched
        (`Applied.touched`); counters are recounted from the usage tables, never taken from `state`. Saving the same
        state and position again changes nothing. Raises `KeyError`, writing nothing, if an id is not in `state`;
        any database error rolls back the whole save, position included.

        `served` rows (columns of `experience_served`: trajectory_id, experience_id, version, generation_id,
        bank_offset, step, success, reward) are inserted unless already there, and `experiences.retrievals` is
        recounted from that table for every experience they or `changed` name, so a re-delivered trajectory never
        counts twice. `usage` (extraction events and extractor training batches) is recorded the same way and
        `trainings` / `last_trained_step` are recounted for every experience it can touch.
        """
        # A fixed row order keeps two concurrent saves from locking the same rows in opposite orders (deadlock).
        ids = sorted(set(changed))
        unknown = [experience_id for experience_id in ids if experience_id not in state.experiences]
        if unknown:
            raise UnknownItemError(f"the bank state has no experience {', '.join(unknown)}; nothing was saved")
        rows = [self._experience_row(state, state.experiences[experience_id]) for experience_id in ids]
        position_row = {
            "topic": position.topic, "partition": position.partition, "next_offset": position.next_offset,
            "log_id": position.log_id, "state_hash": position.state_hash, "applied": position.applied,
            "duplicates": position.duplicates, "rejected": position.rejected, "updated_at": datetime.now(UTC),
        }
        with self.engine.begin() as connection:
            if rows:
                connection.execute(self._upsert_experiences, rows)
                versions = self._new_versions(connection, state, ids)
                if versions:
                    connection.execute(self._insert_versions, versions)
            self._record_served(connection, served, ids)
            self._record_training(connection, usage or TrainingUsage(), ids)
            connection.execute(self._upsert_position, [position_row])

    def record_usage(self, served: Sequence[Mapping[str, Any]], usage: TrainingUsage) -> None:
        """Record `served` rows and training `usage` (see `save`) in one transaction of its own."""
        if served or usage:
            with self.engine.begin() as connection:
                self._record_served(connection, served, ())
                self._record_training(connection, usage, ())

    def _record_training(self, connection: Connection, usage: TrainingUsage, changed: Sequence[str]) -> None:
        if usage.extractions:
            connection.execute(self._insert_extractions, [{"event_id": e, "generation_id": g}
                                                          for e, g in usage.extractions.items()])
        if usage.batches:
            connection.execute(self._insert_batches, [{"step": step, "event_id": e} for step, e in usage.batches])
        # Experiences whose versions were written by a generation the new rows name, in either order of arrival.
        event_ids = sorted({e for _step, e in usage.batches} | set(usage.extractions))
        touched = set(changed)
        for chunk in _chunks(event_ids, 500):
            generations = select(extraction_events.c.generation_id).where(extraction_events.c.event_id.in_(chunk))
            touched |= set(connection.execute(
                select(experience_versions.c.experience_id).distinct()
                .where(experience_versions.c.generation_id.in_(generations))).scalars())
        if not touched:
            return

        def over_trained_steps(aggregate: Any) -> Any:
            # The extractor steps whose batch holds a generation that wrote a version of this experience row.
            return (select(aggregate)
                    .select_from(extractor_batches)
                    .join(extraction_events, extraction_events.c.event_id == extractor_batches.c.event_id)
                    .join(experience_versions,
                          experience_versions.c.generation_id == extraction_events.c.generation_id)
                    .where(experience_versions.c.experience_id == experiences.c.experience_id)
                    .scalar_subquery())

        for chunk in _chunks(sorted(touched), 500):
            connection.execute(update(experiences).where(experiences.c.experience_id.in_(chunk)).values(
                trainings=over_trained_steps(func.count(func.distinct(extractor_batches.c.step))),
                last_trained_step=over_trained_steps(func.max(extractor_batches.c.step)),
            ))

    def _record_served(self, connection: Connection, served: Sequence[Mapping[str, Any]],
                       changed: Sequence[str]) -> None:
        if served:
            connection.execute(self._insert_served, [dict(row) for row in served])
        recount = sorted(set(changed) | {row["experience_id"] for row in served})
        counted = (select(func.count()).select_from(experience_served)
                   .where(experience_served.c.experience_id == experiences.c.experience_id)
                   .scalar_subquery())
        for chunk in _chunks(recount, 500):
            connection.execute(update(experiences).where(experiences.c.experience_id.in_(chunk))
                               .values(retrievals=counted))

    @staticmethod
    def _experience_row(state: BankState, experience: Experience) -> dict[str, Any]:
        return {
            "experience_id": experience.experience_id,
            "task_family": experience.task_family,
            "text": experience.text,
            "version": experience.version,
            "status": experience.status,
            "merged_into": experience.merged_into,
            "parents": _json(experience.parents),
            "generation_id": experience.generation_id,
            "extractor_version": experience.extractor_version,
            "source_trajectory_ids": _json(experience.source_trajectory_ids),
            "retired_reason": experience.retired_reason,
            # Every key of a bank comes from the bank's one embedding model (the state machine rejects others).
            "key_model": state.key_model,
            "key_dim": int(experience.key.size),
            "key": _key_bytes(experience.key),
            "op_offsets": _json(experience.op_offsets),
            "retrievals": experience.retrievals,
            "trainings": experience.trainings,
            "last_trained_step": experience.last_trained_step,
        }

    @staticmethod
    def _new_versions(connection: Connection, state: BankState, ids: Sequence[str]) -> list[dict[str, Any]]:
        # Versions are only ever appended, and a save writes an experience's whole history at once, so the stored
        # versions of an id are 1..max: only the ones above need sending. The insert still ignores conflicts, so a
        # concurrent or repeated save cannot fail on a version that is already there.
        columns = experience_versions.c
        stored: dict[str, int] = {}
        for chunk in _chunks(ids, _IDS_PER_QUERY):
            query = (select(columns.experience_id, func.max(columns.version))
                     .where(columns.experience_id.in_(chunk)).group_by(columns.experience_id))
            stored.update(dict(connection.execute(query).all()))
        return [
            {
                "experience_id": experience_id, "version": version.version, "text": version.text,
                "op_id": version.op_id, "op_kind": version.op_kind, "op_offset": version.op_offset,
                "generation_id": version.generation_id, "extractor_version": version.extractor_version,
                "source_trajectory_ids": _json(version.source_trajectory_ids),
            }
            for experience_id in ids
            for version in state.experiences[experience_id].history
            if version.version > stored.get(experience_id, 0)
        ]

    # -- reading --------------------------------------------------------------------------------------------------

    def position(self, topic: str, partition: int = 0) -> BankPosition | None:
        """The stored position in `topic`'s `partition`, or None if the bank never saved one there."""
        columns = bank_position.c
        query = select(bank_position).where(columns.topic == topic, columns.partition == partition)
        with self.engine.connect() as connection:
            row = connection.execute(query).mappings().first()
        return None if row is None else self._position(row)

    @staticmethod
    def _position(row: RowMapping) -> BankPosition:
        return BankPosition(
            topic=row["topic"], partition=row["partition"], next_offset=row["next_offset"], log_id=row["log_id"],
            state_hash=row["state_hash"], applied=row["applied"], duplicates=row["duplicates"],
            rejected=row["rejected"],
        )

    def experience(self, experience_id: str) -> dict[str, Any] | None:
        """One experience's row, or None: list columns decoded (tuples as in `Experience`), `key` a float16 array."""
        query = select(experiences).where(experiences.c.experience_id == experience_id)
        with self.engine.connect() as connection:
            row = connection.execute(query).mappings().first()
        return None if row is None else self._decode_experience(row)

    def experiences(self, status: str | None = None, task_family: str | None = None) -> list[dict[str, Any]]:
        """Experience rows (decoded as in `experience`) in id order, optionally of one status and/or task family."""
        query = select(experiences).order_by(experiences.c.experience_id)
        if status is not None:
            query = query.where(experiences.c.status == status)
        if task_family is not None:
            query = query.where(experiences.c.task_family == task_family)
        with self.engine.connect() as connection:
            return [self._decode_experience(row) for row in connection.execute(query).mappings()]

    def successes(self) -> dict[str, int]:
        """For every experience served at least once, how many of the episodes it guided succeeded."""
        columns = experience_served.c
        query = (select(columns.experience_id, func.sum(case((columns.success, 1), else_=0)))
                 .group_by(columns.experience_id))
        with self.engine.connect() as connection:
            return {experience_id: int(wins) for experience_id, wins in connection.execute(query)}

    def versions(self, experience_id: str) -> list[dict[str, Any]]:
        """Every stored version of one experience, oldest first, with the op that wrote it; [] for an unknown id."""
        columns = experience_versions.c
        query = select(experience_versions).where(columns.experience_id == experience_id).order_by(columns.version)
        with self.engine.connect() as connection:
            return [self._decode_version(row) for row in connection.execute(query).mappings()]

    @staticmethod
    def _decode_experience(row: RowMapping) -> dict[str, Any]:
        record = dict(row)
        for name in _JSON_TUPLES:
            record[name] = tuple(json.loads(record[name]))
        record["op_offsets"] = json.loads(record["op_offsets"])
        record["key"] = _key_array(record["key"])
        return record

    @staticmethod
    def _decode_version(row: RowMapping) -> dict[str, Any]:
        record = dict(row)
        record["source_trajectory_ids"] = tuple(json.loads(record["source_trajectory_ids"]))
        return record

    def load_state(self, key_model: str | None = None) -> BankState:
        """Rebuild the `BankState` stored here: experiences with their histories and counters, the key space, and
        next offset and counts from the position in `crl.experience-ops` partition 0 (zeros if none was saved).

        The result has no `seen_op_ids` (they are not stored; see the module docstring). Raises `ValueError` if the
        rows do not hash to the stored position's `state_hash` (the view was edited, or a save left out changed
        ids), if they mix embedding models, or if `key_model` is given and the stored keys come from another model.
        """
        with self._read_snapshot() as connection:
            rows = connection.execute(select(experiences).order_by(experiences.c.experience_id)).mappings().all()
            version_rows = connection.execute(
                select(experience_versions).order_by(experience_versions.c.experience_id,
                                                     experience_versions.c.version)
            ).mappings().all()
            position_row = connection.execute(
                select(bank_position).where(bank_position.c.topic == EXPERIENCE_OPS_TOPIC.name,
                                            bank_position.c.partition == 0)
            ).mappings().first()

        state = BankState()
        key_spaces = sorted({(row["key_model"], row["key_dim"]) for row in rows})
        if len(key_spaces) > 1:
            raise InvalidArgumentError(f"the stored bank mixes key spaces {key_spaces}; a bank's keys come from one "
                                       "model")
        if key_spaces:
            state.key_model, state.key_dim = key_spaces[0]
            if key_model is not None and key_model != state.key_model:
                raise InvalidArgumentError(f"the stored bank's keys come from {state.key_model} ({state.key_dim}-d), "
                                 f"not from {key_model}")

        histories: dict[str, list[ExperienceVersion]] = {}
        for row in version_rows:
            version = self._decode_version(row)
            histories.setdefault(version.pop("experience_id"), []).append(ExperienceVersion(**version))
        for row in rows:
            record = self._decode_experience(row)
            del record["key_model"], record["key_dim"]
            record["history"] = histories.get(record["experience_id"], [])
            state.experiences[record["experience_id"]] = Experience(**record)

        if position_row is not None:
            position = self._position(position_row)
            state.next_offset = position.next_offset
            state.applied, state.duplicates, state.rejected = position.applied, position.duplicates, position.rejected
            if state.state_hash() != position.state_hash:
                raise HashMismatchError(
                    f"the stored bank does not match its position: its rows hash to {state.state_hash()}, but the "
                    f"position at offset {position.next_offset} records {position.state_hash}; rebuild it from the "
                    "op log (`crl replay bank`)"
                )
        return state

    def _read_snapshot(self) -> Connection:
        # The three reads of load_state must see one committed state, not rows of one batch and the position of the
        # next. PostgreSQL's default READ COMMITTED takes a new snapshot per statement; REPEATABLE READ keeps one.
        # SQLite transactions here begin IMMEDIATE (infra.db), which already shuts writers out until the end.
        connection = self.engine.connect()
        if self.engine.dialect.name == "postgresql":
            connection = connection.execution_options(isolation_level="REPEATABLE READ")
        return connection
