"""Reading the log outside a worker's own inputs, in one place: tailing topics in a thread (`follow`), reading a topic
to its end (`read_to_end`, `iterate_to_end`), and the end offsets of a topic (`end_offsets`).

    log = KafkaLog(kafka_settings)
    follower = log.follow([POLICY], on_record, name="policy").start()   # every record, in order, in a thread
    follower.wait_caught_up(10)                                            # what was on the log at the call is handled
    events = [decode(RUNS, r.value) for r in log.read_to_end(RUNS)]

Followers serve what a worker *follows* besides what it consumes: the newest policy of a role, the bank replica, the
live view of `crl run`. `MemoryLog` is the same interface over records held in memory, which the harness
(`pipeline.runtime.harness`) gives a worker instead of Kafka; so every worker runs without a broker in tests.

Kafka is polled here, in the runner's transports (`pipeline.runtime.transport`) and in `infra/`, nowhere else
(tests/unit/test_import_flow.py). "Caught up" compares what was handled with the high watermark a fetch reports
(`highwater()`), which both brokers answer correctly (Tansu's `end_offsets()` is one batch short).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, Self

from kafka import TopicPartition

from infra.admin import high_watermarks, topic_ids
from infra.kafka import KafkaSettings, make_admin, make_consumer
from pipeline.errors import InvalidStateError, RetryableError
from pipeline.runtime.transport import Record
from schemas.base import Event
from schemas.codec import BlobStorage, EventDecodeError, decode
from schemas.topics import Topic

log = logging.getLogger(__name__)

OnRecord = Callable[[Record], None]
"""Called with every record a follower reads, in log order per partition, from the follower's thread."""


class Follower(Protocol):
    """A topic followed in the background."""

    failure: BaseException | None

    def start(self) -> Follower: ...

    def stop(self, timeout_s: float = 10.0) -> None: ...

    def caught_up(self) -> bool:
        """Every record up to the high watermark last seen is handled (raises if the follower failed)."""

    def wait_caught_up(self, timeout_s: float) -> bool: ...

    def wait_for(self, ends: Mapping[tuple[str, int], int], timeout_s: float) -> bool:
        """Wait until every partition in `ends` is handled up to its offset there (read your own writes)."""


class FollowedView:
    """What a follower keeps current (the bank replica, the newest policy of a role, `crl run`'s view): started and
    stopped with its follower, and failed when it failed. Subclasses set `follower` in their constructor."""

    follower: Follower

    @property
    def failure(self) -> BaseException | None:
        return self.follower.failure

    def start(self) -> Self:
        self.follower.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.follower.stop(timeout_s)


class Follow(Protocol):
    """What opens a follower: `Log.follow`, or `WorkerContext.follow` (which also checks the worker's declarations
    and stops the follower with the worker)."""

    def __call__(self, topics: Sequence[Topic], on_record: OnRecord, *,
                 start: Mapping[tuple[str, int], int] | None = None, name: str = "follower") -> Follower: ...


class Log(Protocol):
    """The log as a worker may read it beyond its inputs."""

    def follow(self, topics: Sequence[Topic], on_record: OnRecord, *,
               start: Mapping[tuple[str, int], int] | None = None,
               name: str = "follower") -> Follower: ...

    def read_to_end(self, topic: Topic) -> list[Record]: ...

    def end_offsets(self, topic: Topic) -> dict[int, int]: ...

    def log_id(self, topic: Topic) -> str: ...


def _records(batches: Mapping[TopicPartition, list[Any]], log_ids: Mapping[str, str]) -> Iterator[Record]:
    for batch in batches.values():
        for message in batch:
            yield Record(message.topic, message.partition, message.offset, message.key, message.value,
                         message.timestamp, tuple(message.headers or ()), log_ids.get(message.topic, ""))


