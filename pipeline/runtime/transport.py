"""Where records come from and go to. The worker runner talks only to `InputLog` and `OutputLog`.

Kafka implementations live here; `pipeline/runtime/harness.py` has in-memory ones for broker-free unit tests.

Two ways to consume:
- **group mode** (`KafkaGroupInput`): a consumer group spreads partitions over instances (rollout, extractor);
  offsets are committed to Kafka.
- **assign mode** (`KafkaAssignedInput`): the worker reads every partition itself and keeps its own positions (an
  `OffsetStore`, e.g. SQL). First record in ~0.03 s and exact resume; right for trainers, the bank and the
  archiver, which read every partition anyway (docs/kafka.md).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import CommitFailedError, KafkaError, OffsetOutOfRangeError, RebalanceInProgressError
from kafka.structs import OffsetAndMetadata

from pipeline.errors import ConfigError, GroupMembershipLostError, RetryableError, WorkerFailedError
from pipeline.runtime.group_commits import GroupCommitLog
from pipeline.runtime.offsets import LogPosition

log = logging.getLogger(__name__)

Position = tuple[str, int]
"""(topic, partition)."""

_STALE_POSITIONS = (
    "the broker no longer has the records these positions were saved against, and it reports no new topic id that"
    " would tell a new log apart (Kafka before 2.8). Use a new run directory, or remove this worker's rows from the"
    " consumer_offsets table to read the log from the start."
)


@dataclass(frozen=True)
class Record:
    """One record as read from a log, before decoding."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    headers: tuple[tuple[str, bytes], ...] = ()
    log_id: str = ""
    """Kafka topic id of the log the offset counts in (new at every topic creation)."""
    tenure: int = 0
    """Which assignment of its partition to this member the record was read under (`InputLog.tenure`)."""


class OffsetStore(Protocol):
    """Where an assign-mode worker keeps its next offset per (topic, partition), with the log it counts in."""

    def load(self) -> dict[Position, LogPosition]: ...

    def save(self, positions: Mapping[Position, LogPosition]) -> None: ...


class InputLog(Protocol):
    def poll(self, timeout_ms: int) -> list[Record]: ...

    def commit(self, positions: Mapping[Position, int]) -> None:
        """Make `positions` (next offsets to read) the durable resume point."""

    def lag(self, positions: Mapping[Position, int]) -> dict[Position, int]:
        """Records not yet handled per assigned partition (high watermark - handled position)."""

    def owns(self, position: Position) -> bool:
        """Whether records of `position` may be handled and committed by this worker right now."""

    def tenure(self, position: Position) -> int | None:
        """Which assignment of `position` to this worker holds now (a number new at every assignment), or None if
        it holds none. A position handled under an earlier tenure is never committed: between a revoke and a new
        assignment of the same partition, what the worker dropped may lie behind it (the runner's check)."""

    def close(self) -> None: ...


