"""The bank's SQL store on SQLite and PostgreSQL: exact round trips, idempotent re-application, one transaction."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import numpy as np
import pytest
from alembic import command
from experience_ops import MODEL, add, key, merge, refine, retire
from sqlalchemy import (
    BigInteger,
    DateTime,
    Engine,
    Integer,
    LargeBinary,
    String,
    Text,
    create_mock_engine,
    event,
    func,
    inspect,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from infra.db import alembic_config, bank_position, current_revision, experience_versions, experiences, migrate
from pipeline.bank.state import Applied, BankState, Duplicate, Rejected
from pipeline.bank.store import BankPosition, BankStore, TrainingUsage
from schemas.topics import EXPERIENCE_OPS_TOPIC

pytestmark = pytest.mark.integration

TOPIC = EXPERIENCE_OPS_TOPIC.name
LOG_ID = "log-0001"
BANK_TABLES = ("experiences", "experience_versions", "bank_position")


# --- ops and states, built with the real state machine -------------------------------------------------------------


# Offsets 0-4: three adds (one in another family, one with a key that float16 rounds), a refine, a duplicate.
BATCH_1 = [
    add("o1", "e1", "go to the stairs"),
    add("o2", "e2", "open the door first", vector=key(0.1, -0.33333, 2.5, 1e-3)),
    add("o3", "e3", "follow the left wall", family="maze"),
    refine("o4", "e2", 1, "open the door, then go straight"),
    add("o1", "e1", "go to the stairs"),
]
# Offsets 5-8: a merge of e1 and e2 (v2), a stale refine (rejected), a retire, a refine of the merged experience.
BATCH_2 = [
    merge("o5", "m1", {"e1": 1, "e2": 2}),
    refine("o6", "e2", 1, "stale rewrite"),
    retire("o7", "e3", 1, "capacity"),
    refine("o8", "m1", 1, "merged and tightened"),
]


def apply_batch(state: BankState, ops: list, first_offset: int) -> set[str]:
    """Apply `ops` at consecutive offsets; return the ids they touched, as the bank worker collects them."""
    changed: set[str] = set()
    for offset, op in enumerate(ops, start=first_offset):
        outcome = state.apply(op, offset)
        if isinstance(outcome, Applied):
            changed.update(outcome.touched)
    return changed


def served_rows(state: BankState, pairs: list[tuple[str, str]]) -> list[dict]:
    """experience_served rows: trajectory `t` was guided by the current version of experience `e`."""
    return [
        {"trajectory_id": t, "experience_id": e, "version": state.experiences[e].version,
         "generation_id": state.experiences[e].generation_id, "bank_offset": state.next_offset, "step": 1,
         "success": True, "reward": 1.0}
        for t, e in pairs
    ]


def trained_usage(state: BankState, step: int, experience_ids: list[str]) -> TrainingUsage:
    """Extractor step `step` trained on the generations that wrote the current versions of `experience_ids`."""
    generations = {state.experiences[e].generation_id for e in experience_ids}
    extractions = {f"event-of-{g}": g for g in sorted(generations)}
    return TrainingUsage(extractions=extractions, batches=[(step, event) for event in extractions])


def position_of(state: BankState, log_id: str = LOG_ID) -> BankPosition:
    return BankPosition(topic=TOPIC, partition=0, next_offset=state.next_offset, log_id=log_id,
                        state_hash=state.state_hash(), applied=state.applied, duplicates=state.duplicates,
                        rejected=state.rejected)


def expected_row(state: BankState, experience_id: str) -> dict[str, Any]:
    """What `BankStore.experience` must return for one experience of `state`, key left out (compared as bytes)."""
    record = asdict(state.experiences[experience_id])
    del record["history"], record["key"]
    return {**record, "key_model": state.key_model, "key_dim": state.key_dim}


def table_contents(engine: Engine) -> dict[str, list[tuple]]:
    """Every row of the bank's tables (bank_position without its wall-clock `updated_at`), in key order."""
    position_columns = [column for column in bank_position.c if column.name != "updated_at"]
    with engine.connect() as connection:
        return {
            "experiences": [tuple(row) for row in connection.execute(
                select(experiences).order_by(experiences.c.experience_id))],
            "experience_versions": [tuple(row) for row in connection.execute(
                select(experience_versions).order_by(experience_versions.c.experience_id,
                                                     experience_versions.c.version))],
            "bank_position": [tuple(row) for row in connection.execute(
                select(*position_columns).order_by(bank_position.c.topic, bank_position.c.partition))],
        }


