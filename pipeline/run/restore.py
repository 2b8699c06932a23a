"""Restore a run's log from its archive into a fresh broker: how `crl run --resume` continues a run whose embedded
Tansu (memory only) ended with its records.

    restored = restore_log(run_dir, kafka, engine)     # the broker's topics exist and are empty
    kafka = kafka.model_copy(update={"log_aliases": restored.aliases})
    commit_group_positions(kafka, restored.group_positions)

The archive (`RUN_DIR/archive/`) is the durable copy of the log: the archiver reads every partition in assign mode
and commits its position (`consumer_offsets`, worker `archiver`) only after the segment holding the records before
it is on disk. So every offset below that position is archived: as an event, or, for a record the archiver could not
decode, as the dead letter that carries its raw key, value and headers. Restoring writes, per partition and in offset
order, each of those records into the same topic and partition of the fresh broker, whose topics are new and empty,
and checks that each lands at its old offset. An event is written as the archive holds it (the JSON of the decoded
event, which is what the project's producers wrote) with the headers every event carries; a dead-lettered record
with its original bytes.

A restored topic has a new topic id. `RestoredLog.aliases` maps each new id to the id of the log it was restored
from; with them in `KafkaSettings.log_aliases` every worker names the restored log as before, so SQL positions,
bank snapshots, archive segments and dead-letter ids keep counting in it.

What the archive cannot have is the tail the broker had accepted but the archiver had not yet read when the broker
died (well under a second here; the archiver flushes what it has read when it stops). Outputs written there are
gone, so a consumer group is carried on from its latest commit whose outputs were all restored
(`pipeline.runtime.group_commits`) and re-reads from there; the scheduler re-issues what is missing. A worker whose
own position lies past the restored end read records that are gone and may have acted on them: the bank (a
projection of the log) is rebuilt from offset 0; any other such worker makes the restore fail, naming it. A trainer
acts on records before its position says so (it checkpoints a step, then publishes, then commits): its versions
trained on records the restored log lacks are removed (`drop_checkpoints_past`), so it trains those steps again on
the episodes played again in their place, and records what it trained on.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
from sqlalchemy import Engine, delete, select

from infra.admin import topic_ids
from infra.db import bank_position, consumer_offsets, metadata
from infra.kafka import KafkaSettings, commit_group_offsets, make_admin, make_producer
from pipeline.audit.archive import archive_root
from pipeline.bank.snapshots import snapshot_dirs, snapshots_root
from pipeline.errors import RunFailedError
from pipeline.rl.versions import checkpoints_root, event_id_for, version_dir, versions_in
from pipeline.runtime.blobs import BlobStore
from pipeline.runtime.group_commits import restorable_group_positions
from pipeline.runtime.harness import RawRecord
from pipeline.runtime.offsets import LogPosition, SqlOffsetStore, TopicPartition
from pipeline.runtime.runner import event_headers
from schemas.base import Role
from schemas.codec import DEFAULT_CLAIM_CHECK_BYTES, DEFAULT_MAX_PAYLOAD_BYTES, ClaimChecks, decode, encode
from schemas.dead_letters import DeadLetter, dead_letter_id
from schemas.topics import (
    DEAD_LETTERS,
    EXPERIENCE_OPS_TOPIC,
    EXTRACTIONS,
    POLICY,
    TOPICS,
    TRAIN_STEPS,
    TRAJECTORIES,
    Topic,
)

ARCHIVER = "archiver"
"""The worker whose SQL positions say how far the archive is complete."""
TRAINER_INPUTS: dict[Role, Topic] = {"actor": TRAJECTORIES, "extractor": EXTRACTIONS}
"""The topic whose events form each trainer's batches (`TrainStepCompleted.batch_event_ids`)."""
TRAINER_POSITIONS: dict[Role, str] = {"actor": "actor_trainer"}
"""The trainers that keep SQL positions (the extractor trainer reads its inputs from offset 0 at every start)."""
BANK_TABLES = ("experiences", "experience_versions", "bank_position", "experience_served", "extraction_events",
               "extractor_batches")