class OutputLog(Protocol):
    def send(self, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None: ...

    def flush(self) -> None:
        """Block until every record sent so far is acknowledged; raise `WorkerFailedError` if one was not."""

    def close(self) -> None: ...


def _records(batches: Mapping[TopicPartition, list[Any]], log_ids: Mapping[str, str],
             tenures: Mapping[Position, int] | None = None) -> list[Record]:
    records = []
    for batch in batches.values():
        for message in batch:
            records.append(Record(
                topic=message.topic, partition=message.partition, offset=message.offset, key=message.key,
                value=message.value, timestamp_ms=message.timestamp, headers=tuple(message.headers or ()),
                log_id=log_ids.get(message.topic, ""),
                tenure=0 if tenures is None else tenures.get((message.topic, message.partition), -1)))
    return records


def poll_through_outages(consumer: KafkaConsumer, timeout_ms: int) -> dict[TopicPartition, list[Any]]:
    """One consumer poll. kafka-python handles most connection losses inside `poll` (it logs them and reconnects),
    but raises some retriable errors from the work it does there (a connection lost under a position check while
    the broker restarts); those are logged and answered with no records after the poll's timeout, and the next poll
    reconnects, so a worker rides through a broker restart either way. Errors that are not retriable are raised."""
    try:
        return consumer.poll(timeout_ms=timeout_ms)
    except KafkaError as exc:
        if not exc.retriable:
            raise
        log.warning("poll failed (%s: %s); polling again", type(exc).__name__, exc)
        time.sleep(min(timeout_ms, 1000) / 1000)
        return {}


def _lag(consumer: KafkaConsumer, positions: Mapping[Position, int]) -> dict[Position, int]:
    lag = {}
    for tp in consumer.assignment():
        high = consumer.highwater(tp)
        if high is None:
            continue
        handled = positions.get((tp.topic, tp.partition))
        if handled is None:
            try:
                handled = consumer.position(tp, timeout_ms=100)
            except KafkaError:
                continue
        if handled is not None:
            lag[(tp.topic, tp.partition)] = max(0, high - handled)
    return lag


@dataclass(frozen=True)
class GroupWatch:
    """How a group member finds out it was left with nothing while its group's partitions wait, and starts afresh.

    The last resort: kafka-python has been seen to keep a member with no partitions after a broker restart, in a
    stable generation (one that joined before it knew the topics' partitions), or with its partitions revoked for a
    rebalance it never finished (a member polling with 0 ms, until `infra.kafka_group_join` fixed the join). Either
    way the partitions it should hold belong to nobody, so their records
    wait for ever. A member that has held no partition for `stuck_after_s` asks the group coordinator (`unowned`)
    which partitions of its topics no member holds (all of them while the group rebalances, and those the
    coordinator gave this member but it never took up); if any, it closes its consumer and joins again with a new one
    (`new_consumer`). A member with nothing because the others hold every
    partition (more members than partitions) is left alone; a rebalance longer than `stuck_after_s` costs one more.

    Each recreation leaves the group and joins it again, which starts the group's rebalance over. Two members left
    with nothing by one rebalance that takes longer than `stuck_after_s` (a loaded machine) would otherwise restart
    each other's rebalance for ever, each recreating its consumer every `stuck_after_s`; this was seen for 18 minutes.
    So every recreation in a row without a partition held in between doubles the wait before the next one, up to
    `longest_wait_s`, and each wait is stretched by a random part of up to `jitter` of itself, which puts two members
    out of step (`recreate_after`)."""

    new_consumer: Callable[[], KafkaConsumer]
    unowned: Callable[[], set[Position]]
    stuck_after_s: float = 30.0
    longest_wait_s: float = 240.0
    jitter: float = 0.5


def recreate_after(watch: GroupWatch, recreations: int, draw: float) -> float:
    """Seconds a member holding nothing waits before it recreates its consumer, after `recreations` recreations in a
    row with nothing held in between; `draw` in [0, 1) picks the random part. The first wait is `stuck_after_s`
    exactly."""
    if recreations == 0:
        return watch.stuck_after_s
    base = min(watch.stuck_after_s * 2 ** recreations, watch.longest_wait_s)
    return base * (1 + watch.jitter * draw)


class KafkaGroupInput:
    """Consumer-group input; commits go to Kafka.

    kafka-python 3 calls rebalance listeners on its IO thread, where blocking calls (a commit) are forbidden, so the
    listener only keeps the partitions this member owns, each with its tenure (a number new at every assignment);
    the runner asks `owns()` before it handles a partition and `tenure()` before it commits one. Records of a revoked
    partition that were already fetched are skipped, and its uncommitted progress is re-read by the new owner from
    the last commit (at-least-once; commits follow every poll batch). A partition revoked and assigned back to this
    member between two commits is read again from its last commit too: what the worker handled under the earlier
    tenure is not committed, since the worker may have dropped some of it while the partition was not its own.
    kafka-python's eager rebalance keeps such a partition at its fetch position, so `poll` seeks it back to its last
    commit and leaves out what it fetched of it. Each poll's records carry the tenures as they are when the poll
    returns (a join completes only inside the poll; a worker drops what it holds only between polls).
    With a `GroupWatch`, a member stuck with no partitions while some belong to nobody recreates its consumer.
    """

    def __init__(self, consumer: KafkaConsumer, topics: Iterable[str], log_ids: Mapping[str, str],
                 commit_log: GroupCommitLog | None = None, watch: GroupWatch | None = None) -> None:
        self.consumer = consumer
        self.topics = list(topics)
        self.log_ids = dict(log_ids)
        self.commit_log = commit_log
        """Where each commit is also recorded (the run's database), so a restored log can carry the group on."""
        self.watch = watch
        self.recreated = 0
        """How many times the consumer was recreated because it was stuck with no partitions."""
        self._owned: dict[Position, int] = {}
        """The partitions this member holds, each with its tenure."""
        self._assignments = 0
        self._seen_tenures: dict[Position, int] = {}
        """The tenure each partition had at the last poll that saw it owned."""
        self._owned_lock = threading.Lock()
        self._empty_since: float | None = None
        self._last_check = 0.0
        self._recreations_in_a_row = 0
        self._wait_s = watch.stuck_after_s if watch is not None else 0.0
        """How long this member may hold nothing before it recreates its consumer (`recreate_after`)."""
        self._subscribe(consumer)

    def _subscribe(self, consumer: KafkaConsumer) -> None:
        outer = self

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
                with outer._owned_lock:
                    for tp in revoked:
                        outer._owned.pop((tp.topic, tp.partition), None)
                log.info("partitions revoked: %s", sorted((tp.topic, tp.partition) for tp in revoked))

            def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
                with outer._owned_lock:
                    outer._assignments += 1
                    for tp in assigned:
                        outer._owned[(tp.topic, tp.partition)] = outer._assignments
                log.info("partitions assigned: %s", sorted((tp.topic, tp.partition) for tp in assigned))

        consumer.subscribe(topics=self.topics, listener=_Listener())
        # Metadata before the first poll joins: a member that joins before it knows the topics' partitions is assigned
        # none (kafka-python logs "No partition metadata"), and one such member after a broker restart never
        # rejoined. It must come after `subscribe`: kafka-python's coordinator snapshots the subscribed partitions
        # only from the metadata updates it sees after it, so a member holding metadata fetched earlier joined with
        # an empty snapshot, assigned (as leader) from it and re-joined at its next poll, revoking and re-assigning
        # everything at once; after such a re-join a member was seen to stop heartbeating for good.
        consumer.topics()

    def _check_stuck(self) -> None:
        """Recreate the consumer when it has held nothing for `stuck_after_s` while partitions belong to nobody."""
        assert self.watch is not None
        now = time.monotonic()
        with self._owned_lock:
            holding = bool(self._owned)
        if holding:
            self._empty_since = None
            self._recreations_in_a_row = 0
            self._wait_s = self.watch.stuck_after_s
            return
        if self._empty_since is None:
            self._empty_since = now
            return
        if now - self._empty_since < self._wait_s or now - self._last_check < self.watch.stuck_after_s:
            return
        self._last_check = now
        try:
            unowned = self.watch.unowned()
        except KafkaError as exc:
            log.warning("cannot ask the group coordinator which partitions are held (%s: %s)", type(exc).__name__,
                        exc)
            return
        if not unowned:
            return
        log.warning("this member has held no partition for %.0f s while %d partitions of its topics belong to no "
                    "member (%s): recreating its consumer", now - self._empty_since, len(unowned),
                    ", ".join(f"{t}[{p}]" for t, p in sorted(unowned)[:8]))
        stuck, self.consumer = self.consumer, self.watch.new_consumer()
        # It holds nothing, so there is nothing to commit; leaving the group lets a waiting rebalance go on at once.
        stuck.close(autocommit=False, timeout_ms=5000)
        self._subscribe(self.consumer)
        self.recreated += 1
        self._recreations_in_a_row += 1
        self._wait_s = recreate_after(self.watch, self._recreations_in_a_row, random.random())
        self._empty_since = now
        log.info("the next recreation, if this member still holds nothing, comes after %.0f s", self._wait_s)

    def owns(self, position: Position) -> bool:
        with self._owned_lock:
            return position in self._owned

    def tenure(self, position: Position) -> int | None:
        with self._owned_lock:
            return self._owned.get(position)

    def poll(self, timeout_ms: int) -> list[Record]:
        batches = poll_through_outages(self.consumer, timeout_ms)
        with self._owned_lock:
            tenures = dict(self._owned)
        # kafka-python's eager rebalance keeps a partition assigned back to this member at its fetch position, past
        # what the worker may have dropped while it was revoked: such a partition goes back to its last commit, and
        # what this poll fetched of it is read again from there.
        renewed = {p for p, tenure in tenures.items() if self._seen_tenures.get(p, tenure) != tenure}
        self._seen_tenures.update(tenures)
        if renewed:
            batches = {tp: batch for tp, batch in batches.items() if (tp.topic, tp.partition) not in renewed}
            for topic, partition in sorted(renewed):
                tp = TopicPartition(topic, partition)
                committed = self.consumer.committed(tp)
                if committed is None:
                    self.consumer.seek_to_beginning(tp)
                else:
                    self.consumer.seek(tp, committed)
                log.info("%s[%d] assigned again: reading from its last commit (%s)", topic, partition,
                         "the beginning" if committed is None else committed)
        records = _records(batches, self.log_ids, tenures)
        if self.watch is not None and not records:
            self._check_stuck()
        return records

    def commit(self, positions: Mapping[Position, int]) -> None:
        if not positions:
            return
        offsets = {TopicPartition(t, p): OffsetAndMetadata(offset, "", -1) for (t, p), offset in positions.items()}
        try:
            self.consumer.commit(offsets)
        except (CommitFailedError, RebalanceInProgressError) as exc:
            raise GroupMembershipLostError(f"offset commit refused: {exc}") from exc
        except KafkaError as exc:
            raise RetryableError(f"offset commit failed: {exc}") from exc
        if self.commit_log is not None:
            self.commit_log.record({(topic, partition): LogPosition(offset, self.log_ids.get(topic, ""))
                                    for (topic, partition), offset in positions.items()})

    def lag(self, positions: Mapping[Position, int]) -> dict[Position, int]:
        return _lag(self.consumer, positions)

    def close(self) -> None:
        self.consumer.close(autocommit=False)


class KafkaAssignedInput:
    """Reads every partition of `topics`, resuming from `offsets` (the worker's own store)."""

    def __init__(
        self,
        consumer: KafkaConsumer,
        topics: Iterable[str],
        offsets: OffsetStore,
        log_ids: Mapping[str, str],
        metadata_timeout_s: float = 10.0,
    ) -> None:
        self.consumer = consumer
        self.offsets = offsets
        self.log_ids = dict(log_ids)
        partitions = []
        for name in topics:
            deadline = time.monotonic() + metadata_timeout_s
            found = consumer.partitions_for_topic(name)
            while not found and time.monotonic() < deadline:
                time.sleep(0.1)
                consumer.topics()  # refreshes metadata
                found = consumer.partitions_for_topic(name)
            if not found:
                raise ConfigError(f"topic {name} does not exist on the broker; run `crl topics create`")
            partitions += [TopicPartition(name, p) for p in sorted(found)]
        consumer.assign(partitions)
        stored = offsets.load()
        self._unverified: dict[TopicPartition, int] = {}
        resumed = 0
        for tp in partitions:
            position = stored.get((tp.topic, tp.partition))
            current_log = self.log_ids.get(tp.topic, "")
            if position is not None and position.log_id != current_log:
                # A restarted embedded broker (memory only) or a re-created topic: a new log, counted from 0. Read it
                # from its start; the old log's records stay where they were archived.
                log.warning("%s[%d]: stored position %d counts in log %s, the broker now has log %s; reading the new"
                            " log from its start", tp.topic, tp.partition, position.next_offset, position.log_id,
                            current_log)
                position = None
            if position is None:
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, position.next_offset)
                self._unverified[tp] = position.next_offset
                resumed += 1
        log.info("assigned %d partitions; resuming %d from stored offsets", len(partitions), resumed)

    def poll(self, timeout_ms: int) -> list[Record]:
        try:
            records = _records(poll_through_outages(self.consumer, timeout_ms), self.log_ids)
        except OffsetOutOfRangeError as exc:
            raise ConfigError(f"a stored position lies outside the log ({exc}); {_STALE_POSITIONS}") from exc
        if self._unverified:
            self._check_positions_inside_log()
        return records

    def _check_positions_inside_log(self) -> None:
        # Tansu answers a fetch past the end with nothing rather than OFFSET_OUT_OF_RANGE, so a stale position
        # would wait silently while the new log's first records go unread. Compare with the high watermark the
        # first fetch response reports instead.
        for tp, position in list(self._unverified.items()):
            high = self.consumer.highwater(tp)
            if high is None:
                continue
            if position > high:
                raise ConfigError(
                    f"{tp.topic}[{tp.partition}]: the stored position {position} is past the end of the log ({high});"
                    f" {_STALE_POSITIONS}"
                )
            del self._unverified[tp]

    def owns(self, position: Position) -> bool:
        return True  # every partition is assigned to this worker for its whole life

    def tenure(self, position: Position) -> int | None:
        return 0

    def commit(self, positions: Mapping[Position, int]) -> None:
        if positions:
            self.offsets.save({
                (topic, partition): LogPosition(offset, self.log_ids.get(topic, ""))
                for (topic, partition), offset in positions.items()
            })

    def lag(self, positions: Mapping[Position, int]) -> dict[Position, int]:
        return _lag(self.consumer, positions)

    def close(self) -> None:
        self.consumer.close(autocommit=False)


