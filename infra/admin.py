"""Topic administration: create every registry topic idempotently, list and describe them.

Creation is idempotent: an existing topic with the registry's partition count is left alone; one with a different
count is an error (partitions cannot be changed later on the embedded broker, and changing them on Kafka re-keys
the log). Three topic configs are set at creation: retention (`retention.ms`, -1 = forever), the largest record
(`max.message.bytes`, so a stock broker's 1 MiB default does not refuse a record at the app's 1 MiB payload cap
plus its key and headers) and `min.insync.replicas`. Tansu accepts them and ignores them. Topics get one replica on
one broker and three (two in sync) on a cluster of three or more (`Replication`; `CRL_KAFKA__REPLICATION_FACTOR`
and `CRL_KAFKA__MIN_INSYNC_REPLICAS` override).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from infra.errors import ConfigError
from schemas.topics import TOPICS, Topic

TOPIC_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""`max.message.bytes` of every topic: the payload cap (1 MiB) with room for batches and headers, as compose sets
for its broker."""


class TopicMismatchError(ConfigError):
    """A topic exists with another partition count than the registry declares."""


@dataclass(frozen=True)
class TopicStatus:
    """What the broker says about one registry topic."""

    topic: Topic
    exists: bool
    partitions: int
    messages: int | None = None  # sum of high watermarks (records ever written, on an uncompacted topic)

    @property
    def matches(self) -> bool:
        return self.exists and self.partitions == self.topic.partitions


def existing_partition_counts(admin: KafkaAdminClient) -> dict[str, int]:
    names = admin.list_topics()
    if not names:
        return {}
    return {item["name"]: len(item["partitions"]) for item in admin.describe_topics(names)}


def topic_ids(admin: KafkaAdminClient, names: Iterable[str]) -> dict[str, str]:
    """The Kafka topic id of each topic: a new one at every creation, so it names one log's incarnation."""
    return {item["name"]: str(item["topic_id"]) for item in admin.describe_topics(list(names))}


def wait_for_leaders(admin: KafkaAdminClient, topics: Iterable[Topic] = TOPICS, timeout_s: float = 60.0) -> None:
    """Wait until every partition of `topics` has a leader. A restarted broker (the embedded Apache Kafka on
    `crl run --resume`) answers before it has brought its partitions online; a consumer that joins its group then
    sees no metadata for them, gets no partitions, and kafka-python was seen to stay in that state. Raises
    `TopicMismatchError` after `timeout_s` naming the partitions still without one."""
    names = [topic.name for topic in topics]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            described = admin.describe_topics(names)
        except KafkaError as exc:  # the broker still loading its logs
            leaderless = [f"all ({type(exc).__name__}: {exc})"]
        else:
            leaderless = [f"{item['name']}[{partition['partition_index']}]" for item in described
                          for partition in item["partitions"] if partition["leader_id"] < 0 or partition["error_code"]]
            leaderless += [item["name"] for item in described if item["error_code"] or not item["partitions"]]
        if not leaderless:
            return
        if time.monotonic() > deadline:
            raise TopicMismatchError(f"partitions without a leader after {timeout_s:.0f}s: {', '.join(leaderless)}")
        time.sleep(0.2)


@dataclass(frozen=True)
class Replication:
    """How many copies of each partition the topics get, and how many must be in sync for a write to land."""

    replicas: int
    min_insync: int

    @property
    def topic_configs(self) -> dict[str, str]:
        return {"min.insync.replicas": str(self.min_insync)}


def replication_for(admin: KafkaAdminClient, replicas: int | None = None, min_insync: int | None = None) -> Replication:
    """The replication of new topics: `replicas` (default: min(3, the brokers the cluster has)) and `min_insync`
    (default: 2 of 3 or more replicas, else 1). Raises `ConfigError` when the cluster has fewer brokers than
    replicas, or when more replicas must be in sync than exist."""
    brokers = len(admin.describe_cluster()["brokers"])
    replicas = replicas or min(3, brokers)
    if replicas > brokers:
        raise ConfigError(f"topics with {replicas} replicas need {replicas} brokers; the cluster has {brokers} "
                          "(CRL_KAFKA__REPLICATION_FACTOR)")
    min_insync = min_insync or (2 if replicas >= 3 else 1)
    if min_insync > replicas:
        raise ConfigError(f"min.insync.replicas {min_insync} is more than the {replicas} replicas of each partition "
                          "(CRL_KAFKA__MIN_INSYNC_REPLICAS): no write could ever land")
    return Replication(replicas, min_insync)