"""The bank worker's projection in SQL: emptied (with its positions) when it read past the restored log."""


@dataclass
class RestoredLog:
    """What `restore_log` wrote."""

    aliases: dict[str, str] = field(default_factory=dict)
    """New topic id -> the archived log's id."""
    ends: dict[TopicPartition, LogPosition] = field(default_factory=dict)
    """Where each restored partition ends, in the archived log's id."""
    records: int = 0
    from_dead_letters: int = 0
    group_positions: dict[str, dict[TopicPartition, int]] = field(default_factory=dict)
    bank_rebuilt: bool = False
    snapshots_dropped: int = 0
    checkpoints_dropped: dict[str, list[int]] = field(default_factory=dict)
    """Per trainer role, the versions removed because they were trained on records the restored log lacks."""


def restore_log(run_dir: Path, kafka: KafkaSettings, engine: Engine, carry_over: bool = True,
                claim_check_bytes: int = DEFAULT_CLAIM_CHECK_BYTES) -> RestoredLog:
    """Write the archived log of `run_dir` into the (fresh, empty) topics of the broker of `kafka`. Raises
    `RunFailedError` when the archive cannot give back the log as it was.

    `carry_over`: the run goes on in the restored log, so check and adjust what the workers keep (a worker past the
    archive fails the restore, a bank past it is emptied, snapshots and trainer versions past it removed) and work
    out the groups' positions. Without it nothing of the run is read or changed but the archive and the archiver's
    positions (a read-only look at the log, such as replaying the bank from Kafka after the run).

    The archive holds every event whole; one over `claim_check_bytes` (the run's setting) is claim-checked again on
    its way back, which gives the record it was (the blob's bytes are a function of the event)."""
    positions = SqlOffsetStore(engine, ARCHIVER).load()
    # No position at all: the broker died before the archiver had read anything, so the restored log is empty (and
    # a worker that had read something is named below).
    archived_ids = {topic: position.log_id for (topic, _), position in positions.items()}
    # A partition the archiver holds no position for had no record it read: the restored log has none there.
    restored = RestoredLog(ends={(topic.name, partition): positions.get((topic.name, partition),
                                                                         LogPosition(0, archived_ids[topic.name]))
                                 for topic in TOPICS if topic.name in archived_ids
                                 for partition in range(topic.partitions)})
    if carry_over:
        _check_positions(engine, restored.ends, run_dir)
        restored.checkpoints_dropped = drop_checkpoints_past(run_dir, engine, restored.ends)
    admin = make_admin(kafka, client_id="crl-restore")
    try:
        new_ids = topic_ids(admin, [topic.name for topic in TOPICS])
    finally:
        admin.close()
    restored.aliases = {new_ids[topic]: log_id for topic, log_id in archived_ids.items()}
    gaps = _dead_lettered_records(run_dir, archived_ids)
    producer = make_producer(kafka, client_id="crl-restore")
    claims = ClaimChecks(BlobStore(run_dir / "blobs"), claim_check_bytes)
    try:
        for topic in TOPICS:
            for partition in range(topic.partitions):
                end = restored.ends.get((topic.name, partition))
                if end is None or end.next_offset == 0:
                    continue
                futures = []
                for offset, record, dead_lettered in _partition_records(run_dir, topic, partition, end, gaps,
                                                                        claims):
                    futures.append((offset, producer.send(topic.name, value=record.value, key=record.key,
                                                          headers=list(record.headers), partition=partition,
                                                          timestamp_ms=record.timestamp_ms)))
                    restored.records += 1
                    restored.from_dead_letters += dead_lettered
                producer.flush()
                for offset, future in futures:
                    written = future.get(timeout=60)
                    if written.offset != offset:
                        raise RunFailedError(
                            f"restoring {topic.name}[{partition}]: the record of offset {offset} landed at "
                            f"{written.offset}; the broker's topic was not empty, or a send was repeated")
    finally:
        producer.close(timeout=10)
    if carry_over:
        restored.bank_rebuilt = _reset_bank_if_ahead(engine, restored.ends)
        restored.snapshots_dropped = len(_drop_snapshots_past(run_dir, restored.ends.get((EXPERIENCE_OPS_TOPIC.name,
                                                                                          0))))
        restored.group_positions = restorable_group_positions(engine, restored.ends)
    return restored


