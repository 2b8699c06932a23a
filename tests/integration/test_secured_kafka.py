"""A secured embedded Apache Kafka: TLS, SCRAM-SHA-512 logins and each worker kind's ACLs, on a real broker.

One broker for the module, secured as `crl run --security sasl_ssl` secures it: a login per worker kind of the
registry, the registry's topics, and the ACLs `pipeline.run.security` derives from what each kind declares.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import ACLFilter, ACLOperation, ACLPermissionType, ResourcePatternFilter, ResourceType
from kafka.admin import ACLResourcePatternType as PatternType
from kafka.errors import GroupAuthorizationFailedError, KafkaTimeoutError, TopicAuthorizationFailedError
from pydantic import SecretStr

from infra.admin import create_topics
from infra.apache_kafka import ApacheKafkaBroker
from infra.errors import ConfigError
from infra.kafka import KafkaLoginError, KafkaSettings, make_admin, make_consumer, make_producer
from infra.kafka_security import ADMIN, SecuredBus
from pipeline.run.security import SECURITY_DIR, grant_worker_acls, worker_bus, worker_grant, worker_principal
from pipeline.runtime.launch import load_worker_registry
from schemas.codec import encode
from schemas.examples import example_events
from schemas.topics import CONTROL, EXTRACTIONS, POLICY, TASKS, TRAJECTORIES

pytestmark = [pytest.mark.integration, pytest.mark.apache_kafka]


@dataclass(frozen=True)
class SecuredBroker:
    bus: SecuredBus
    broker: ApacheKafkaBroker
    plain: KafkaSettings
    """The broker's address with no login: tests log in as whom they need."""

    def as_(self, principal: str, **update: object) -> KafkaSettings:
        return self.bus.client_settings(self.plain.model_copy(update=update), principal)


@pytest.fixture(scope="module")
def secured(kafka_jars, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredBroker]:
    run_dir = tmp_path_factory.mktemp("secured")
    registry = load_worker_registry()
    bus = worker_bus(run_dir, registry)
    broker = ApacheKafkaBroker(data_dir=run_dir / "kafka", log_path=run_dir / "logs" / "broker.log", security=bus)
    with broker:
        plain = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, request_timeout_ms=5000)
        admin_settings = bus.client_settings(plain, ADMIN)
        admin = make_admin(admin_settings)
        try:
            create_topics(admin)
        finally:
            admin.close()
        grant_worker_acls(admin_settings, registry)
        yield SecuredBroker(bus, broker, plain)
    shutil.rmtree(run_dir, ignore_errors=True)


def test_keys_passwords_and_the_broker_config_are_readable_by_their_owner_only(secured: SecuredBroker) -> None:
    directory = secured.bus.directory
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in directory.iterdir()}
    assert modes == {"ca.pem": 0o644, "ca-key.pem": 0o600, "broker-keystore.pem": 0o600, "credentials.json": 0o600}
    assert stat.S_IMODE(secured.broker.properties_path.stat().st_mode) == 0o600
    # One principal per worker kind, besides the admin; every password different.
    kinds = load_worker_registry()
    assert set(secured.bus.principals) == {ADMIN, *(worker_principal(kind) for kind in kinds)}
    assert len(set(secured.bus.passwords.values())) == len(secured.bus.passwords)


def test_a_wrong_password_is_refused_with_the_reason(secured: SecuredBroker) -> None:
    rollout = worker_principal("rollout")
    admin = make_admin(secured.as_(rollout))  # the right password logs in
    admin.close()
    wrong = secured.as_(rollout, request_timeout_ms=3000).model_copy(
        update={"sasl_plain_password": SecretStr("not-the-password")})
    began = time.monotonic()
    with pytest.raises(KafkaLoginError) as refused:
        make_admin(wrong)
    message = str(refused.value)
    assert "refused the login of 'crl-rollout' (SCRAM-SHA-512)" in message
    assert "CRL_KAFKA__SASL_PLAIN_PASSWORD" in message
    assert "not-the-password" not in message
    assert time.monotonic() - began < 20  # bounded by the settings' request timeout (3 s here)
    with pytest.raises(KafkaLoginError, match="'nobody'"):
        make_admin(secured.as_(rollout, request_timeout_ms=3000).model_copy(update={"sasl_plain_username": "nobody"}))


def test_a_client_without_tls_and_login_gets_nothing(secured: SecuredBroker) -> None:
    with pytest.raises(KafkaTimeoutError, match="Unable to bootstrap"):
        make_admin(secured.plain.model_copy(update={"request_timeout_ms": 2000}))
    # A client that does not trust the run's CA never gets to log in.
    untrusting = secured.as_(ADMIN, request_timeout_ms=2000).model_copy(update={"ssl_cafile": None})
    with pytest.raises(KafkaLoginError, match="CERTIFICATE_VERIFY_FAILED"):
        make_admin(untrusting)