@pytest.fixture
def store(db_engine: Engine) -> BankStore:
    assert migrate(db_engine) == "0004"
    return BankStore(db_engine)


@pytest.fixture
def saved(store: BankStore) -> BankState:
    """BATCH_1 applied and saved."""
    state = BankState()
    store.save(state, apply_batch(state, BATCH_1, 0), position_of(state))
    return state


# --- migration 0002 ------------------------------------------------------------------------------------------------

# name: (type, length, nullable), in column order; the migration, the model in infra.db and this must agree.
COLUMNS: dict[str, dict[str, tuple[type, int | None, bool]]] = {
    "experiences": {
        "experience_id": (String, 256, False), "task_family": (String, 256, False), "text": (Text, None, False),
        "version": (Integer, None, False), "status": (String, 16, False), "merged_into": (String, 256, True),
        "parents": (Text, None, False), "generation_id": (String, 256, False),
        "extractor_version": (Integer, None, False), "source_trajectory_ids": (Text, None, False),
        "retired_reason": (String, 64, True), "key_model": (String, 256, False), "key_dim": (Integer, None, False),
        "key": (LargeBinary, None, False), "op_offsets": (Text, None, False), "retrievals": (Integer, None, False),
        "trainings": (Integer, None, False), "last_trained_step": (BigInteger, None, True),
    },
    "experience_versions": {
        "experience_id": (String, 256, False), "version": (Integer, None, False), "text": (Text, None, False),
        "op_id": (String, 256, False), "op_kind": (String, 64, False), "op_offset": (BigInteger, None, False),
        "generation_id": (String, 256, False), "extractor_version": (Integer, None, False),
        "source_trajectory_ids": (Text, None, False),
    },
    "bank_position": {
        "topic": (String, 255, False), "partition": (Integer, None, False), "next_offset": (BigInteger, None, False),
        "log_id": (String, 64, False), "state_hash": (String, 64, False), "applied": (BigInteger, None, False),
        "duplicates": (BigInteger, None, False), "rejected": (BigInteger, None, False),
        "updated_at": (DateTime, None, False),
    },
}
PRIMARY_KEYS = {"experiences": ["experience_id"], "experience_versions": ["experience_id", "version"],
                "bank_position": ["topic", "partition"]}
MODELS = {"experiences": experiences, "experience_versions": experience_versions, "bank_position": bank_position}


def _described(column_type: Any) -> tuple[type, int | None]:
    # Most specific of the spec's types first: Text is a String, BigInteger an Integer.
    for kind in (Text, String, BigInteger, Integer, LargeBinary, DateTime):
        if isinstance(column_type, kind):
            return kind, getattr(column_type, "length", None)
    raise AssertionError(f"unexpected column type {column_type!r}")


def test_migration_0002_creates_the_bank_tables_as_declared(db_engine: Engine) -> None:
    assert migrate(db_engine) == "0004"
    assert current_revision(db_engine) == "0004"
    inspector = inspect(db_engine)
    for table, spec in COLUMNS.items():
        reflected = inspector.get_columns(table)
        assert [column["name"] for column in reflected] == list(spec)
        assert {c["name"]: (*_described(c["type"]), c["nullable"]) for c in reflected} == spec
        assert {c.name: (*_described(c.type), c.nullable) for c in MODELS[table].columns} == spec
        assert inspector.get_pk_constraint(table)["constrained_columns"] == PRIMARY_KEYS[table]
    assert [(index["name"], index["column_names"]) for index in inspector.get_indexes("experiences")] == [
        ("ix_experiences_task_family_status", ["task_family", "status"])]
    assert [(index.name, [c.name for c in index.columns]) for index in experiences.indexes] == [
        ("ix_experiences_task_family_status", ["task_family", "status"])]
    if db_engine.dialect.name == "postgresql":  # SQLite has no time zone type to reflect
        assert {c["name"]: c["type"] for c in inspector.get_columns("bank_position")}["updated_at"].timezone


def test_downgrade_to_0001_drops_only_the_bank_tables(store: BankStore, db_engine: Engine) -> None:
    with db_engine.begin() as connection:
        command.downgrade(alembic_config(connection), "0001")
    assert current_revision(db_engine) == "0001"
    tables = set(inspect(db_engine).get_table_names())
    assert tables.isdisjoint(BANK_TABLES) and "consumer_offsets" in tables

    assert migrate(db_engine) == "0004"
    assert set(BANK_TABLES) <= set(inspect(db_engine).get_table_names())


# --- save and read back --------------------------------------------------------------------------------------------


