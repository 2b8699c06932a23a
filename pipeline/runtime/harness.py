"""Run a worker on a list of events without a broker (for unit tests), through the very same `WorkerRunner`.

    result = run_worker(MyWorker(), [event1, event2, RawRecord("crl.trajectories", b"garbage")])
    assert result.outputs == [...]
    assert result.dead_letters[0].error_class == "MalformedPayloadError"

    worker, context = build_worker(Rollout, settings, log=[policy_published, *experience_ops])
    result = run_worker(worker, assignments, context=context)    # a real worker kind, its follows in memory

The in-memory logs record every produce, flush and commit in `result.journal`, so ordering guarantees (outputs
acknowledged before input offsets are committed) can be asserted directly. A worker built with `build_worker` reads
what it follows and what it reads to the end from a `MemoryLog`, which also receives everything the worker publishes
(so it reads its own writes, as on Kafka). The run ends once every input is handled and the worker is not `busy`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.runtime.blobs import BlobStore
from pipeline.runtime.context import RuntimeSettings, WorkerContext
from pipeline.runtime.log import MemoryLog
from pipeline.runtime.runner import Limits, Worker, WorkerRunner
from pipeline.runtime.settings import RunnerSettings
from pipeline.runtime.transport import Position, Record
from schemas.base import Event, Producer
from schemas.codec import DEFAULT_MAX_PAYLOAD_BYTES, decode, encode
from schemas.dead_letters import DeadLetter
from schemas.topics import DEAD_LETTERS, topic_named, topic_of

MEMORY_LOG_ID = "memory-log"
"""The log id records fed through the harness carry."""


@dataclass(frozen=True)
class RawRecord:
    """Bytes to feed a worker as if a raw Kafka client had written them to `topic`."""

    topic: str
    value: bytes | None
    key: bytes | None = None
    partition: int = 0
    timestamp_ms: int | None = None
    """The record's timestamp (Kafka allows any 64-bit value); None numbers it like the events around it."""
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass
class Journal:
    """Every transport action in order: ("send", topic, offset) / ("flush", n) / ("commit", positions)."""

    entries: list[tuple[Any, ...]] = field(default_factory=list)

    def kinds(self) -> list[str]:
        return [entry[0] for entry in self.entries]


class MemoryInput:
    """Delivers a fixed list of records, `batch_size` per poll; remembers what was committed."""

    def __init__(self, records: list[Record], journal: Journal, batch_size: int = 100) -> None:
        self._records = records
        self._next = 0
        self.batch_size = batch_size
        self.journal = journal
        self.committed: dict[Position, int] = {}
        self.revoked: set[Position] = set()  # partitions a test moved to "another member"
        self.tenures: dict[Position, int] = {}  # partitions a test assigned again (tenure 0 until then)

    def poll(self, timeout_ms: int) -> list[Record]:
        batch = self._records[self._next : self._next + self.batch_size]
        self._next += len(batch)
        return [replace(r, tenure=self.tenure((r.topic, r.partition)) or 0) for r in batch]

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self._records)

    def owns(self, position: Position) -> bool:
        return position not in self.revoked

    def tenure(self, position: Position) -> int | None:
        return None if position in self.revoked else self.tenures.get(position, 0)

    def assign_again(self, position: Position) -> None:
        """A rebalance gave `position` back to this member (a new tenure); its records are not delivered again."""
        self.revoked.discard(position)
        self.tenures[position] = self.tenures.get(position, 0) + 1

    def commit(self, positions: Mapping[Position, int]) -> None:
        self.committed.update(positions)
        self.journal.entries.append(("commit", dict(positions)))

    def lag(self, positions: Mapping[Position, int]) -> dict[Position, int]:
        ends: dict[Position, int] = {}
        for record in self._records:
            ends[(record.topic, record.partition)] = record.offset + 1
        return {pos: end - positions.get(pos, 0) for pos, end in ends.items()}

    def close(self) -> None:
        self.journal.entries.append(("close-input",))


