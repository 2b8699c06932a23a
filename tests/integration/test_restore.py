"""Restoring a Tansu run's log from its archive into a fresh Tansu (`pipeline.run.restore`, what `crl run --resume`
does for a run whose memory-only broker died): every archived record at its old offset, a dead-lettered record with
its original bytes, the new topic ids mapped to the archived log's, the archiver carrying on from its position in
the restored log, consumer groups committed where their outputs allow, and a worker that read past the archive
named instead of carried over."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from sqlalchemy import func, insert, select

from infra.admin import create_topics, topic_ids
from infra.db import bank_position, consumer_offsets, database_url, experiences, make_engine, migrate
from infra.kafka import KafkaSettings, make_admin
from infra.tansu import TansuBroker
from pipeline.audit.views import Audit
from pipeline.errors import RunFailedError
from pipeline.rl.versions import checkpoints_root, version_dir, versions_in
from pipeline.run.restore import commit_group_positions, restore_log
from pipeline.runtime.group_commits import GroupCommitLog
from pipeline.runtime.launch import build_runner
from pipeline.runtime.offsets import LogPosition
from pipeline.runtime.runner import Limits
from pipeline.runtime.settings import RunnerSettings
from pipeline.settings import Settings
from schemas.codec import encode
from schemas.examples import example_events
from schemas.topics import TASKS, TOPICS, TRAJECTORIES, topic_of
from workers.archiver import Archiver

pytestmark = pytest.mark.integration
RUN = "restored"


def _with_topics(broker: TansuBroker) -> KafkaSettings:
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers)
    admin = make_admin(kafka)
    try:
        create_topics(admin)
    finally:
        admin.close()
    return kafka


def _ids(kafka: KafkaSettings) -> dict[str, str]:
    admin = make_admin(kafka)
    try:
        return topic_ids(admin, [topic.name for topic in TOPICS])
    finally:
        admin.close()


def _read_all(bootstrap: str, topic: str, partition: int) -> list[tuple[int, bytes | None, bytes | None]]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    tp = TopicPartition(topic, partition)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    end = consumer.end_offsets([tp])[tp]
    records: list[tuple[int, bytes | None, bytes | None]] = []
    while len(records) < end:
        for batch in consumer.poll(timeout_ms=1000).values():
            records += [(r.offset, r.key, r.value) for r in batch]
    consumer.close()
    return records


def _engine(settings: Settings):  # type: ignore[no-untyped-def]
    engine = make_engine(database_url(settings.db, settings.run_dir))
    migrate(engine)
    return engine


@pytest.fixture
def archived_run(tansu_bin, tmp_path):
    """A Tansu run's log: valid events on every topic (several partitions of crl.tasks), two records that do not
    decode, all archived by the archiver; then the broker is gone. Returns (settings, what was produced)."""
    events = [e.model_copy(update={"event_id": uuid.uuid4()}) for e in example_events(RUN) for _ in range(3)]
    with TansuBroker(tansu_bin=tansu_bin, log_path=tmp_path / "first.log") as first:
        kafka = _with_topics(first)
        settings = Settings(run_dir=tmp_path / "run", run_id=RUN, kafka=kafka,
                            runner=RunnerSettings(poll_timeout_ms=50))
        producer = KafkaProducer(bootstrap_servers=first.bootstrap_servers)
        produced: dict[tuple[str, int, int], tuple[bytes | None, bytes]] = {}
        for index, event in enumerate(events):
            topic = topic_of(event)
            key, value = topic.key_bytes(event), encode(event)
            written = producer.send(topic.name, key=key, value=value).get(timeout=30)
            produced[(written.topic, written.partition, written.offset)] = (key, value)
            if index in (4, 11):  # garbage between the events: the archiver dead-letters it
                garbage = b"\xff not json " + bytes([index])
                written = producer.send(topic.name, key=b"\x00raw", value=garbage,
                                        partition=written.partition).get(timeout=30)
                produced[(written.topic, written.partition, written.offset)] = (b"\x00raw", garbage)
        producer.close()
        archiver = build_runner(Archiver, settings, instance="archiver-0",
                                limits=Limits(max_events=len(produced) + 2, timeout_s=120))  # + its dead letters
        metrics = archiver.run()
        assert metrics.dead_letters == 2
        old_ids = _ids(kafka)
    return settings, produced, old_ids


def test_the_archived_log_comes_back_at_its_offsets_and_the_run_carries_on_in_it(archived_run, tansu_bin, tmp_path):
    settings, produced, old_ids = archived_run
    engine = _engine(settings)
    with TansuBroker(tansu_bin=tansu_bin, log_path=tmp_path / "second.log") as second:
        kafka = _with_topics(second)
        # a rollout member's commits: the first one's outputs were archived, the second one's were not
        tasks = next(p for topic, p, _ in produced if topic == TASKS.name)
        trajectories = next(p for topic, p, _ in produced if topic == TRAJECTORIES.name)
        tasks_end = max(offset for topic, p, offset in produced if (topic, p) == (TASKS.name, tasks)) + 1
        commits = GroupCommitLog(engine, "crl-rollout", "rollout-0", lambda: {(TRAJECTORIES.name, trajectories): 1})
        commits.record({(TASKS.name, tasks): LogPosition(1, old_ids[TASKS.name])})
        commits.produced_ends = lambda: {(TRAJECTORIES.name, trajectories): 10_000}
        commits.record({(TASKS.name, tasks): LogPosition(tasks_end, old_ids[TASKS.name])})

        restored = restore_log(settings.run_dir, kafka, engine)

        assert restored.records == len(produced) + 2  # and the archiver's two dead letters
        assert restored.from_dead_letters == 2
        new_ids = _ids(kafka)
        assert restored.aliases == {new_ids[name]: old_ids[name] for name in new_ids}
        assert restored.group_positions == {"crl-rollout": {(TASKS.name, tasks): 1}}
        for (topic, partition, offset), (key, value) in produced.items():
            assert (offset, key, value) in _read_all(second.bootstrap_servers, topic, partition)
        for topic in TOPICS:
            for partition in range(topic.partitions):
                offsets = [o for o, _, _ in _read_all(second.bootstrap_servers, topic.name, partition)]
                assert offsets == list(range(len(offsets)))

        commit_group_positions(kafka, restored.group_positions)
        consumer = KafkaConsumer(bootstrap_servers=second.bootstrap_servers, group_id="crl-rollout",
                                 enable_auto_commit=False)
        assert consumer.committed(TopicPartition(TASKS.name, tasks)) == 1
        consumer.close()

        # the archiver carries on in the restored log (same log id through the alias): one new event, archived once
        aliased = settings.model_copy(update={"kafka": kafka.model_copy(update={"log_aliases": restored.aliases})})
        event = example_events(RUN)[0].model_copy(update={"event_id": uuid.uuid4()})
        producer = KafkaProducer(bootstrap_servers=second.bootstrap_servers)
        producer.send(topic_of(event).name, key=topic_of(event).key_bytes(event), value=encode(event)).get(30)
        producer.close()
        build_runner(Archiver, aliased, instance="archiver-0", limits=Limits(max_events=1, timeout_s=60)).run()
    with Audit(settings.run_dir) as audit:
        _, rows = audit.query("SELECT count(*), count(DISTINCT event_id), list(DISTINCT log_id) FROM events")
    # the valid events, the two dead letters and the new event, each once, all in the logs of the first broker
    [(count, distinct, log_ids)] = rows
    assert count == distinct == len(produced) + 1 and set(log_ids) <= set(old_ids.values())
    engine.dispose()


def test_a_worker_that_read_past_the_archive_is_named_and_a_bank_that_did_is_rebuilt(archived_run, tansu_bin,
                                                                                    tmp_path):
    settings, produced, old_ids = archived_run
    engine = _engine(settings)
    now = datetime.now(UTC)
    with engine.begin() as connection:
        connection.execute(insert(bank_position), [{
            "topic": "crl.experience-ops", "partition": 0, "next_offset": 10_000,
            "log_id": old_ids["crl.experience-ops"],
            "state_hash": "0" * 64, "applied": 1, "duplicates": 0, "rejected": 0, "updated_at": now}])
    with TansuBroker(tansu_bin=tansu_bin, log_path=tmp_path / "second.log") as second:
        restored = restore_log(settings.run_dir, _with_topics(second), engine)
        assert restored.bank_rebuilt
    with engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(bank_position)).scalar() == 0
        assert connection.execute(select(func.count()).select_from(experiences)).scalar() == 0
    # a partition the archiver never read: the records another worker read there are gone with the broker
    unarchived = min(set(range(TRAJECTORIES.partitions)) - {p for t, p, _ in produced if t == TRAJECTORIES.name})
    with engine.begin() as connection:
        connection.execute(insert(consumer_offsets), [{
            "worker": "actor_trainer", "topic": TRAJECTORIES.name, "partition": unarchived, "next_offset": 2,
            "log_id": old_ids[TRAJECTORIES.name], "updated_at": now}])
    with TansuBroker(tansu_bin=tansu_bin, log_path=tmp_path / "third.log") as third:
        named = rf"actor_trainer read crl.trajectories\[{unarchived}\] up to offset 2, the archive only to 0"
        with pytest.raises(RunFailedError, match=named):
            restore_log(settings.run_dir, _with_topics(third), engine)
    engine.dispose()


def test_a_broker_that_died_before_anything_was_archived_restores_an_empty_log_unless_a_worker_read_from_it(
        tansu_bin, tmp_path):
    settings = Settings(run_dir=tmp_path / "run", run_id=RUN)
    engine = _engine(settings)
    with TansuBroker(tansu_bin=tansu_bin, log_path=tmp_path / "second.log") as second:
        restored = restore_log(settings.run_dir, _with_topics(second), engine)
        assert (restored.records, restored.aliases, restored.group_positions) == (0, {}, {})
    with engine.begin() as connection:
        connection.execute(insert(consumer_offsets), [{
            "worker": "actor_trainer", "topic": TRAJECTORIES.name, "partition": 3, "next_offset": 1,
            "log_id": "gone", "updated_at": datetime.now(UTC)}])
    with (TansuBroker(tansu_bin=tansu_bin, log_path=tmp_path / "third.log") as third,
          pytest.raises(RunFailedError, match=r"actor_trainer read crl.trajectories\[3\] up to offset 1, the "
                                              r"archive only to 0")):
        restore_log(settings.run_dir, _with_topics(third), engine)
    engine.dispose()


def test_a_trainer_version_trained_on_records_past_the_archive_is_removed(archived_run, tansu_bin, tmp_path):
    """Version 1 trained on archived episodes stays; version 2 trained on one the broker died with is removed (the
    resumed trainer trains that step again on what the restored log holds), and the trainer's positions go with it."""
    settings, _produced, old_ids = archived_run
    engine = _engine(settings)
    with Audit(settings.run_dir) as audit:
        archived = [str(event_id) for (event_id,) in audit.query(
            "SELECT event_id FROM trajectory_completed ORDER BY event_id")[1]]
    assert archived, "the archived run has trajectories"
    root = checkpoints_root(settings.run_dir, "actor")
    for version, batch in ((0, None), (1, archived), (2, [*archived, str(uuid.uuid4())])):
        version_dir(root, version).mkdir(parents=True)  # only the manifest's metadata is read
        train_step = {"batch_event_ids": batch} if batch is not None else None
        (version_dir(root, version) / "manifest.json").write_text(json.dumps(
            {"metadata": {"run_id": RUN, "version": version, "train_step": train_step}}))
    with engine.begin() as connection:
        connection.execute(insert(consumer_offsets), [{
            "worker": "actor_trainer", "topic": TRAJECTORIES.name, "partition": p, "next_offset": 0,
            "log_id": old_ids[TRAJECTORIES.name], "updated_at": datetime.now(UTC)} for p in range(2)])
    with TansuBroker(tansu_bin=tansu_bin, log_path=tmp_path / "second.log") as second:
        restored = restore_log(settings.run_dir, _with_topics(second), engine)
    assert restored.checkpoints_dropped == {"actor": [2]}
    assert versions_in(root) == [0, 1]
    with engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(consumer_offsets).where(
            consumer_offsets.c.worker == "actor_trainer")).scalar() == 0
    engine.dispose()