def test_a_worker_writes_its_declared_topics_and_is_refused_the_others(secured: SecuredBroker) -> None:
    trajectory = next(e for e in example_events() if e.kind == "TrajectoryCompleted")
    producer = make_producer(secured.as_(worker_principal("rollout")), client_id="rollout-0")
    try:
        producer.send(TRAJECTORIES.name, value=encode(trajectory)).get(timeout=30)  # declared: it produces them
        with pytest.raises(TopicAuthorizationFailedError) as refused:
            producer.send(POLICY.name, value=encode(trajectory)).get(timeout=30)  # only the trainers publish policy
        assert POLICY.name in str(refused.value)
    finally:
        producer.close()


def test_a_worker_reads_its_declared_topics_and_group_only(secured: SecuredBroker) -> None:
    rollout = secured.as_(worker_principal("rollout"))
    for partition, allowed in ((TopicPartition(TASKS.name, 0), True), (TopicPartition(EXTRACTIONS.name, 0), False)):
        consumer = make_consumer(rollout, client_id="rollout-0")
        try:
            consumer.assign([partition])
            consumer.seek_to_beginning(partition)
            if allowed:  # it consumes the tasks
                assert consumer.position(partition, timeout_ms=5000) == 0
            else:  # the extractor's output is not the rollout worker's to read
                with pytest.raises(TopicAuthorizationFailedError, match=EXTRACTIONS.name):
                    consumer.position(partition, timeout_ms=5000)
        finally:
            consumer.close(autocommit=False)
    # Another kind's consumer group is not the rollout worker's.
    joiner = make_consumer(rollout, group_id="crl-extractor", client_id="rollout-0")
    try:
        joiner.subscribe([TASKS.name])
        with pytest.raises(GroupAuthorizationFailedError, match="crl-extractor"):
            _poll(joiner, times=20)
    finally:
        joiner.close(autocommit=False)


def _poll(consumer: KafkaConsumer, times: int) -> None:
    for _ in range(times):
        consumer.poll(timeout_ms=500)


def test_the_broker_holds_exactly_the_acls_each_kind_declares(secured: SecuredBroker) -> None:
    admin = make_admin(secured.as_(ADMIN))
    try:
        for kind, worker in load_worker_registry().items():
            principal = worker_principal(kind)
            acls, error = admin.describe_acls(ACLFilter(
                f"User:{principal}", None, ACLOperation.ANY, ACLPermissionType.ANY,
                ResourcePatternFilter(ResourceType.ANY, None, PatternType.ANY)))
            assert error is None or error.errno == 0, error
            held = {(acl.resource_pattern.resource_type, acl.resource_pattern.resource_name, acl.operation)
                    for acl in acls}
            grant = worker_grant(worker)
            assert held == ({(ResourceType.TOPIC, t, op) for t in grant.reads
                             for op in (ACLOperation.READ, ACLOperation.DESCRIBE)}
                            | {(ResourceType.TOPIC, t, op) for t in grant.writes
                               for op in (ACLOperation.WRITE, ACLOperation.DESCRIBE)}
                            | {(ResourceType.GROUP, g, ACLOperation.READ) for g in grant.groups}), kind
            assert all(acl.permission_type == ACLPermissionType.ALLOW and acl.host == "*" for acl in acls)
        # The scheduler publishes control events; the rollout worker does not even read them.
        assert CONTROL.name in worker_grant(load_worker_registry()["scheduler"]).writes
        assert CONTROL.name not in worker_grant(load_worker_registry()["rollout"]).reads
    finally:
        admin.close()


def test_a_secured_directory_is_reused_and_refused_for_other_principals(secured: SecuredBroker) -> None:
    again = SecuredBus.create(secured.bus.directory, [p for p in secured.bus.principals if p != ADMIN])
    assert again.passwords == secured.bus.passwords
    with pytest.raises(ConfigError, match="formatted for other principals"):
        SecuredBus.create(secured.bus.directory, ["crl-someone-else"])


def test_stack_up_serves_a_secured_broker_with_the_kinds_acls(kafka_jars, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")} | {"COLUMNS": "300"}
    stack = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "stack", "up", "--run-dir", str(tmp_path),
                              "--broker", "kafka", "--security", "sasl_ssl"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "broker.json").exists():
            assert stack.poll() is None and time.monotonic() < deadline, stack.communicate()[0][-3000:]
            time.sleep(0.2)
        bus = SecuredBus.load(tmp_path / SECURITY_DIR)
        bootstrap = json.loads((tmp_path / "broker.json").read_text())["bootstrap_servers"]
        plain = KafkaSettings(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        producer = make_producer(bus.client_settings(plain, worker_principal("scheduler")))
        try:
            stop = next(e for e in example_events() if e.kind == "StopRequested")
            producer.send(CONTROL.name, value=encode(stop)).get(timeout=30)  # the scheduler publishes control
        finally:
            producer.close()
        producer = make_producer(bus.client_settings(plain, worker_principal("bank")))
        try:
            with pytest.raises(TopicAuthorizationFailedError, match=CONTROL.name):
                producer.send(CONTROL.name, value=encode(stop)).get(timeout=30)  # the bank does not
        finally:
            producer.close()
    finally:
        stack.send_signal(signal.SIGINT)
        output, _ = stack.communicate(timeout=60)
    assert stack.returncode == 0, output[-3000:]
    assert "secured SASL_SSL, SCRAM-SHA-512" in output
    assert not [secret for secret in bus.secrets() if secret in output]