def commit_group_positions(kafka: KafkaSettings, group_positions: Mapping[str, Mapping[TopicPartition, int]]) -> None:
    """Commit each group's restored positions in the fresh broker (no member has joined it yet)."""
    for group_id, positions in group_positions.items():
        commit_group_offsets(kafka, group_id, positions, client_id="crl-restore")


def _past_end(ends: Mapping[TopicPartition, LogPosition], topic: str, partition: int, next_offset: int,
              log_id: str) -> int | None:
    """Where the restored log ends on the partition, when a position lies past it (else None). A position in another
    log of an archived topic (a topic re-created since) says nothing about this one; on a topic of which nothing was
    archived, any position past 0 read records that are gone."""
    end = ends.get((topic, partition))
    if end is not None:
        return end.next_offset if end.log_id == log_id and next_offset > end.next_offset else None
    if any(name == topic for name, _ in ends):
        return None
    return 0 if next_offset > 0 else None


def _check_positions(engine: Engine, ends: Mapping[TopicPartition, LogPosition], run_dir: Path) -> None:
    """Fail when a worker other than the bank read past the restored log (its state holds records that are gone)."""
    columns = consumer_offsets.c
    with engine.connect() as connection:
        rows = list(connection.execute(select(columns.worker, columns.topic, columns.partition, columns.next_offset,
                                              columns.log_id)))
    ahead = [f"{worker} read {topic}[{partition}] up to offset {next_offset}, the archive only to {end}"
             for worker, topic, partition, next_offset, log_id in rows
             if worker != "bank" and (end := _past_end(ends, topic, partition, next_offset, log_id)) is not None]
    if ahead:
        raise RunFailedError(
            f"{run_dir}: the broker died with records the archiver had not read yet, and other workers had acted on "
            "them: " + "; ".join(ahead) + ". Their state cannot be carried over to a log without those records.")


def drop_checkpoints_past(run_dir: Path, engine: Engine, ends: Mapping[TopicPartition, LogPosition]
                          ) -> dict[str, list[int]]:
    """Remove each trainer's versions that were trained on records gone with the broker (neither in the restored log
    nor archived from an earlier log of the topic), and every version after the first such one; returns them per
    role. Raises `RunFailedError` when such a version was announced in the
    restored log (its `PolicyPublished` or `TrainStepCompleted` is there): it can be neither kept nor trained again.

    A trainer writes a version's checkpoint before it publishes its events and commits its positions. When the broker
    dies in between, or the archiver had not read the step's inputs yet, the checkpoint holds an update on records that
    are gone with the broker. Kept, the trainer would publish its recorded `TrainStepCompleted` on restart (events
    are a function of the checkpoint), while the scheduler and the rollout workers play the lost episodes again under
    the same event ids, with other outcomes: the archive would name batch events that are not what the step trained
    on, and `crl replay train` could not reproduce the step. Dropped, the trainer resumes from the newest version whose
    inputs are all in the restored log and trains the next step on what the log now holds. The actor trainer's
    positions are cleared with its versions, so it reads its input again from offset 0 (what belongs to steps it
    has trained is ignored): they may have passed inputs of a dropped step."""
    dropped: dict[str, list[int]] = {}
    for role, inputs in TRAINER_INPUTS.items():
        root = checkpoints_root(run_dir, role)
        versions = [version for version in versions_in(root) if version > 0]
        if not versions:
            continue
        available = _restored_event_ids(run_dir, inputs, ends)
        first_lost, run_id, missing = None, "", ""
        for version in versions:
            manifest = version_dir(root, version) / "manifest.json"
            if not manifest.is_file():
                continue  # never completed (the trainer removes it when it writes that version)
            metadata = json.loads(manifest.read_text())["metadata"]
            train_step = metadata.get("train_step") or {}
            lost = [event_id for event_id in train_step.get("batch_event_ids", ()) if event_id not in available]
            if lost:
                first_lost, run_id, missing = version, str(metadata["run_id"]), lost[0]
                break
        if first_lost is None:
            continue
        doomed = [version for version in versions if version >= first_lost]
        announced_ids = _restored_event_ids(run_dir, POLICY, ends) | _restored_event_ids(run_dir, TRAIN_STEPS, ends)
        announced = [version for version in doomed
                     if {str(event_id_for(run_id, role, version, what)) for what in ("policy", "train-step")}
                     & announced_ids]
        if announced:
            raise RunFailedError(
                f"{run_dir}: {role} version {announced[0]} is on the restored log, but version {first_lost} was "
                f"trained on {inputs.name} records the archive does not have (e.g. event {missing}); the trainer's "
                "state cannot be carried over to a log without them.")
        for version in reversed(doomed):
            shutil.rmtree(version_dir(root, version))
        worker = TRAINER_POSITIONS.get(role)
        if worker is not None:
            with engine.begin() as connection:
                connection.execute(delete(consumer_offsets).where(consumer_offsets.c.worker == worker))
        dropped[role] = doomed
    return dropped