class MemoryOutput:
    """Keeps sent records; they count as delivered only after `flush()`. `fail_next_flush` simulates a broker error.
    With `log`, delivered records are appended to it (partition 0 of their topic)."""

    def __init__(self, journal: Journal, log: MemoryLog | None = None) -> None:
        self.journal = journal
        self.log = log
        self.pending: list[tuple[str, bytes, bytes, list[tuple[str, bytes]]]] = []
        self.delivered: list[tuple[str, bytes, bytes, list[tuple[str, bytes]]]] = []
        self.fail_next_flush: Exception | None = None

    def send(self, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        self.pending.append((topic, key, value, headers))
        self.journal.entries.append(("send", topic))

    def flush(self) -> None:
        if self.fail_next_flush is not None:
            error, self.fail_next_flush = self.fail_next_flush, None
            raise error
        self.delivered += self.pending
        self.journal.entries.append(("flush", len(self.pending)))
        if self.log is not None:
            self.log.append([Record(topic, 0, self.log.next_offset(topic, 0), key, value, 1_700_000_000_000,
                                    tuple(headers), MEMORY_LOG_ID) for topic, key, value, headers in self.pending])
        self.pending = []

    def close(self) -> None:
        self.journal.entries.append(("close-output",))


@dataclass
class HarnessResult:
    outputs: list[Event]
    dead_letters: list[DeadLetter]
    committed: dict[Position, int]
    journal: Journal
    runner: WorkerRunner


def to_records(items: Iterable[Event | RawRecord]) -> list[Record]:
    """Encode events to their registry topic (raw records as given), numbering offsets per partition."""
    next_offset: dict[Position, int] = {}
    records: list[Record] = []
    for item in items:
        timestamp_ms = 1_700_000_000_000 + len(records)
        headers: tuple[tuple[str, bytes], ...] = ()
        if isinstance(item, RawRecord):
            topic, partition, key, value, headers = item.topic, item.partition, item.key, item.value, item.headers
            timestamp_ms = timestamp_ms if item.timestamp_ms is None else item.timestamp_ms
        else:
            registry_topic = topic_of(item)
            topic, partition, key, value = registry_topic.name, 0, registry_topic.key_bytes(item), encode(item)
        offset = next_offset.get((topic, partition), 0)
        next_offset[(topic, partition)] = offset + 1
        records.append(Record(topic, partition, offset, key, value, timestamp_ms=timestamp_ms, headers=headers,
                              log_id=MEMORY_LOG_ID))
    return records


def build_worker(worker_class: type[Worker], settings: RuntimeSettings, *, log: Iterable[Event | RawRecord] = (),
                 instance: str | None = None) -> tuple[Worker, WorkerContext]:
    """A worker of `worker_class` built as `crl worker` builds it, with a `MemoryLog` of `log` (encoded to their
    registry topics) for what it follows and reads to the end; pass the context on to `run_worker`."""
    context = WorkerContext(settings, instance or f"{worker_class.name}-test", MemoryLog(to_records(log)),
                            follows=worker_class.follows)
    return worker_class.build(context), context


def run_worker(
    worker: Worker,
    inputs: Iterable[Event | RawRecord] = (),
    *,
    context: WorkerContext | None = None,
    settings: RunnerSettings | None = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    batch_size: int = 100,
    run_id: str = "test-run",
    output: MemoryOutput | None = None,
    blobs: BlobStore | None = None,
    max_polls: int = 10_000,
    claim_check_bytes: int | None = None,
) -> HarnessResult:
    """Run `worker` until every input is handled and it is not `busy` (or it is `done`, or after `max_polls`), then
    decode what it published."""
    if blobs is None:  # a store of its own for this run, removed after it (pass one to read what it kept)
        with tempfile.TemporaryDirectory(prefix="crl-harness-blobs-") as directory:
            return run_worker(worker, inputs, context=context, settings=settings, max_payload_bytes=max_payload_bytes,
                              batch_size=batch_size, run_id=run_id, output=output,
                              blobs=BlobStore(Path(directory)), max_polls=max_polls,
                              claim_check_bytes=claim_check_bytes)
    journal = output.journal if output is not None else Journal()
    records = to_records(inputs)
    input_log = MemoryInput(records, journal, batch_size)
    memory_log = context.log if context is not None and isinstance(context.log, MemoryLog) else None
    output_log = output or MemoryOutput(journal, memory_log)
    runner = WorkerRunner(
        worker,
        input_log=input_log if worker.consumes or records else None,
        output_log=output_log,
        producer=Producer(worker=worker.name, instance=context.instance if context else f"{worker.name}-test"),
        run_id=run_id,
        settings=settings or RunnerSettings(retry_backoff_s=0.001, retry_backoff_max_s=0.01, poll_timeout_ms=1),
        max_payload_bytes=max_payload_bytes,
        blobs=blobs,
        claim_check_bytes=claim_check_bytes,
        limits=Limits(max_polls=max_polls),
        context=context,
        until_idle=True,
    )
    runner.run()
    outputs: list[Event] = []
    dead_letters: list[DeadLetter] = []
    for topic, _key, value, _headers in output_log.delivered:
        event = decode(topic_named(topic), value, max_bytes=1 << 30, blobs=blobs)
        if topic == DEAD_LETTERS.name:
            assert isinstance(event, DeadLetter)  # the dead-letter topic's registry holds only `DeadLetter`
            dead_letters.append(event)
        else:
            outputs.append(event)
    return HarnessResult(outputs, dead_letters, dict(input_log.committed), journal, runner)
