"""The secured bus without a broker: its files, its SCRAM arguments, its broker settings and each kind's grant."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from infra.broker import BrokerError, BrokerSettings, embedded_broker
from infra.errors import ConfigError
from infra.kafka_security import ADMIN, CONTROLLER, SCRAM_ITERATIONS, SecuredBus, scram_argument
from pipeline.run.security import worker_grant, worker_principal
from pipeline.runtime.launch import load_worker_registry
from schemas.topics import DEAD_LETTERS

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None and os.environ.get("CI") != "true",
                   reason="the secured bus needs `openssl` (on CI its absence fails the test)")


@needs_openssl
def test_the_bus_makes_private_keys_and_a_password_per_principal(tmp_path: Path) -> None:
    bus = SecuredBus.create(tmp_path / "security", ["crl-rollout", "crl-bank"])
    assert stat.S_IMODE(bus.directory.stat().st_mode) == 0o700
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in bus.directory.iterdir()}
    assert modes == {"ca.pem": 0o644, "ca-key.pem": 0o600, "broker-keystore.pem": 0o600, "credentials.json": 0o600}
    keystore = bus.keystore_file.read_text()
    assert keystore.count("BEGIN PRIVATE KEY") == 1 and keystore.count("BEGIN CERTIFICATE") == 2
    assert set(bus.passwords) == {ADMIN, CONTROLLER, "crl-rollout", "crl-bank"}
    assert bus.principals == [ADMIN, "crl-rollout", "crl-bank"]
    assert len(set(bus.passwords.values())) == 4 and all(len(p) >= 32 for p in bus.passwords.values())
    assert SecuredBus.create(bus.directory, ["crl-rollout", "crl-bank"]).passwords == bus.passwords  # read back
    assert len(bus.secrets()) == 4 + 2  # the passwords and both private keys


@needs_openssl
def test_credentials_that_others_may_read_are_refused(tmp_path: Path) -> None:
    bus = SecuredBus.create(tmp_path / "security", ["crl-rollout"])
    (bus.directory / "credentials.json").chmod(0o644)
    with pytest.raises(ConfigError, match="must be 0600"):
        SecuredBus.load(bus.directory)


def test_principal_names_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="distinct"):
        SecuredBus.create(tmp_path, ["crl-admin"])
    with pytest.raises(ConfigError, match="letters, digits"):
        SecuredBus.create(tmp_path, ["crl rollout,x"])


def test_the_scram_argument_carries_a_salted_password_not_the_password() -> None:
    argument = scram_argument("crl-rollout", "hunter2-password")
    assert "hunter2-password" not in argument
    match = re.fullmatch(r'SCRAM-SHA-512=\[name=crl-rollout,iterations=(\d+),salt="([^"]+)",saltedpassword="([^"]+)"\]',
                         argument)
    assert match is not None
    iterations, salt, salted = int(match[1]), base64.b64decode(match[2]), base64.b64decode(match[3])
    assert iterations == SCRAM_ITERATIONS
    assert salted == hashlib.pbkdf2_hmac("sha512", b"hunter2-password", salt, iterations)


@needs_openssl
def test_a_secured_node_listens_with_sasl_ssl_and_authorizes_everything(tmp_path: Path) -> None:
    bus = SecuredBus.create(tmp_path, ["crl-rollout"])
    properties = bus.broker_properties(9093, 9094)
    assert properties["listeners"] == "SASL_SSL://127.0.0.1:9093,CONTROLLER://127.0.0.1:9094"
    assert properties["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT"
    assert properties["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert properties["authorizer.class.name"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert properties["allow.everyone.if.no.acl.found"] == "false"
    assert properties["super.users"] == "User:crl-admin;User:crl-controller"
    assert properties["ssl.keystore.type"] == "PEM"
    assert json.loads((tmp_path / "credentials.json").read_text())["passwords"]["crl-admin"] in \
        properties["listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config"]


def test_security_needs_one_apache_kafka_node_and_its_bus(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="needs the Apache Kafka broker"):
        BrokerSettings(security="sasl_ssl")
    with pytest.raises(ValidationError, match="one embedded Apache Kafka node"):
        BrokerSettings(kind="kafka", brokers=3, security="sasl_ssl")
    with pytest.raises(ValidationError):
        BrokerSettings(kind="kafka", security="tls")  # type: ignore[arg-type]
    with pytest.raises(BrokerError, match="pass one exactly when it is secured"):
        embedded_broker(BrokerSettings(kind="kafka", security="sasl_ssl"), data_dir=tmp_path)


def test_each_kind_is_granted_what_it_declares_and_nothing_else() -> None:
    registry = load_worker_registry()
    rollout = worker_grant(registry["rollout"])
    assert rollout.principal == worker_principal("rollout") == "crl-rollout"
    assert set(rollout.reads) == {"crl.tasks", "crl.policy", "crl.experience-ops", "crl.trajectories"}
    assert set(rollout.writes) == {"crl.trajectories", DEAD_LETTERS.name}
    assert rollout.groups == ["crl-rollout"]
    archiver = worker_grant(registry["archiver"])
    assert set(archiver.writes) == {DEAD_LETTERS.name} and archiver.groups == []  # assign mode: no group
    for kind, worker in registry.items():
        grant = worker_grant(worker)
        declared = {t.name for t in (*worker.consumes, *worker.follows, *worker.produces)}
        assert set(grant.reads) == declared, kind
        assert set(grant.writes) == {t.name for t in worker.produces} | {DEAD_LETTERS.name}, kind