def _restored_event_ids(run_dir: Path, topic: Topic, ends: Mapping[TopicPartition, LogPosition]) -> set[str]:
    """The ids of the archived events of `topic` that stay on record: those of the restored log (below each
    partition's end) and those of any other, earlier log of the topic (archived, not lost with this broker). What
    the archive holds of the restored log at or past a partition's end (a segment written before the archiver's
    commit) is not restored, so it does not count."""
    directory = archive_root(run_dir) / topic.name
    if not directory.is_dir() or not any(directory.glob("*.parquet")):
        return set()
    pattern = str(directory / "*.parquet").replace("'", "''")
    with duckdb.connect() as connection:
        rows = connection.execute(
            f"SELECT DISTINCT event_id, \"partition\", log_id, \"offset\" FROM read_parquet('{pattern}', "
            "union_by_name = true)").fetchall()
    ids: set[str] = set()
    for event_id, partition, log_id, offset in rows:
        end = ends.get((topic.name, partition))
        if end is None or log_id != end.log_id or offset < end.next_offset:
            ids.add(event_id)
    return ids


def _reset_bank_if_ahead(engine: Engine, ends: Mapping[TopicPartition, LogPosition]) -> bool:
    """Empty the bank's projection (SQL rows and positions) when it read past the restored log; the bank
    worker then rebuilds it from offset 0 of the restored log. Returns whether it did."""
    columns = consumer_offsets.c
    with engine.connect() as connection:
        positions = [(row.topic, row.partition, row.next_offset, row.log_id) for row in connection.execute(
            select(columns.topic, columns.partition, columns.next_offset, columns.log_id).where(
                columns.worker == "bank"))]
        positions += [(row.topic, row.partition, row.next_offset, row.log_id)
                      for row in connection.execute(select(bank_position))]
    if all(_past_end(ends, topic, partition, next_offset, log_id) is None
           for topic, partition, next_offset, log_id in positions):
        return False
    with engine.begin() as connection:
        for name in BANK_TABLES:
            connection.execute(delete(metadata.tables[name]))
        connection.execute(delete(consumer_offsets).where(columns.worker == "bank"))
    return True


def _drop_snapshots_past(run_dir: Path, ops_end: LogPosition | None) -> list[Path]:
    """Remove the bank snapshots taken at op offsets the restored log does not reach (they hold ops that are gone;
    the bank writes a snapshot just before the SQL save of its batch)."""
    dropped = []
    for path in snapshot_dirs(snapshots_root(run_dir)):
        if ops_end is None or int(path.name) > ops_end.next_offset:
            shutil.rmtree(path)
            dropped.append(path)
    return dropped


