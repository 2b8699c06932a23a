"""The three-node Apache Kafka cluster (infra/kafka_cluster.py): replicated topics that keep every acknowledged record
through a SIGKILLed node, a storage directory that keeps its size, and replication that must fit the cluster."""

from __future__ import annotations

import pytest
from kafka import KafkaConsumer, TopicPartition

from infra.admin import create_topics, replication_for
from infra.apache_kafka import KafkaJvm
from infra.errors import BrokerError, ConfigError
from infra.kafka import KafkaSettings, make_admin, make_producer
from infra.kafka_cluster import ApacheKafkaCluster
from infra.tansu import TansuBroker
from schemas.topics import RUNS, TOPICS

pytestmark = pytest.mark.integration


def _leader(admin, topic: str) -> int:
    return admin.describe_topics([topic])[0]["partitions"][0]["leader_id"]


@pytest.mark.apache_kafka
def test_a_replicated_topic_keeps_every_acknowledged_record_when_its_leader_is_killed(kafka_jars, tmp_path):
    data_dir = tmp_path / "kafka"
    with ApacheKafkaCluster(data_dir=data_dir, brokers=3, log_path=tmp_path / "logs" / "broker.log",
                            jvm=KafkaJvm(heap_mb=384)) as cluster:
        kafka = KafkaSettings(bootstrap_servers=cluster.bootstrap_servers)
        admin = make_admin(kafka)
        try:
            assert [b["broker_id"] for b in admin.describe_cluster()["brokers"]] == [1, 2, 3]
            assert set(create_topics(admin).values()) == {"created"}
            described = admin.describe_topics([RUNS.name])[0]["partitions"][0]
            assert sorted(described["replica_nodes"]) == [1, 2, 3] and sorted(described["isr_nodes"]) == [1, 2, 3]
            leader = _leader(admin, RUNS.name)
        finally:
            admin.close()
        assert (tmp_path / "logs" / f"broker-{leader}.log").stat().st_size > 0
        producer = make_producer(kafka)
        try:
            for n in range(20):
                producer.send(RUNS.name, value=f"before {n}".encode()).get(timeout=60)
            cluster.nodes[leader - 1].kill()
            assert cluster.is_running()  # two of three: the quorum holds
            # acks=all with min.insync.replicas=2: each of these lands on both survivors once a new leader is elected
            for n in range(20):
                producer.send(RUNS.name, value=f"after {n}".encode()).get(timeout=120)
        finally:
            producer.close()
        consumer = KafkaConsumer(bootstrap_servers=cluster.bootstrap_servers.split(","), enable_auto_commit=False,
                                 auto_offset_reset="earliest", consumer_timeout_ms=10_000)
        try:
            consumer.assign([TopicPartition(RUNS.name, 0)])
            values = [record.value.decode() for record in consumer]
        finally:
            consumer.close()
        assert values == [f"before {n}" for n in range(20)] + [f"after {n}" for n in range(20)]
        admin = make_admin(kafka)
        try:
            assert _leader(admin, RUNS.name) != leader
        finally:
            admin.close()
    assert not any(node.is_running() for node in cluster.nodes)
    with pytest.raises(BrokerError, match="holds a cluster of 3 brokers, not 2"):
        ApacheKafkaCluster(data_dir=data_dir, brokers=2)


def test_replication_must_fit_the_cluster(tmp_path):
    with TansuBroker(log_path=tmp_path / "tansu.log") as broker:
        admin = make_admin(KafkaSettings(bootstrap_servers=broker.bootstrap_servers))
        try:
            single = replication_for(admin)
            assert (single.replicas, single.min_insync) == (1, 1)
            with pytest.raises(ConfigError, match="3 replicas need 3 brokers; the cluster has 1"):
                create_topics(admin, TOPICS, replicas=3)
            with pytest.raises(ConfigError, match=r"min\.insync\.replicas 2 is more than the 1 replicas"):
                replication_for(admin, min_insync=2)
        finally:
            admin.close()