def test_saved_experiences_read_back_exactly(store: BankStore, saved: BankState) -> None:
    for experience_id in ("e1", "e2", "e3"):
        row = store.experience(experience_id)
        key_vector = row.pop("key")
        assert row == expected_row(saved, experience_id)
        assert key_vector.dtype == np.dtype("<f2")
        assert key_vector.tobytes() == saved.experiences[experience_id].key.tobytes()

    e2 = store.experience("e2")
    assert (e2["text"], e2["version"], e2["status"], e2["merged_into"], e2["retired_reason"]) == (
        "open the door, then go straight", 2, "active", None, None)
    assert (e2["parents"], e2["source_trajectory_ids"], e2["op_offsets"]) == ((), ("traj-o2", "traj-o4"), [1, 3])
    assert (e2["generation_id"], e2["extractor_version"], e2["key_model"], e2["key_dim"]) == ("gen-o4", 1, MODEL, 4)
    # float16 rounding happened once, in the event; the store keeps those exact bits.
    assert e2["key"].tolist() == np.array([0.1, -0.33333, 2.5, 1e-3], dtype="<f2").tolist()
    assert (e2["retrievals"], e2["trainings"], e2["last_trained_step"]) == (0, 0, None)
    assert store.experience("ghost") is None


def test_versions_list_every_version_with_its_op(store: BankStore, saved: BankState) -> None:
    assert store.versions("e2") == [
        {"experience_id": "e2", "version": 1, "text": "open the door first", "op_id": "o2",
         "op_kind": "ExperienceAdded", "op_offset": 1, "generation_id": "gen-o2", "extractor_version": 0,
         "source_trajectory_ids": ("traj-o2",)},
        {"experience_id": "e2", "version": 2, "text": "open the door, then go straight", "op_id": "o4",
         "op_kind": "ExperienceRefined", "op_offset": 3, "generation_id": "gen-o4", "extractor_version": 1,
         "source_trajectory_ids": ("traj-o4",)},
    ]
    for experience_id, experience in saved.experiences.items():
        assert store.versions(experience_id) == [
            {"experience_id": experience_id, **asdict(version)} for version in experience.history]
    assert store.versions("ghost") == []


def test_position_round_trips(store: BankStore, saved: BankState) -> None:
    assert store.position(TOPIC) == BankPosition(topic=TOPIC, partition=0, next_offset=5, log_id=LOG_ID,
                                                 state_hash=saved.state_hash(), applied=4, duplicates=1, rejected=0)
    assert store.position(TOPIC, 1) is None
    assert store.position("crl.other") is None


def test_a_later_batch_updates_rows_appends_versions_and_moves_the_position(store: BankStore,
                                                                          saved: BankState) -> None:
    changed = apply_batch(saved, BATCH_2, 5)
    # What the usage rows below make SQL count, mirrored on the state the rows are compared with.
    saved.experiences["m1"].retrievals, saved.experiences["e3"].retrievals = 2, 1
    saved.experiences["m1"].trainings, saved.experiences["m1"].last_trained_step = 1, 17
    changed |= {"m1", "e3"}
    store.save(saved, changed, position_of(saved),
               served=served_rows(saved, [("t1", "m1"), ("t2", "m1"), ("t3", "e3")]),
               usage=trained_usage(saved, step=17, experience_ids=["m1"]))

    for experience_id in ("e1", "e2", "e3", "m1"):
        row = store.experience(experience_id)
        key_vector = row.pop("key")
        assert row == expected_row(saved, experience_id)
        assert key_vector.tobytes() == saved.experiences[experience_id].key.tobytes()
    m1 = store.experience("m1")
    assert (m1["text"], m1["version"], m1["status"], m1["parents"], m1["op_offsets"]) == (
        "merged and tightened", 2, "active", ("e1", "e2"), [5, 8])
    assert (m1["retrievals"], m1["trainings"], m1["last_trained_step"]) == (2, 1, 17)
    e2 = store.experience("e2")
    assert (e2["version"], e2["status"], e2["merged_into"], e2["retired_reason"], e2["op_offsets"]) == (
        2, "retired", "m1", "merged", [1, 3, 5])
    e3 = store.experience("e3")
    assert (e3["status"], e3["merged_into"], e3["retired_reason"], e3["retrievals"]) == (
        "retired", None, "capacity", 1)
    assert [(v["version"], v["op_id"], v["op_offset"]) for v in store.versions("m1")] == [(1, "o5", 5), (2, "o8", 8)]
    assert [v["version"] for v in store.versions("e2")] == [1, 2]  # retiring writes no version
    assert store.position(TOPIC) == BankPosition(topic=TOPIC, partition=0, next_offset=9, log_id=LOG_ID,
                                                 state_hash=saved.state_hash(), applied=7, duplicates=1, rejected=1)


