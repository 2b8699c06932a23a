"""A group member stuck with no partitions while its group's partitions wait (`GroupWatch` in
pipeline/runtime/transport.py), against Apache Kafka.

Provoking it: a member joins before its topic exists, so it is assigned nothing; the topic is then created and
filled. kafka-python would normally rejoin once its metadata shows the topic; the defect seen after a broker restart
is that it never does, which the test reproduces by turning that member's rejoin off (`need_rejoin`), the one piece of
kafka-python it changes. The watched member notices, recreates its consumer and reads every record; an unwatched one
in the same state reads nothing. A member with nothing because another holds every partition is left alone."""

from __future__ import annotations

import time
import uuid

import pytest
from kafka.admin import NewTopic

from infra.kafka import KafkaSettings, make_admin, make_consumer, make_producer
from pipeline.runtime.launch import group_watch
from pipeline.runtime.transport import KafkaGroupInput

pytestmark = [pytest.mark.integration, pytest.mark.apache_kafka]

STUCK_AFTER_S = 3.0


def _input(kafka: KafkaSettings, group: str, topic: str, watched: bool, member: str = "member-0") -> KafkaGroupInput:
    """A group input whose consumer's client id is `member`, as a worker's is its instance name."""
    watch = group_watch(kafka, group, member, [topic], stuck_after_s=STUCK_AFTER_S) if watched else None
    return KafkaGroupInput(make_consumer(kafka, group_id=group, client_id=member), [topic], {}, watch=watch)


def _create(kafka: KafkaSettings, topic: str, partitions: int) -> None:
    admin = make_admin(kafka)
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        admin.close()


def _poll_for(inputs: list[KafkaGroupInput], seconds: float) -> list[int]:
    counts = [0] * len(inputs)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for i, group_input in enumerate(inputs):
            counts[i] += len(group_input.poll(200))
    return counts


def test_a_member_left_with_nothing_while_partitions_wait_recreates_its_consumer(apache_kafka):
    kafka = KafkaSettings(bootstrap_servers=apache_kafka)
    topic = f"late-{uuid.uuid4().hex[:8]}"
    watched = _input(kafka, f"watched-{topic}", topic, watched=True)
    unwatched = _input(kafka, f"unwatched-{topic}", topic, watched=False)
    try:
        _poll_for([watched, unwatched], 2.0)  # both join their groups while the topic does not exist: nothing held
        assert not watched.consumer.assignment() and not unwatched.consumer.assignment()
        for group_input in (watched, unwatched):
            group_input.consumer._coordinator.need_rejoin = lambda: False  # the defect: it never rejoins
        _create(kafka, topic, partitions=2)
        producer = make_producer(kafka)
        for n in range(10):
            producer.send(topic, value=f"record {n}".encode(), partition=n % 2)
        producer.flush()
        producer.close()
        counts = _poll_for([watched, unwatched], 4 * STUCK_AFTER_S + 10)
        assert counts == [10, 0]
        assert watched.recreated == 1 and unwatched.recreated == 0
        assert {tp.partition for tp in watched.consumer.assignment()} == {0, 1}
    finally:
        watched.close()
        unwatched.close()


def test_a_member_with_nothing_because_another_holds_every_partition_is_left_alone(apache_kafka):
    kafka = KafkaSettings(bootstrap_servers=apache_kafka)
    topic = f"one-{uuid.uuid4().hex[:8]}"
    _create(kafka, topic, partitions=1)
    group = f"pair-{topic}"
    first = _input(kafka, group, topic, watched=True)
    try:
        _poll_for([first], 2.0)
        second = _input(kafka, group, topic, watched=True, member="member-1")
        try:
            _poll_for([first, second], 3 * STUCK_AFTER_S + 6)
            held = [len(first.consumer.assignment()), len(second.consumer.assignment())]
            assert sorted(held) == [0, 1]  # one partition, two members: one of them holds nothing, rightly
            assert first.recreated == 0 and second.recreated == 0
        finally:
            second.close()
    finally:
        first.close()


def test_a_lone_member_is_assigned_once_when_it_joins(apache_kafka):
    # Its first join already knows the topic's partitions: one assignment, no revoke-and-re-assign right after.
    kafka = KafkaSettings(bootstrap_servers=apache_kafka)
    topic = f"early-{uuid.uuid4().hex[:8]}"
    _create(kafka, topic, partitions=4)
    member = _input(kafka, f"lone-{topic}", topic, watched=False)
    try:
        _poll_for([member], 4.0)
        assert len(member.consumer.assignment()) == 4
        assert member._assignments == 1
    finally:
        member.close()