def create_topics(admin: KafkaAdminClient, topics: Iterable[Topic] = TOPICS, *, replicas: int | None = None,
                  min_insync: int | None = None) -> dict[str, str]:
    """Create every topic that is missing and wait until every partition has a leader. Returns `{name: "created" |
    "exists"}`; raises `TopicMismatchError`. Replication as `replication_for` says: by default one copy on one
    broker, three with two in sync on a cluster of three or more."""
    topics = list(topics)
    replication = replication_for(admin, replicas, min_insync)
    existing = existing_partition_counts(admin)
    result: dict[str, str] = {}
    for topic in topics:
        if topic.name in existing:
            if existing[topic.name] != topic.partitions:
                raise TopicMismatchError(
                    f"{topic.name} has {existing[topic.name]} partitions, the registry declares {topic.partitions};"
                    " delete it (or the broker's data) and run `crl topics create` again"
                )
            result[topic.name] = "exists"
            continue
        try:
            admin.create_topics(
                [
                    NewTopic(
                        topic.name,
                        topic.partitions,
                        replication.replicas,
                        topic_configs={"retention.ms": str(topic.retention_ms),
                                       "max.message.bytes": str(TOPIC_MAX_MESSAGE_BYTES),
                                       **replication.topic_configs},
                    )
                ]
            )
            result[topic.name] = "created"
        except TopicAlreadyExistsError:
            # Another process created it between our listing and our request.
            result[topic.name] = "exists"
    _wait_for_metadata(admin, [t.name for t in topics])
    wait_for_leaders(admin, topics)
    return result


def _wait_for_metadata(admin: KafkaAdminClient, names: list[str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if set(names) <= set(admin.list_topics()):
            return
        time.sleep(0.05)
    raise TopicMismatchError(f"topics {names} did not appear in metadata within {timeout_s:.0f}s")


def unowned_partitions(admin: KafkaAdminClient, group_id: str, topics: Iterable[str],
                       asking_client: str | None = None) -> set[tuple[str, int]]:
    """The partitions of `topics` that no member of consumer group `group_id` holds, as its coordinator says. While
    the group is not stable (a rebalance waiting for its members to join) no member holds any: all of them. What the
    coordinator assigns to members of client id `asking_client` counts as not held: the asker holds nothing, so an
    assignment it never took up is waiting too. A coordinator that describes a stable group's members without their
    client ids and assignments (Tansu) says nothing of who holds what: nothing is known to wait, the empty set."""
    group = admin.describe_groups([group_id])[group_id]
    counts = existing_partition_counts(admin)
    every = {(topic, partition) for topic in topics for partition in range(counts.get(topic, 0))}
    if group["group_state"] != "Stable":
        return every
    if group["members"] and not any(member.get("member_assignment") for member in group["members"]):
        return set()
    held = {(assigned["topic"], partition) for member in group["members"] if member.get("client_id") != asking_client
            for assigned in (member.get("member_assignment") or {}).get("assigned_partitions", [])
            for partition in assigned["partitions"]}
    return every - held


def describe_topics(admin: KafkaAdminClient, consumer: KafkaConsumer | None = None) -> list[TopicStatus]:
    """The registry topics as the broker has them; with `consumer`, also the number of records in each."""
    existing = existing_partition_counts(admin)
    statuses = []
    for topic in TOPICS:
        partitions = existing.get(topic.name, 0)
        messages = None
        if consumer is not None and partitions:
            messages = sum(high_watermarks(consumer, topic.name, partitions).values())
        statuses.append(TopicStatus(topic, topic.name in existing, partitions, messages))
    return statuses


def high_watermarks(consumer: KafkaConsumer, name: str, partitions: int) -> dict[int, int]:
    """High watermark of every partition of `name`.

    `end_offsets()` is wrong on Tansu (it returns the last batch's base offset + 1), so this assigns the partitions,
    seeks to the end and reads `position()`, which both brokers answer correctly after a fetch of the tail.
    """
    tps = [TopicPartition(name, p) for p in range(partitions)]
    consumer.assign(tps)
    consumer.seek_to_end(*tps)
    ends = {tp.partition: consumer.position(tp) for tp in tps}
    # position() after seek_to_end resolves through ListOffsets(latest), which Tansu answers with the high watermark;
    # confirm with a fetch where it disagrees with highwater().
    consumer.poll(timeout_ms=200)
    for tp in tps:
        observed = consumer.highwater(tp)
        if observed is not None:
            ends[tp.partition] = observed
    return ends