def test_experiences_filter_by_status_and_task_family_in_id_order(store: BankStore, saved: BankState) -> None:
    store.save(saved, apply_batch(saved, BATCH_2, 5), position_of(saved))

    def ids(**filters: str) -> list[str]:
        return [row["experience_id"] for row in store.experiences(**filters)]

    assert ids() == ["e1", "e2", "e3", "m1"]
    assert ids(status="active") == ["m1"]
    assert ids(status="retired") == ["e1", "e2", "e3"]
    assert ids(task_family="maze") == ["e3"]
    assert ids(status="active", task_family="room") == ["m1"]
    assert ids(status="active", task_family="maze") == []
    assert ids(status="retired", task_family="room") == ["e1", "e2"]
    assert store.experiences(status="active")[0]["key"].tobytes() == saved.experiences["m1"].key.tobytes()


# --- idempotence and transactions ----------------------------------------------------------------------------------


def test_saving_the_same_batch_twice_changes_nothing(store: BankStore, db_engine: Engine) -> None:
    state = BankState()
    changed = apply_batch(state, BATCH_1, 0)
    store.save(state, changed, position_of(state))
    first = table_contents(db_engine)
    store.save(state, changed, position_of(state))
    assert table_contents(db_engine) == first
    assert [len(first[table]) for table in BANK_TABLES] == [3, 4, 1]


def test_re_applying_a_batch_after_a_restart_from_a_snapshot_is_idempotent(store: BankStore, saved: BankState,
                                                                          db_engine: Engine) -> None:
    snapshot = saved.to_snapshot()
    store.save(saved, apply_batch(saved, BATCH_2, 5), position_of(saved))
    after_batch_2 = table_contents(db_engine)

    # The worker died after the save; it restarts from the older snapshot and applies BATCH_2 again.
    restarted = BankState.from_snapshot(snapshot)
    store.save(restarted, apply_batch(restarted, BATCH_2, 5), position_of(restarted))

    assert restarted.state_hash() == saved.state_hash()
    assert table_contents(db_engine) == after_batch_2


