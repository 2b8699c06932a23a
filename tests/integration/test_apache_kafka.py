"""What only Apache Kafka shows: the launcher, its durable log, its group limits, and a restart under load.

The embedded broker of `infra/apache_kafka.py` is the broker of docker-compose.yml (4.1.1, KRaft, one node) run as a
child JVM. These tests start brokers of their own, so they can stop and restart them.
"""

from __future__ import annotations

import os
import time

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
from infra.broker_process import port_is_free
from infra.kafka import KafkaSettings, make_admin, make_consumer, make_producer
from schemas.base import Producer
from schemas.codec import decode, encode
from schemas.examples import example_events
from schemas.runs import StopRequested
from schemas.topics import CONTROL, TRAJECTORIES
from schemas.trajectories import TrajectoryCompleted

pytestmark = [pytest.mark.integration, pytest.mark.apache_kafka]

WHO = Producer(worker="test", instance="test-0")


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
    # the same ports when they are still free (another process may have taken one): clients keep their address
    free = port_is_free(broker.port) and port_is_free(broker.controller_port)
    with ApacheKafkaBroker(data_dir=tmp_path / "kafka", log_path=tmp_path / "broker.log") as again:
        assert (again.bootstrap_servers == bootstrap) == free
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
    forged.write_bytes(b"x" * victim.size)  # the right size, other bytes
    with pytest.raises(BrokerError, match=f"{victim.filename}: sha256 .* differs from the lock"):
        install_kafka_jars(tmp_path / "cache", repository.as_uri())
    forged.write_bytes(b"cut short")  # a transfer that ends early is tried again, then reported as such
    with pytest.raises(BrokerError, match=f"could not download .*{victim.filename} after 3 attempts "
                                          f"\\(got 9 bytes, the lock says {victim.size}\\)"):
        install_kafka_jars(tmp_path / "cache", repository.as_uri())
    # the forged bytes never took the jar's place in the cache, and no partial download was left behind
    lib = tmp_path / "cache" / f"kafka-{KAFKA_VERSION}" / "lib"
    assert (lib / victim.filename).read_bytes() == b"tampered"
    assert not list(lib.glob(".*"))


def test_a_group_session_below_the_broker_minimum_is_refused_and_the_defaults_join(apache_kafka_bootstrap):
    """The defect Tansu hid: consumers asked for 2 s sessions; Apache Kafka refuses anything under 6 s."""
    producer = KafkaProducer(bootstrap_servers=apache_kafka_bootstrap)
    event = StopRequested(run_id="it", producer=WHO, reason="hello")
    producer.send(CONTROL.name, key=CONTROL.key_bytes(event), value=encode(event))
    producer.close()
    old = KafkaConsumer(CONTROL.name, bootstrap_servers=apache_kafka_bootstrap, group_id="old-settings",
                        session_timeout_ms=2000, heartbeat_interval_ms=500, auto_offset_reset="earliest")
    try:
        with pytest.raises(InvalidSessionTimeoutError):  # noqa: PT012 - the refusal comes with one of the polls
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


def test_a_stock_broker_takes_records_at_the_payload_cap_and_doctor_reads_its_limits(kafka_jars, tmp_path):
    """A broker left at Kafka's defaults (1 MiB + 12 bytes per record, 7 days' retention, 3 s initial rebalance
    delay) and with a group minimum of its own: topics made by `crl topics create` still take a record at the app's
    1 MiB payload cap, and `crl doctor` reports the limits it reads, failing on a session below that minimum and on a
    topic that would delete records by age."""
    from kafka.admin import ConfigResource, ConfigResourceType

    from infra.admin import TOPIC_MAX_MESSAGE_BYTES
    from pipeline.run.doctor import _limits_checks
    from schemas.codec import DEFAULT_MAX_PAYLOAD_BYTES

    stock = {"message.max.bytes": "1048588", "log.retention.ms": "604800000",
             "group.initial.rebalance.delay.ms": "3000",
             "group.min.session.timeout.ms": "7000", "group.max.session.timeout.ms": "900000"}
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
        session = checks["broker limits: group session"]
        assert not session.ok
        assert "CRL_KAFKA__SESSION_TIMEOUT_MS=6000 is below the broker's group.min.session.timeout.ms=7000" in \
            session.detail
        fitting = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, session_timeout_ms=8000)
        checks = {check.name: check for check in _limits_checks(fitting, DEFAULT_MAX_PAYLOAD_BYTES)}
        session = checks["broker limits: group session"]
        assert session.ok, session.detail
        assert session.detail == ("CRL_KAFKA__SESSION_TIMEOUT_MS=8000 within the broker's [7000, 900000] ms; groups "
                                  "wait 3000 ms before their first assignment (group.initial.rebalance.delay.ms)")
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, CONTROL.name, {"retention.ms": "86400000"})])
        retention = {c.name: c for c in _limits_checks(kafka, DEFAULT_MAX_PAYLOAD_BYTES)}["broker limits: retention"]
        admin.close()
    assert not retention.ok
    assert f"{CONTROL.name} 86400000 ms" in retention.detail and "retention.ms=-1" in retention.detail