class KafkaOutput:
    """Producer side; `flush()` waits for every acknowledgement and fails loudly if any send failed."""

    def __init__(self, producer: KafkaProducer, flush_timeout_s: float = 60.0) -> None:
        self.producer = producer
        self.flush_timeout_s = flush_timeout_s
        self._pending: list[Any] = []  # kafka-python's untyped send futures
        self._produced_ends: dict[Position, int] = {}

    def produced_ends(self) -> dict[Position, int]:
        """Per partition written to, one past the last acknowledged record of this producer."""
        return dict(self._produced_ends)

    def send(self, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        self._pending.append(self.producer.send(topic, key=key, value=value, headers=headers))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            self.producer.flush(timeout=self.flush_timeout_s)
        except KafkaError as exc:
            raise WorkerFailedError(f"producer flush failed: {exc}") from exc
        failures = [future.exception for future in pending if future.failed()]
        unfinished = sum(1 for future in pending if not future.is_done)
        if failures or unfinished:
            raise WorkerFailedError(
                f"{len(failures)} records failed and {unfinished} were not acknowledged; first error: "
                f"{failures[0] if failures else 'timeout'}"
            )
        for future in pending:
            written = future.value
            position = (written.topic, written.partition)
            self._produced_ends[position] = max(self._produced_ends.get(position, 0), written.offset + 1)

    def close(self) -> None:
        self.producer.close(timeout=10)