def test_a_failed_position_write_rolls_back_the_experience_rows(store: BankStore, saved: BankState,
                                                                 db_engine: Engine) -> None:
    before = table_contents(db_engine)
    changed = apply_batch(saved, BATCH_2, 5)
    statements: list[str] = []

    def record(connection: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(" ".join(statement.split()[:3]).upper())

    event.listen(db_engine, "before_cursor_execute", record)
    try:
        # The database refuses the position row (log_id is NOT NULL), after the experience rows were written.
        with pytest.raises(IntegrityError):
            store.save(saved, changed, replace(position_of(saved), log_id=None))
    finally:
        event.remove(db_engine, "before_cursor_execute", record)

    writes = [statement for statement in statements if statement.startswith("INSERT")]
    assert writes == ["INSERT INTO EXPERIENCES", "INSERT INTO EXPERIENCE_VERSIONS", "INSERT INTO BANK_POSITION"]
    assert table_contents(db_engine) == before
    assert store.experience("m1") is None and store.experience("e1")["status"] == "active"

    store.save(saved, changed, position_of(saved))  # the same batch goes through once the position is valid
    assert store.experience("m1")["version"] == 2
    assert store.position(TOPIC).next_offset == 9


def test_an_unknown_changed_id_raises_and_writes_nothing(store: BankStore, saved: BankState,
                                                         db_engine: Engine) -> None:
    before = table_contents(db_engine)
    changed = apply_batch(saved, BATCH_2, 5)
    with pytest.raises(KeyError, match="ghost"):
        store.save(saved, changed | {"ghost"}, position_of(saved))
    assert table_contents(db_engine) == before


def test_served_rows_count_once_per_trajectory_and_survive_a_replayed_batch(store: BankStore,
                                                                           saved: BankState) -> None:
    rows = served_rows(saved, [("t1", "e1"), ("t2", "e1"), ("t2", "e3")])
    store.save(saved, set(), position_of(saved), served=rows)
    store.save(saved, set(), position_of(saved), served=rows[:2])  # a re-delivered trajectory after a restart
    assert (store.experience("e1")["retrievals"], store.experience("e3")["retrievals"]) == (2, 1)
    assert store.experience("e2")["retrievals"] == 0


def test_training_counts_follow_extractor_batches_in_either_order_of_arrival(store: BankStore,
                                                                             saved: BankState) -> None:
    e1 = saved.experiences["e1"]
    # The step arrives before the extraction event that names its generation ...
    store.save(saved, set(), position_of(saved), usage=TrainingUsage(batches=[(4, "x1"), (6, "x1")]))
    assert store.experience("e1")["trainings"] == 0
    # ... and is counted once the generation is known; re-delivered rows change nothing.
    usage = TrainingUsage(extractions={"x1": e1.generation_id}, batches=[(6, "x1")])
    store.save(saved, set(), position_of(saved), usage=usage)
    store.save(saved, set(), position_of(saved), usage=usage)
    row = store.experience("e1")
    assert (row["trainings"], row["last_trained_step"]) == (2, 6)
    assert store.experience("e2")["trainings"] == 0


# --- load_state ----------------------------------------------------------------------------------------------------


def test_load_state_rebuilds_the_saved_state(store: BankStore, saved: BankState) -> None:
    changed = apply_batch(saved, BATCH_2, 5)
    saved.experiences["m1"].retrievals = 1
    saved.experiences["m1"].trainings, saved.experiences["m1"].last_trained_step = 1, 3
    store.save(saved, changed | {"m1"}, position_of(saved), served=served_rows(saved, [("t1", "m1")]),
               usage=trained_usage(saved, step=3, experience_ids=["m1"]))

    loaded = store.load_state(key_model=MODEL)

    assert loaded.state_hash() == saved.state_hash()
    assert (loaded.key_model, loaded.key_dim) == (MODEL, 4)
    assert (loaded.next_offset, loaded.applied, loaded.duplicates, loaded.rejected) == (9, 7, 1, 1)
    assert loaded.seen_op_ids == set()  # not stored: snapshots and replay carry them
    assert sorted(loaded.experiences) == sorted(saved.experiences)
    for experience_id, experience in saved.experiences.items():
        restored = loaded.experiences[experience_id]
        assert asdict(replace(restored, key=None)) == asdict(replace(experience, key=None))
        assert restored.key.dtype == np.dtype("<f2") and not restored.key.flags.writeable
        assert restored.key.tobytes() == experience.key.tobytes()
    # The loaded state goes on applying ops like the original.
    assert loaded.apply(refine("o9", "m1", 2, "v3"), 9) == saved.apply(refine("o9", "m1", 2, "v3"), 9)
    assert loaded.state_hash() == saved.state_hash()


def test_load_state_of_an_empty_bank_is_a_new_state(store: BankStore) -> None:
    loaded = store.load_state()
    assert loaded.experiences == {}
    assert (loaded.next_offset, loaded.applied, loaded.key_model) == (0, 0, None)
    assert loaded.state_hash() == BankState().state_hash()


def test_load_state_refuses_another_key_model(store: BankStore, saved: BankState) -> None:
    with pytest.raises(ValueError, match=f"keys come from {MODEL} \\(4-d\\), not from other-model"):
        store.load_state(key_model="other-model")


def test_load_state_refuses_rows_that_do_not_match_the_stored_hash(store: BankStore, saved: BankState,
                                                                  db_engine: Engine) -> None:
    with db_engine.begin() as connection:
        connection.execute(update(experiences).where(experiences.c.experience_id == "e1").values(text="edited"))
    with pytest.raises(ValueError, match="does not match its position"):
        store.load_state()


def test_the_store_refuses_other_databases() -> None:
    with pytest.raises(ValueError, match=r"'mysql' database; use one of \['postgresql', 'sqlite'\]"):
        BankStore(create_mock_engine("mysql://", executor=lambda *args, **kwargs: None))


def test_saved_counts_match_the_state_outcomes(store: BankStore, db_engine: Engine) -> None:
    state = BankState()
    outcomes = [state.apply(op, offset) for offset, op in enumerate(BATCH_1 + BATCH_2)]
    assert [type(outcome) for outcome in outcomes].count(Duplicate) == 1
    assert [type(outcome) for outcome in outcomes].count(Rejected) == 1
    store.save(state, list(state.experiences), position_of(state))
    with db_engine.connect() as connection:
        counts = {table.name: connection.execute(select(func.count()).select_from(table)).scalar_one()
                  for table in (experiences, experience_versions, bank_position)}
    # e1 v1, e2 v1-2, e3 v1, m1 v1-2: retires and merges into others write no versions.
    assert counts == {"experiences": 4, "experience_versions": 6, "bank_position": 1}
    assert store.load_state().state_hash() == state.state_hash()
