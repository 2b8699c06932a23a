"""What only Apache Kafka shows: the launcher, its durable log, its group limits, and a restart under load.

The embedded broker of `infra/apache_kafka.py` is the broker of docker-compose.yml (4.1.1, KRaft, one node) run as a
child JVM. These tests start brokers of their own, so they can stop and restart them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import InvalidSessionTimeoutError

from infra.admin import create_topics, topic_ids
from infra.apache_kafka import (
    BROKER_POLICY,
    KAFKA_VERSION,
    ApacheKafkaBroker,
    LockedJar,
    install_kafka_jars,
    read_lock,
)
from infra.broker import BrokerError
from infra.kafka import KafkaSettings, make_admin, make_consumer, make_producer
from pipeline.audit import Audit
from pipeline.launch import build_runner
from pipeline.runner import Origin, Processor
from pipeline.settings import ArchiverSettings, RunnerSettings, Settings
from schemas.base import Event, Producer
from schemas.codec import decode, encode
from schemas.examples import example_events
from schemas.runs import RunFinished, StopRequested
from schemas.topics import CONTROL, RUNS, TRAJECTORIES
from schemas.trajectories import TrajectoryCompleted

pytestmark = [pytest.mark.integration, pytest.mark.apache_kafka]

WHO = Producer(worker="test", instance="test-0")


@pytest.fixture(scope="module")
def kafka_jars() -> list[Path]:
    """The pinned jars (downloaded once per machine; `make test` fetches them before the tests)."""
    return install_kafka_jars()


def _trajectory(slot: int) -> TrajectoryCompleted:
    example = next(e for e in example_events("restart-it") if isinstance(e, TrajectoryCompleted))
    return example.model_copy(update={"slot": slot, "trajectory_id": f"traj-{slot}", "run_id": "restart-it"})


def test_the_broker_is_formatted_once_and_keeps_its_log_across_a_restart(kafka_jars, tmp_path):
    broker = ApacheKafkaBroker(data_dir=tmp_path / "kafka", log_path=tmp_path / "broker.log")
    with broker:
        bootstrap = broker.bootstrap_servers
        written = dict(line.split("=", 1) for line in broker.properties_path.read_text().splitlines())
        assert {key: written[key] for key in BROKER_POLICY} == BROKER_POLICY  # the compose service's settings
        assert written["log.dirs"] == str(tmp_path / "kafka" / "log")
        admin = make_admin(KafkaSettings(bootstrap_servers=bootstrap))
        create_topics(admin)
        ids_before = topic_ids(admin, [TRAJECTORIES.name])
        admin.close()
        producer = KafkaProducer(bootstrap_servers=bootstrap)
        for slot in range(10):
            producer.send(TRAJECTORIES.name, key=b"same-partition", value=encode(_trajectory(slot)))
        producer.close()
        meta = (broker.log_dir / "meta.properties").read_text()
    assert not broker.is_running()
    with ApacheKafkaBroker(data_dir=tmp_path / "kafka", log_path=tmp_path / "broker.log") as again:
        assert again.bootstrap_servers == bootstrap  # the same ports: clients keep their address
        assert (again.log_dir / "meta.properties").read_text() == meta  # not formatted again
        admin = make_admin(KafkaSettings(bootstrap_servers=bootstrap))
        assert topic_ids(admin, [TRAJECTORIES.name]) == ids_before  # the same log, not a new one
        admin.close()
        consumer = make_consumer(KafkaSettings(bootstrap_servers=bootstrap))
        partitions = [TopicPartition(TRAJECTORIES.name, p) for p in range(TRAJECTORIES.partitions)]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        slots: list[int] = []
        deadline = time.monotonic() + 20
        while len(slots) < 10 and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                slots += [decode(TRAJECTORIES, record.value).slot for record in batch]
        consumer.close()
    assert slots == list(range(10))
    assert "Kafka Server started" in (tmp_path / "broker.log").read_text()


def test_jars_are_installed_only_when_every_sha256_matches(kafka_jars, tmp_path):
    """A local Maven repository stands in for Maven Central: the right bytes install, other bytes are refused."""
    repository = tmp_path / "repository"
    for jar, path in zip(read_lock(), kafka_jars, strict=True):
        target = repository / jar.repository_path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(path)
    installed = install_kafka_jars(tmp_path / "cache", repository.as_uri())
    assert [path.name for path in installed] == [jar.filename for jar in read_lock()]
    victim: LockedJar = min(read_lock(), key=lambda jar: jar.size)
    (tmp_path / "cache" / f"kafka-{KAFKA_VERSION}" / "lib" / victim.filename).write_bytes(b"tampered")
    forged = repository / victim.repository_path
    forged.unlink()
    forged.write_bytes(b"not the pinned jar")
    with pytest.raises(BrokerError, match=f"{victim.filename}: sha256 .* differs from the lock"):
        install_kafka_jars(tmp_path / "cache", repository.as_uri())
    # the forged bytes never took the jar's place in the cache
    assert (tmp_path / "cache" / f"kafka-{KAFKA_VERSION}" / "lib" / victim.filename).read_bytes() == b"tampered"


def test_a_group_session_below_the_broker_minimum_is_refused_and_the_defaults_join(apache_kafka_bootstrap):
    """The defect Tansu hid: consumers asked for 2 s sessions; Apache Kafka refuses anything under 6 s."""
    producer = KafkaProducer(bootstrap_servers=apache_kafka_bootstrap)
    event = StopRequested(run_id="it", producer=WHO, reason="hello")
    producer.send(CONTROL.name, key=CONTROL.key_bytes(event), value=encode(event))
    producer.close()
    old = KafkaConsumer(CONTROL.name, bootstrap_servers=apache_kafka_bootstrap, group_id="old-settings",
                        session_timeout_ms=2000, heartbeat_interval_ms=500, auto_offset_reset="earliest")
    try:
        with pytest.raises(InvalidSessionTimeoutError):
            for _ in range(50):
                old.poll(timeout_ms=200)
    finally:
        old.close()
    consumer = make_consumer(KafkaSettings(bootstrap_servers=apache_kafka_bootstrap), group_id="default-settings")
    consumer.subscribe([CONTROL.name])
    received = []
    deadline = time.monotonic() + 30
    try:
        while not received and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                received += [decode(CONTROL, record.value) for record in batch]
    finally:
        consumer.close(autocommit=False)
    assert [e.reason for e in received] == ["hello"]


class AnswerStops(Processor):
    """Group-mode worker: answers each StopRequested with a RunFinished naming the same reason."""

    name = "answer-stops"
    inputs = (CONTROL,)
    consumption = "group"

    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        return [RunFinished(run_id=event.run_id, producer=WHO, status="stopped", steps_completed=origin.offset,
                            reason=event.reason)]


def _archiver(bootstrap: str, run_dir: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "CRL_KAFKA__BOOTSTRAP_SERVERS": bootstrap, "CRL_RUN_DIR": str(run_dir),
           "CRL_ARCHIVER__FLUSH_ROWS": "100", "CRL_ARCHIVER__FLUSH_INTERVAL_S": "0.3",
           "CRL_RUNNER__POLL_TIMEOUT_MS": "100", "CRL_RUNNER__METRICS_INTERVAL_S": "0.5"}
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "worker", "archiver", "--instance", "archiver-0"],
                            env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def test_workers_ride_through_a_broker_restart_in_the_middle_of_a_stream(kafka_jars, tmp_path):
    """Stop Apache Kafka (SIGTERM) while events stream in and start it again on the same log: every acknowledged
    record is archived once, the group worker answers every request, nobody restarts a worker, positions resume."""
    broker = ApacheKafkaBroker(data_dir=tmp_path / "kafka", log_path=tmp_path / "broker.log").start()
    bootstrap = broker.bootstrap_servers
    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    admin = make_admin(kafka)
    create_topics(admin)
    admin.close()
    run_dir = tmp_path / "run"
    archiver = _archiver(bootstrap, run_dir, tmp_path / "archiver.out")
    settings = Settings(run_dir=run_dir, run_id="restart-it", kafka=kafka,
                        runner=RunnerSettings(poll_timeout_ms=100, metrics_interval_s=1.0),
                        archiver=ArchiverSettings(flush_rows=100, flush_interval_s=0.3))
    answering = build_runner(AnswerStops, settings, instance="answer-0")
    answer_thread = threading.Thread(target=answering.run, daemon=True)
    answer_thread.start()
    producer = make_producer(kafka, client_id="restart-test")
    total, stops = 1200, 60
    sent: list = []
    produced_ids: set[str] = set()
    restart: dict[str, float] = {}

    def stream() -> None:
        for slot in range(total):
            event = _trajectory(slot)
            produced_ids.add(str(event.event_id))
            sent.append(producer.send(TRAJECTORIES.name, key=f"g{slot % 16}".encode(), value=encode(event)))
            if slot % (total // stops) == 0:
                stop = StopRequested(run_id="restart-it", producer=WHO, reason=f"stop-{slot}")
                produced_ids.add(str(stop.event_id))
                sent.append(producer.send(CONTROL.name, key=CONTROL.key_bytes(stop), value=encode(stop)))
            time.sleep(0.01)

    streamer = threading.Thread(target=stream)
    try:
        streamer.start()
        time.sleep(4)  # mid-stream: the workers are consuming
        began = time.monotonic()
        broker.stop()
        restart["stopped_s"] = time.monotonic() - began
        time.sleep(1.0)
        broker.start()
        restart["down_s"] = time.monotonic() - began
        assert broker.bootstrap_servers == bootstrap
        streamer.join(timeout=120)
        producer.flush(timeout=120)
        failed = [future.exception for future in sent if future.failed()]
        assert not failed, f"{len(failed)} sends failed, first: {failed[0]}"  # nothing acknowledged was lost
        assert len(sent) == total + stops

        deadline = time.monotonic() + 90
        archived: list = []
        answers: list[RunFinished] = []
        while time.monotonic() < deadline:
            with Audit(run_dir) as audit:
                _, archived = audit.query("SELECT event_id FROM events WHERE kind != 'RunFinished'")
            answers = _read_all(kafka, RUNS.name)
            if len(archived) >= total + stops and {a.reason for a in answers} >= {f"stop-{s}" for s in
                                                                                  range(0, total, total // stops)}:
                break
            time.sleep(0.5)
        assert archiver.poll() is None, "the archiver exited: " + (tmp_path / "archiver.out").read_text()[-2000:]
        assert answer_thread.is_alive(), "the group worker gave up"
        assert {row[0] for row in archived} == produced_ids
        assert len(archived) == total + stops  # every event archived once (the audit drops re-archived repeats)
        reasons = [a.reason for a in answers]
        assert set(reasons) == {f"stop-{s}" for s in range(0, total, total // stops)}
        # at-least-once: a request handled while its commit could not reach the broker is answered again, no more
        repeats = len(reasons) - len(set(reasons))
        with Audit(run_dir) as audit:
            raw = audit.query(f"SELECT count(*) FROM read_parquet('{run_dir / 'archive'}/*/*.parquet') "
                              "WHERE kind != 'RunFinished'")[1][0][0]
        print(f"broker restart: stopped in {restart['stopped_s']:.1f}s, down {restart['down_s']:.1f}s; "
              f"answers repeated {repeats}; archived rows {raw} for {total + stops} events")
        assert repeats <= stops // 2
        # positions resumed: the group committed up to the end of crl.control (the archiver's are its own, in SQL)
        deadline = time.monotonic() + 30
        while _committed(kafka, "crl-answer-stops", CONTROL.name) != stops and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _committed(kafka, "crl-answer-stops", CONTROL.name) == stops
    finally:
        answering.request_stop("test over")
        answer_thread.join(timeout=30)
        archiver.send_signal(signal.SIGTERM)
        try:
            archiver.wait(timeout=30)
        except subprocess.TimeoutExpired:
            archiver.kill()
        producer.close(timeout=10)
        broker.stop()
    assert archiver.returncode == 0, (tmp_path / "archiver.out").read_text()[-3000:]


def _read_all(kafka: KafkaSettings, topic: str) -> list:
    consumer = make_consumer(kafka, client_id="restart-reader")
    try:
        partitions = [TopicPartition(topic, 0)]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        events = []
        while batches := consumer.poll(timeout_ms=300):
            for batch in batches.values():
                events += [decode(RUNS, record.value) for record in batch]
        return events
    finally:
        consumer.close(autocommit=False)


def _committed(kafka: KafkaSettings, group: str, topic: str) -> int | None:
    admin = make_admin(kafka)
    try:
        offsets = admin.list_group_offsets(group)[group]
    finally:
        admin.close()
    for tp, offset in offsets.items():
        if tp.topic == topic:
            return offset.offset
    return None



def _fill(bootstrap: str, slots: range) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for slot in slots:
        producer.send(TRAJECTORIES.name, key=b"same-partition", value=encode(_trajectory(slot)))
    producer.close()


def test_a_re_created_topic_is_a_new_log_read_from_its_start(apache_kafka_bootstrap, tmp_path):
    """Apache Kafka keeps its log across restarts, but a topic deleted and created again is a new log under a new
    topic id: an assign-mode worker's stored positions must not skip its first records (the Tansu restart's twin)."""
    from pipeline.runner import Limits
    from workers.archiver import Archiver

    kafka = KafkaSettings(bootstrap_servers=apache_kafka_bootstrap)
    settings = Settings(run_dir=tmp_path, run_id="restart-it", kafka=kafka,
                        runner=RunnerSettings(poll_timeout_ms=100, metrics_interval_s=1.0),
                        archiver=ArchiverSettings(flush_rows=50, flush_interval_s=0.3))
    _fill(apache_kafka_bootstrap, range(30))
    first = build_runner(Archiver, settings, instance="a-0", limits=Limits(max_events=30, timeout_s=30)).run()
    assert first.events_in == 30
    admin = make_admin(kafka)
    try:
        old_id = topic_ids(admin, [TRAJECTORIES.name])
        admin.delete_topics([TRAJECTORIES.name])
        deadline = time.monotonic() + 30
        while TRAJECTORIES.name in admin.list_topics() and time.monotonic() < deadline:
            time.sleep(0.1)
        create_topics(admin)
        assert topic_ids(admin, [TRAJECTORIES.name]) != old_id
    finally:
        admin.close()
    # The new log is longer than the stored position (40 > 30): offsets alone could not tell the logs apart.
    _fill(apache_kafka_bootstrap, range(100, 140))
    again = build_runner(Archiver, settings, instance="a-1", limits=Limits(max_events=40, timeout_s=30)).run()
    assert again.events_in == 40
    with Audit(tmp_path) as audit:
        _, slots = audit.query("SELECT slot FROM trajectory_completed ORDER BY slot")
        _, logs = audit.query("SELECT count(DISTINCT log_id) FROM events")
    assert [row[0] for row in slots] == [*range(30), *range(100, 140)]  # nothing skipped, nothing replaced
    assert logs == [(2,)]


def test_a_stock_broker_takes_records_at_the_payload_cap_and_doctor_reads_its_limits(kafka_jars, tmp_path):
    """A broker left at Kafka's defaults (1 MiB + 12 bytes per record, 7 days' retention, 3 s initial rebalance
    delay): topics made by `crl topics create` still take a record at the app's 1 MiB payload cap, and `crl doctor`
    reports the limits it reads, failing on a topic that would delete records by age."""
    from kafka.admin import ConfigResource, ConfigResourceType

    from infra.admin import TOPIC_MAX_MESSAGE_BYTES
    from pipeline.doctor import _limits_checks
    from schemas.codec import DEFAULT_MAX_PAYLOAD_BYTES

    stock = {"message.max.bytes": "1048588", "log.retention.ms": "604800000", "group.initial.rebalance.delay.ms": "3000"}
    with ApacheKafkaBroker(data_dir=tmp_path / "kafka", log_path=tmp_path / "broker.log", overrides=stock) as broker:
        kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers)
        admin = make_admin(kafka)
        create_topics(admin)
        producer = make_producer(kafka)
        # an incompressible value at the cap, with a key and a header as the runner sends them
        value = os.urandom(DEFAULT_MAX_PAYLOAD_BYTES)
        producer.send(TRAJECTORIES.name, key=b"g" * 36, value=value, headers=[("crl-kind", b"x")]).get(timeout=30)
        producer.close()
        checks = {check.name: check for check in _limits_checks(kafka, DEFAULT_MAX_PAYLOAD_BYTES)}
        assert checks["broker limits: record size"].ok
        assert str(TOPIC_MAX_MESSAGE_BYTES) in checks["broker limits: record size"].detail
        assert checks["broker limits: retention"].ok  # the registry topics were created with retention -1
        assert "groups wait 3000 ms" in checks["broker limits: group session"].detail
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, CONTROL.name, {"retention.ms": "86400000"})])
        retention = {c.name: c for c in _limits_checks(kafka, DEFAULT_MAX_PAYLOAD_BYTES)}["broker limits: retention"]
        admin.close()
    assert not retention.ok
    assert f"{CONTROL.name} 86400000 ms" in retention.detail and "retention.ms=-1" in retention.detail
