"""Broker fixtures shared by the integration and e2e tiers.

`kafka_bootstrap` gives every test empty registry topics on a real broker, in two tiers that run the same tests:
- `tansu`: a fresh embedded Tansu per test (it starts in ~20 ms and keeps records in memory, so a new process is the
  cleanest reset); the binary is located and checked once per session.
- `apache-kafka`: one `apache/kafka` container per session (testcontainers), with the registry topics deleted and
  re-created before each test. Skipped, with the reason, when no Docker engine answers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.admin import create_topics
from infra.broker import BrokerError, EmbeddedBroker, locate_tansu
from infra.kafka import KafkaSettings, make_admin
from schemas.topics import TOPICS

APACHE_KAFKA_IMAGE = "apache/kafka:4.1.1"


@pytest.fixture(scope="session")
def tansu_bin() -> Path:
    """The Tansu binary, proven to start once; a missing broker fails the session (it is a dependency)."""
    try:
        binary = locate_tansu(os.environ.get("CRL_TANSU_BIN"))
        EmbeddedBroker(tansu_bin=binary).start().stop()
    except BrokerError as exc:
        pytest.fail(f"the embedded broker is required for integration tests: {exc}")
    return binary


@pytest.fixture
def tansu(tansu_bin: Path, tmp_path: Path) -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker(tansu_bin=tansu_bin, log_path=tmp_path / "broker.log") as broker:
        yield broker


def _docker_engine_answers() -> str | None:
    """None if a Docker engine answers, else why not."""
    try:
        import docker

        docker.from_env(timeout=5).ping()
    except Exception as exc:  # docker raises several unrelated types when no daemon is reachable
        return f"no Docker engine answers ({type(exc).__name__}: {exc})"
    return None


@pytest.fixture(scope="session")
def apache_kafka() -> Iterator[str]:
    """Bootstrap address of a single-node KRaft `apache/kafka` container."""
    reason = _docker_engine_answers()
    if reason:
        pytest.skip(reason)
    from testcontainers.core.container import DockerContainer

    container = (
        DockerContainer(APACHE_KAFKA_IMAGE)
        .with_exposed_ports(9092)
        .with_env("KAFKA_NODE_ID", "1")
        .with_env("KAFKA_PROCESS_ROLES", "broker,controller")
        .with_env("KAFKA_LISTENERS", "PLAINTEXT://:9092,CONTROLLER://:9093")
        .with_env("KAFKA_CONTROLLER_LISTENER_NAMES", "CONTROLLER")
        .with_env("KAFKA_CONTROLLER_QUORUM_VOTERS", "1@localhost:9093")
        .with_env("KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT")
        .with_env("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
        .with_env("KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS", "0")
        .with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
        .with_env("KAFKA_MESSAGE_MAX_BYTES", "8388608")
    )
    # The advertised address must be the mapped host port, known only after start: set it through the entrypoint.
    container.with_command(
        "bash -c 'until [ -f /tmp/advertised ]; do sleep 0.1; done; "
        "export KAFKA_ADVERTISED_LISTENERS=$(cat /tmp/advertised); exec /etc/kafka/docker/run'"
    )
    container.start()
    try:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(9092)
        container.exec(f"bash -c 'echo PLAINTEXT://{host}:{port} > /tmp/advertised'")
        from infra.broker import wait_until_answers

        wait_until_answers(f"{host}:{port}", timeout_s=90)
        yield f"{host}:{port}"
    finally:
        container.stop()


def _recreate_topics(bootstrap: str) -> None:
    admin = make_admin(KafkaSettings(bootstrap_servers=bootstrap))
    try:
        existing = [topic.name for topic in TOPICS if topic.name in admin.list_topics()]
        if existing:
            admin.delete_topics(existing)
            deadline = time.monotonic() + 30
            while set(existing) & set(admin.list_topics()) and time.monotonic() < deadline:
                time.sleep(0.2)
        create_topics(admin)
    finally:
        admin.close()


@pytest.fixture(params=["tansu", pytest.param("apache-kafka", marks=pytest.mark.docker)])
def kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    """A real broker with every registry topic created and empty."""
    if request.param == "tansu":
        bootstrap = request.getfixturevalue("tansu").bootstrap_servers
        admin = make_admin(KafkaSettings(bootstrap_servers=bootstrap))
        try:
            create_topics(admin)
        finally:
            admin.close()
        return bootstrap
    bootstrap = request.getfixturevalue("apache_kafka")
    _recreate_topics(bootstrap)
    return bootstrap