class TopicFollower:
    """Tails every partition of `topics` in a daemon thread from `start` (default: each partition's beginning),
    calling `on_record` for each record. A failure stops the thread and is kept in `failure`; `caught_up()` and the
    waits raise it, so it is never lost."""

    def __init__(self, kafka: KafkaSettings, topics: Sequence[Topic], on_record: OnRecord, *,
                 start: Mapping[tuple[str, int], int] | None = None, name: str = "follower",
                 log_ids: Mapping[str, str] | None = None) -> None:
        self.kafka = kafka
        self.partitions = [TopicPartition(t.name, p) for t in topics for p in range(t.partitions)]
        self.on_record = on_record
        self.start_offsets = dict(start or {})
        self.name = name
        self.log_ids = dict(log_ids or {})
        self.failure: BaseException | None = None
        self._read: dict[tuple[str, int], int] = {(tp.topic, tp.partition): self.start_offsets.get(
            (tp.topic, tp.partition), 0) for tp in self.partitions}
        self._high: dict[tuple[str, int], int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> TopicFollower:
        self._thread = threading.Thread(target=self._tail, name=f"follow-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _tail(self) -> None:
        consumer = make_consumer(self.kafka, client_id=f"crl-{self.name}")
        try:
            consumer.assign(self.partitions)
            for tp in self.partitions:
                offset = self.start_offsets.get((tp.topic, tp.partition))
                if offset is None:
                    consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, offset)
            while not self._stop.is_set():
                for record in _records(consumer.poll(timeout_ms=100), self.log_ids):
                    self.on_record(record)
                    # after handling: caught_up() must not run ahead of what the callback has seen
                    self._read[(record.topic, record.partition)] = record.offset + 1
                for tp in self.partitions:
                    high = consumer.highwater(tp)
                    if high is not None:
                        self._high[(tp.topic, tp.partition)] = high
        except BaseException as exc:  # surfaced through caught_up() / the waits, never lost in a daemon thread
            self.failure = exc
            log.exception("%s stopped following", self.name)
        finally:
            consumer.close(autocommit=False)

    def _check(self) -> None:
        if self.failure is not None:
            raise InvalidStateError(f"{self.name} stopped following the log: {self.failure}") from self.failure

    def caught_up(self) -> bool:
        self._check()
        if len(self._high) < len(self.partitions):
            return False  # no fetch answered for some partition yet
        return all(self._read[position] >= high for position, high in self._high.items())

    def wait_caught_up(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.caught_up():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def wait_for(self, ends: Mapping[tuple[str, int], int], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while any(self._read.get(position, 0) < end for position, end in ends.items()):
            self._check()
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


class KafkaLog:
    """The `Log` of a Kafka cluster."""

    def __init__(self, kafka: KafkaSettings, client_id: str = "crl-log") -> None:
        self.kafka = kafka
        self.client_id = client_id
        self._log_ids: dict[str, str] = {}

    def log_id(self, topic: Topic) -> str:
        """The topic id of `topic`'s log (a new one at every creation of the topic), or, for a log restored from the
        archive, the id of the log it was restored from (`KafkaSettings.log_aliases`)."""
        if topic.name not in self._log_ids:
            admin = make_admin(self.kafka, client_id=self.client_id)
            try:
                ids = topic_ids(admin, [topic.name])
            finally:
                admin.close()
            self._log_ids.update({name: self.kafka.log_aliases.get(id_, id_) for name, id_ in ids.items()})
        return self._log_ids[topic.name]

    def follow(self, topics: Sequence[Topic], on_record: OnRecord, *,
               start: Mapping[tuple[str, int], int] | None = None,
               name: str = "follower") -> TopicFollower:
        return TopicFollower(self.kafka, topics, on_record, start=start, name=name,
                             log_ids={t.name: self.log_id(t) for t in topics})

    def end_offsets(self, topic: Topic) -> dict[int, int]:
        """The high watermark of every partition of `topic` now."""
        consumer = make_consumer(self.kafka, client_id=f"{self.client_id}-ends")
        try:
            return high_watermarks(consumer, topic.name, topic.partitions)
        finally:
            consumer.close(autocommit=False)

    def iterate_to_end(self, topic: Topic, idle_timeout_s: float = 10.0,
                       partitions: Sequence[int] | None = None) -> Iterator[Record]:
        """Every record of `topic` (or of `partitions`) from offset 0 up to the ends it had when called, partition by
        partition in offset order. Raises `RetryableError` when no record arrives for `idle_timeout_s` before them."""
        chosen = list(partitions) if partitions is not None else list(range(topic.partitions))
        consumer = make_consumer(self.kafka, client_id=f"{self.client_id}-read")
        try:
            ends = {p: end for p, end in high_watermarks(consumer, topic.name, topic.partitions).items()
                    if p in chosen}
            tps = [TopicPartition(topic.name, p) for p in chosen if ends[p] > 0]
            if not tps:
                return
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            positions = dict.fromkeys((tp.partition for tp in tps), 0)
            log_ids = {topic.name: self.log_id(topic)}
            last_progress = time.monotonic()
            while any(positions[p] < ends[p] for p in positions):
                for record in _records(consumer.poll(timeout_ms=200), log_ids):
                    if record.offset < ends[record.partition]:
                        yield record
                    positions[record.partition] = record.offset + 1
                    last_progress = time.monotonic()
                if time.monotonic() - last_progress > idle_timeout_s:
                    raise RetryableError(f"reading {topic.name}: no records for {idle_timeout_s}s before the ends "
                                         f"{ends} (read up to {positions})")
        finally:
            consumer.close(autocommit=False)

    def read_to_end(self, topic: Topic) -> list[Record]:
        return list(self.iterate_to_end(topic))

    def records_after(self, start: Mapping[tuple[str, int], int], until: Callable[[Record], bool],
                      timeout_s: float) -> list[Record]:
        """Records of the (topic, partition)s of `start` from the offsets there, until `until(record)` says the last
        one has come, or `timeout_s`: what a producer wrote after noting the ends (`crl doctor`'s round trip)."""
        consumer = make_consumer(self.kafka, client_id=f"{self.client_id}-after")
        records: list[Record] = []
        try:
            tps = [TopicPartition(name, partition) for name, partition in start]
            consumer.assign(tps)
            for tp in tps:
                consumer.seek(tp, start[(tp.topic, tp.partition)])
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                for record in _records(consumer.poll(timeout_ms=200), {}):
                    records.append(record)
                    if until(record):
                        return records
            return records
        finally:
            consumer.close(autocommit=False)


class MemoryFollower:
    """A `Follower` over records in memory: `start()` hands over every record already there, and the log hands over
    every record appended later, at once (so a worker reads its own writes, as a Kafka follower would)."""

    def __init__(self, log: MemoryLog, names: set[str], on_record: OnRecord,
                 start: Mapping[tuple[str, int], int]) -> None:
        self.log = log
        self.names = names
        self.on_record = on_record
        self.start_offsets = dict(start)
        self.failure: BaseException | None = None
        self.started = False

    def deliver(self, record: Record) -> None:
        if record.topic in self.names and record.offset >= self.start_offsets.get((record.topic, record.partition), 0):
            self.on_record(record)

    def start(self) -> MemoryFollower:
        self.started = True
        for record in list(self.log.records):
            self.deliver(record)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.started = False

    def caught_up(self) -> bool:
        return True

    def wait_caught_up(self, timeout_s: float) -> bool:
        return True

    def wait_for(self, ends: Mapping[tuple[str, int], int], timeout_s: float) -> bool:
        return True


class MemoryLog:
    """The `Log` the harness gives a worker: records held in memory, encoded as on Kafka. `append` adds records (the
    harness appends what the worker publishes) and hands them to the followers of their topic."""

    def __init__(self, records: Sequence[Record] = (), log_id: str = "memory-log") -> None:
        self.records: list[Record] = []
        self._log_id = log_id
        self._followers: list[MemoryFollower] = []
        self.append(records)

    def append(self, records: Sequence[Record]) -> None:
        for record in records:
            self.records.append(record)
            for follower in self._followers:
                if follower.started:
                    follower.deliver(record)

    def next_offset(self, topic: str, partition: int) -> int:
        return sum(1 for r in self.records if r.topic == topic and r.partition == partition)

    def log_id(self, topic: Topic) -> str:
        return self._log_id

    def follow(self, topics: Sequence[Topic], on_record: OnRecord, *,
               start: Mapping[tuple[str, int], int] | None = None,
               name: str = "follower") -> MemoryFollower:
        follower = MemoryFollower(self, {t.name for t in topics}, on_record, start or {})
        self._followers.append(follower)
        return follower

    def end_offsets(self, topic: Topic) -> dict[int, int]:
        ends = dict.fromkeys(range(topic.partitions), 0)
        for record in self.records:
            if record.topic == topic.name:
                ends[record.partition] = max(ends[record.partition], record.offset + 1)
        return ends

    def read_to_end(self, topic: Topic) -> list[Record]:
        return [r for r in self.records if r.topic == topic.name]


def events_to_end(log_: Log, topic: Topic, blobs: BlobStorage | None = None) -> list[Event]:
    """Every event on `topic` up to its end now, decoded (claim checks redeemed from `blobs`); records that do not
    decode are skipped (the workers that consume the topic dead-letter them)."""
    events = []
    for record in log_.read_to_end(topic):
        try:
            events.append(decode(topic, record.value, blobs=blobs))
        except EventDecodeError as exc:
            log.debug("skipping undecodable %s[%d]@%d: %s", record.topic, record.partition, record.offset, exc)
    return events


def read_to_end(kafka: KafkaSettings, topic: Topic, blobs: BlobStorage | None = None) -> list[Event]:
    """Every event on `topic` of the Kafka of `kafka`, up to its end now (undecodable records skipped)."""
    return events_to_end(KafkaLog(kafka), topic, blobs)
