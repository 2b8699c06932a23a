"""Kafka client settings: security pass-through and how the bootstrap address is found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from infra.apache_kafka import replication_policy, server_properties
from infra.broker import BrokerSettings, write_broker_file
from infra.kafka import KafkaSettings
from infra.tansu import TansuBroker
from pipeline.errors import ConfigError
from pipeline.runtime.context import resolve_kafka
from pipeline.settings import Settings


def test_plaintext_passes_only_the_bootstrap_and_protocol():
    assert KafkaSettings(bootstrap_servers="a:9092,b:9092").security() == {
        "bootstrap_servers": ["a:9092", "b:9092"],
        "security_protocol": "PLAINTEXT",
    }


def test_sasl_ssl_settings_pass_through_to_kafka_python():
    settings = KafkaSettings(
        bootstrap_servers="broker:9093", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
        sasl_plain_username="crl", sasl_plain_password="s3cret", ssl_cafile="/etc/ca.pem",
    )
    assert settings.security() == {
        "bootstrap_servers": ["broker:9093"],
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "crl",
        "sasl_plain_password": "s3cret",
        "ssl_cafile": "/etc/ca.pem",
        "ssl_check_hostname": True,
    }
    assert "s3cret" not in repr(settings)  # a SecretStr never shows in logs


def test_mutual_tls_passes_certificate_and_key():
    options = KafkaSettings(bootstrap_servers="b:9094", security_protocol="SSL", ssl_certfile="/c.pem",
                            ssl_keyfile="/k.pem").security()
    assert (options["ssl_certfile"], options["ssl_keyfile"]) == ("/c.pem", "/k.pem")


def test_unknown_protocol_is_rejected():
    with pytest.raises(ValidationError, match="security_protocol"):
        KafkaSettings(security_protocol="TLS")


def test_environment_configures_nested_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("CRL_KAFKA__BOOTSTRAP_SERVERS", "k:1")
    monkeypatch.setenv("CRL_KAFKA__SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("CRL_DB__URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("CRL_RUN_DIR", str(tmp_path / "my-run"))
    settings = Settings()
    assert resolve_kafka(settings).bootstrap_servers == "k:1"
    assert settings.kafka.sasl_mechanism == "PLAIN"
    assert settings.db.url == "postgresql+psycopg://u@h/db"
    assert settings.resolved_run_id == "my-run"


def test_bootstrap_comes_from_the_run_dir_broker_file_when_not_configured(monkeypatch, tmp_path):
    monkeypatch.delenv("CRL_KAFKA__BOOTSTRAP_SERVERS", raising=False)
    settings = Settings(run_dir=tmp_path)
    with pytest.raises(ConfigError, match="no broker"):
        resolve_kafka(settings)
    path = write_broker_file(tmp_path, TansuBroker(log_path=None, port=4242, tansu_bin=Path("/bin/true")))
    assert json.loads(path.read_text()) == {"bootstrap_servers": "127.0.0.1:4242", "pid": None, "kind": "tansu"}
    assert resolve_kafka(settings).bootstrap_servers == "127.0.0.1:4242"


def test_group_defaults_fit_a_stock_apache_kafka_and_heartbeats_must_fit_the_session():
    settings = KafkaSettings()
    assert 6000 <= settings.session_timeout_ms <= 1_800_000  # Apache Kafka's default group.min/max.session.timeout.ms
    with pytest.raises(ValidationError, match=r"heartbeat_interval_ms .* must be below session_timeout_ms"):
        KafkaSettings(session_timeout_ms=6000, heartbeat_interval_ms=6000)


def test_a_cluster_is_apache_kafka_and_its_nodes_replicate_three_ways_with_two_in_sync():
    with pytest.raises(ValidationError, match="need the Apache Kafka broker"):
        BrokerSettings(brokers=3)
    assert BrokerSettings(kind="kafka", brokers=3).brokers == 3
    single = server_properties(9092, 9093, Path("/log"))
    assert single["controller.quorum.voters"] == "1@127.0.0.1:9093"
    assert single["offsets.topic.replication.factor"] == "1" and "min.insync.replicas" not in single
    node = server_properties(9094, 9095, Path("/log"), node_id=2, voters={1: 9093, 2: 9095, 3: 9097})
    assert node["node.id"] == "2"
    assert node["controller.quorum.voters"] == "1@127.0.0.1:9093,2@127.0.0.1:9095,3@127.0.0.1:9097"
    assert node["listeners"] == "PLAINTEXT://127.0.0.1:9094,CONTROLLER://127.0.0.1:9095"
    assert {key: node[key] for key in replication_policy(3)} == {
        "offsets.topic.replication.factor": "3", "transaction.state.log.replication.factor": "3",
        "transaction.state.log.min.isr": "2", "share.coordinator.state.topic.replication.factor": "3",
        "share.coordinator.state.topic.min.isr": "2", "default.replication.factor": "3", "min.insync.replicas": "2"}
    assert replication_policy(2)["min.insync.replicas"] == "1"
    assert replication_policy(5)["default.replication.factor"] == "3"