def _partition_records(run_dir: Path, topic: Topic, partition: int, end: LogPosition,
                       gaps: Mapping[tuple[str, int, int], RawRecord],
                       claims: ClaimChecks) -> Iterator[tuple[int, RawRecord, bool]]:
    """(offset, record, from a dead letter) for every offset of the partition below `end`, in order."""
    directory = archive_root(run_dir) / topic.name
    rows: list[tuple[int, str, str | None, int | None]] = []
    if directory.is_dir() and any(directory.glob("*.parquet")):
        pattern = str(directory / "*.parquet").replace("'", "''")
        with duckdb.connect() as connection:
            rows = connection.execute(
                "SELECT \"offset\", any_value(payload), any_value(record_key), any_value(record_timestamp_ms) "
                f"FROM read_parquet('{pattern}', union_by_name = true) "
                "WHERE \"partition\" = ? AND log_id = ? AND \"offset\" < ? GROUP BY \"offset\" ORDER BY \"offset\"",
                [partition, end.log_id, end.next_offset]).fetchall()
    archived = {offset: (payload, key, timestamp_ms) for offset, payload, key, timestamp_ms in rows}
    for offset in range(end.next_offset):
        if offset in archived:
            payload, key, timestamp_ms = archived[offset]
            value = payload.encode("utf-8")
            event = decode(topic, value, max_bytes=max(len(value), DEFAULT_MAX_PAYLOAD_BYTES))
            if len(value) > claims.threshold_bytes:
                value = encode(event, max_bytes=len(value), claims=claims)
            yield offset, RawRecord(topic.name, value, key.encode("utf-8") if key is not None else None, partition,
                                    timestamp_ms, tuple(event_headers(event))), False
        elif (topic.name, partition, offset) in gaps:
            yield offset, gaps[(topic.name, partition, offset)], True
        else:
            raise RunFailedError(
                f"{run_dir}: the archive has no record at {topic.name}[{partition}] offset {offset}, neither an event "
                f"nor a dead letter, though the archiver's position ({end.next_offset}) is past it; the log cannot be "
                "restored as it was (were archive segments deleted?)")


def _dead_lettered_records(run_dir: Path, archived_ids: Mapping[str, str]) -> dict[tuple[str, int, int], RawRecord]:
    """The raw records of the archived log that became dead letters, by (topic, partition, offset). A dead letter
    belongs to the log when its id is the one `dead_letter_id` gives for that log (ids name the log)."""
    directory = archive_root(run_dir) / DEAD_LETTERS.name
    if not directory.is_dir() or not any(directory.glob("*.parquet")):
        return {}
    pattern = str(directory / "*.parquet").replace("'", "''")
    with duckdb.connect() as connection:
        payloads = [row[0] for row in connection.execute(
            f"SELECT any_value(payload) FROM read_parquet('{pattern}', union_by_name = true) GROUP BY event_id"
        ).fetchall()]
    blobs = BlobStore(run_dir / "blobs")
    records: dict[tuple[str, int, int], RawRecord] = {}
    for payload in payloads:
        letter = decode(DEAD_LETTERS, payload.encode("utf-8"))
        if not isinstance(letter, DeadLetter) or letter.source_topic not in archived_ids:
            continue
        expected = dead_letter_id(archived_ids[letter.source_topic], letter.source_topic, letter.source_partition,
                                  letter.source_offset, letter.raw_sha256, letter.error_class)
        place = (letter.source_topic, letter.source_partition, letter.source_offset)
        if letter.event_id != expected or place in records:
            continue
        value = base64.b64decode(letter.raw_b64) if letter.raw_b64 is not None else blobs.get(letter.raw_uri or "")
        key = (base64.b64decode(letter.source_key_b64) if letter.source_key_b64 is not None
               else blobs.get(letter.source_key_uri) if letter.source_key_uri is not None else None)
        headers = (json.loads(blobs.get(letter.source_headers_uri)) if letter.source_headers_uri is not None
                   else letter.source_headers)
        records[place] = RawRecord(letter.source_topic, value, key, letter.source_partition, None,
                                   tuple((name, base64.b64decode(data)) for name, data in headers))
    return records
