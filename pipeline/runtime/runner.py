"""The worker runner: everything a worker does besides its own logic.

A worker is either a `Processor` (`handle(event, origin) -> list[Event]`, for consumers) or a `Source` (`run(io)`,
for producers that drive their own loop). The runner owns the rest, in this order for every record:

1. decode -> upcast -> validate (`schemas.codec.decode`); a poison record becomes a `DeadLetter`;
2. `handle` with retries and exponential backoff on `RetryableError`; `PoisonMessageError` or any other exception
   from the handler dead-letters the record (the error class and message say why; the raw bytes are kept);
3. outputs are encoded and sent with the registry's key;
4. at a commit point: `processor.flush()` (durable state), producer flush (every output acknowledged), and only then
   the input offsets are committed. A crash anywhere before that re-delivers the input: at-least-once, so
   projections must be idempotent (deterministic ids, dedupe by `event_id`).

Stopping: SIGTERM/SIGINT finish the current record, flush, commit and exit; so do `max_events` and `timeout_s`.
Metrics (events in/out, dead letters, retries, handler time, lag) are logged every `metrics_interval_s` and appended
as JSON lines to `RUN_DIR/metrics/<worker>.<instance>.jsonl` when a path is given.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pipeline.errors import (
    ConfigError,
    InvalidStateError,
    PipelineError,
    PoisonMessageError,
    RetryableError,
    WorkerFailedError,
)
from pipeline.runtime.blobs import BlobStore
from pipeline.runtime.settings import RunnerSettings
from pipeline.runtime.transport import InputLog, OffsetStore, OutputLog, Position, Record
from schemas.base import Event, Producer
from schemas.codec import EventDecodeError, decode, encode_for_topic
from schemas.dead_letters import MAX_INLINE_RAW_BYTES, DeadLetter
from schemas.topics import Topic, topic_named

if TYPE_CHECKING:
    from pipeline.runtime.context import WorkerContext

log = logging.getLogger(__name__)

Consumption = Literal["group", "assign"]


@dataclass(frozen=True)
class Origin:
    """Where an input event was read from."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    log_id: str = ""
    """Kafka topic id of the log `offset` counts in."""


class Processor(ABC):
    """A consumer worker: one input event in, zero or more output events out."""

    name: ClassVar[str]
    """Worker kind; also the consumer-group id and the `WORKERS` key."""
    inputs: ClassVar[tuple[Topic, ...]]
    consumption: ClassVar[Consumption] = "group"

    @classmethod
    def build(cls, context: WorkerContext) -> Processor:
        """Construct the worker from its context (settings, run dir, database). Override to read settings."""
        return cls()

    def offset_store(self, context: WorkerContext) -> OffsetStore:
        """Where assign-mode positions live; default the run's SQL database. A projection that stores its position
        with its state in one transaction overrides this."""
        return context.sql_offset_store(self.name)

    @abstractmethod
    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        """Process one event; return the events to publish."""

    def flush_due(self, now: float) -> bool:
        """Whether the runner should flush and commit now (`now` is `time.monotonic()`). Default: after every poll."""
        return True

    def flush(self) -> None:
        """Make everything handled so far durable; called before input offsets are committed.

        Stateless processors keep nothing between events, so the default has nothing to write.
        """

    def close(self) -> None:
        """Release resources after the final commit."""


class Source(ABC):
    """A worker that drives its own loop (e.g. the scheduler), optionally reading `inputs` through `io.poll()`."""

    name: ClassVar[str]
    inputs: ClassVar[tuple[Topic, ...]] = ()
    consumption: ClassVar[Consumption] = "group"

    @classmethod
    def build(cls, context: WorkerContext) -> Source:
        return cls()

    def offset_store(self, context: WorkerContext) -> OffsetStore:
        return context.sql_offset_store(self.name)

    @abstractmethod
    def run(self, io: SourceIO) -> None:
        """Produce events with `io.publish` until done or until `io.stopping`."""

    def committable(self, positions: dict[Position, int]) -> dict[Position, int]:
        """The positions that may be committed, given the next offset polled per partition. A source that works on
        polled events across several commits (a rollout worker's episodes in flight) holds its positions back to
        the oldest unfinished one, so a restart re-reads exactly what was not finished."""
        return positions

    def close(self) -> None:
        """Release resources after the final flush."""


@dataclass
class WorkerMetrics:
    events_in: int = 0
    events_out: int = 0
    dead_letters: int = 0
    retries: int = 0
    commits: int = 0
    handler_seconds: float = 0.0
    lag: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> dict[str, object]:
        data = asdict(self)
        data["handler_ms_mean"] = round(1000 * self.handler_seconds / self.events_in, 3) if self.events_in else 0.0
        return data


@dataclass(frozen=True)
class Limits:
    """Bounds for smoke runs: stop after `max_events` input events or `timeout_s` seconds (None: unbounded)."""

    max_events: int | None = None
    timeout_s: float | None = None


class WorkerRunner:
    """Runs one Processor or Source against an input and an output log until stopped."""

    def __init__(
        self,
        worker: Processor | Source,
        *,
        input_log: InputLog | None,
        output_log: OutputLog,
        producer: Producer,
        run_id: str,
        settings: RunnerSettings | None = None,
        max_payload_bytes: int,
        blobs: BlobStore | None = None,
        metrics_path: Path | None = None,
        limits: Limits = Limits(),
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.worker = worker
        self.input_log = input_log
        self.output_log = output_log
        self.producer = producer
        self.run_id = run_id
        self.settings = settings or RunnerSettings()
        self.max_payload_bytes = max_payload_bytes
        self.blobs = blobs
        self.metrics_path = metrics_path
        self.limits = limits
        self.metrics = WorkerMetrics()
        self.on_progress: Callable[[WorkerMetrics], None] | None = None
        """Called with the metrics at most every 0.5 s (the CLI's live status line)."""
        self._last_progress = 0.0
        self.positions: dict[Position, int] = {}
        self._uncommitted = False  # records handled since the last commit
        self.stop_reason: str | None = None
        self._stop = threading.Event()
        self._sleep = sleep or self._stop.wait
        self._started = time.monotonic()
        self._last_metrics = self._started

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            log.info("stop requested: %s", reason)
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGINT: finish the current event, flush, commit, exit. Only possible in the main thread."""

        def on_signal(signum: int, _frame: object) -> None:
            self.request_stop(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def run(self) -> WorkerMetrics:
        log.info("worker %s (%s) starting", self.producer.worker, self.producer.instance)
        try:
            if isinstance(self.worker, Source):
                self.worker.run(SourceIO(self))
                self.commit()
            else:
                self._consume()
        finally:
            self._write_metrics(final=True)
            self.worker.close()
            if self.input_log is not None:
                self.input_log.close()
            self.output_log.close()
        log.info("worker %s stopped (%s): %s", self.producer.worker, self.stop_reason or "finished",
                 self.metrics.snapshot())
        return self.metrics

    def _consume(self) -> None:
        assert isinstance(self.worker, Processor) and self.input_log is not None
        while not self._check_limits():
            records = self.input_log.poll(self.settings.poll_timeout_ms)
            for record in records:
                if self._check_limits():
                    break  # not handled, not committed: the next start reads it again
                self._process(record)
            if self.worker.flush_due(time.monotonic()) and self._uncommitted:
                self.commit()
            self._maybe_report()
        self.commit()

    # -- per record -----------------------------------------------------------------------------------------------

    def _check_limits(self) -> bool:
        if self.limits.max_events is not None and self.metrics.events_in >= self.limits.max_events:
            self.request_stop(f"max_events={self.limits.max_events} reached")
        elif self.limits.timeout_s is not None and time.monotonic() - self._started >= self.limits.timeout_s:
            self.request_stop(f"timeout={self.limits.timeout_s}s reached")
        return self._stop.is_set()

    def decode_or_dead_letter(self, record: Record) -> Event | None:
        """The record's event, or None after publishing a dead letter for it."""
        try:
            return decode(topic_named(record.topic), record.value, self.max_payload_bytes)
        except Exception as exc:  # EventDecodeError, an unknown topic, or anything else: never crash on input
            self.publish_dead_letter(record, exc)
            return None

    def _process(self, record: Record) -> None:
        assert isinstance(self.worker, Processor) and self.input_log is not None
        if not self.input_log.owns((record.topic, record.partition)):
            return  # fetched before its partition moved to another member, which will read it
        self.metrics.events_in += 1
        event = self.decode_or_dead_letter(record)
        if event is not None:
            origin = Origin(record.topic, record.partition, record.offset, record.timestamp_ms, record.key, record.log_id)
            try:
                outputs = self._handle_with_retries(event, origin, record)
            except _StoppedDuringRetry as stopped:
                # Not handled, so not committed: the next start reads it again. What came before is committed.
                log.info("stopped while retrying %s; it stays uncommitted", stopped)
                return
            if outputs is not None:
                for topic, key, value, headers in outputs:
                    self.output_log.send(topic, key, value, headers)
                self.metrics.events_out += len(outputs)
        self.positions[(record.topic, record.partition)] = record.offset + 1
        self._uncommitted = True

    def _handle_with_retries(self, event: Event, origin: Origin, record: Record) -> list[tuple] | None:
        assert isinstance(self.worker, Processor)
        attempt = 0
        while True:
            started = time.perf_counter()
            try:
                return [self.encode_output(out) for out in self.worker.handle(event, origin)]
            except RetryableError as exc:
                attempt += 1
                self.metrics.retries += 1
                if attempt > self.settings.max_retries:
                    raise WorkerFailedError(
                        f"{event.kind} {event.event_id} still failing after {self.settings.max_retries} retries: {exc}"
                    ) from exc
                delay = min(self.settings.retry_backoff_s * 2 ** (attempt - 1), self.settings.retry_backoff_max_s)
                log.warning("retry %d/%d in %.2fs for %s at %s[%d]@%d: %s", attempt, self.settings.max_retries,
                            delay, event.kind, origin.topic, origin.partition, origin.offset, exc)
                self._sleep(delay)
                if self._stop.is_set():
                    raise _StoppedDuringRetry(f"{event.kind} {event.event_id}: {exc}") from exc
            except (PoisonMessageError, EventDecodeError) as exc:
                self.publish_dead_letter(record, exc)
                return None
            except (ConfigError, WorkerFailedError):
                raise  # the worker's environment is wrong, not this input: stop without committing it
            except Exception as exc:  # a handler bug on this input: record it with its class, keep the worker up
                log.exception("handler failed on %s at %s[%d]@%d", event.kind, origin.topic, origin.partition,
                              origin.offset)
                self.publish_dead_letter(record, exc)
                return None
            finally:
                self.metrics.handler_seconds += time.perf_counter() - started

    # -- outputs --------------------------------------------------------------------------------------------------

    def encode_output(self, event: Event) -> tuple[str, bytes, bytes, list[tuple[str, bytes]]]:
        topic, key, value = encode_for_topic(event, self.max_payload_bytes)
        return topic.name, key, value, _headers(event)

    def publish(self, event: Event) -> None:
        topic, key, value, headers = self.encode_output(event)
        self.output_log.send(topic, key, value, headers)
        self.metrics.events_out += 1

    def publish_dead_letter(self, record: Record, error: BaseException) -> None:
        letter = self.dead_letter(record, error)
        log.warning("dead letter %s[%d]@%d %s: %s", record.topic, record.partition, record.offset,
                    letter.error_class, letter.error_message)
        topic, key, value, headers = self.encode_output(letter)
        self.output_log.send(topic, key, value, headers)
        self.metrics.dead_letters += 1

    def dead_letter(self, record: Record, error: BaseException) -> DeadLetter:
        raw = record.value or b""
        # Inline only what leaves the dead letter well inside the payload cap (base64 grows 4/3; envelope, key and
        # a message of up to 4000 characters fit in 16 KiB); anything larger goes to the blob store.
        inline_limit = min(MAX_INLINE_RAW_BYTES, (self.max_payload_bytes - 16 * 1024) * 3 // 4)
        inline = len(raw) <= inline_limit
        if inline:
            raw_b64, raw_uri, raw_sha256 = base64.b64encode(raw).decode("ascii"), None, None
        else:
            if self.blobs is None:
                raise WorkerFailedError(
                    f"record {record.topic}[{record.partition}]@{record.offset} ({len(raw)} bytes) needs a claim"
                    " check but the worker has no blob store"
                )
            raw_b64 = None
            raw_uri, raw_sha256 = self.blobs.put(raw)
        message = str(error)
        return DeadLetter(
            run_id=self.run_id,
            producer=self.producer,
            source_topic=record.topic,
            source_partition=record.partition,
            source_offset=record.offset,
            source_key_b64=base64.b64encode(record.key).decode("ascii") if record.key is not None else None,
            raw_b64=raw_b64,
            raw_uri=raw_uri,
            raw_size=len(raw),
            raw_sha256=raw_sha256 or hashlib.sha256(raw).hexdigest(),
            error_class=type(error).__name__,
            error_message=message[:4000] if message else repr(error),
        )

    # -- commits --------------------------------------------------------------------------------------------------

    def commit(self) -> None:
        """Durable state, then every output acknowledged, then the input positions. Never the other way round."""
        if isinstance(self.worker, Processor):
            self.worker.flush()
        self.output_log.flush()
        if self.input_log is not None and self.positions:
            # A partition that moved to another member is not ours to commit: its new owner resumes at the last
            # commit and re-reads what was handled here since (at-least-once).
            for position in [p for p in self.positions if not self.input_log.owns(p)]:
                log.info("not committing %s[%d]: the partition was revoked", *position)
                del self.positions[position]
            positions = dict(self.positions)
            if isinstance(self.worker, Source):
                positions = self.worker.committable(positions)
            self._commit_with_retries(positions)
        self.metrics.commits += 1
        self._uncommitted = False

    def _commit_with_retries(self, positions: dict[Position, int]) -> None:
        assert self.input_log is not None
        for attempt in range(1, self.settings.max_retries + 2):
            try:
                self.input_log.commit(positions)
                return
            except RetryableError as exc:
                if attempt > self.settings.max_retries:
                    raise WorkerFailedError(f"offset commit failed {attempt} times: {exc}") from exc
                self.metrics.retries += 1
                delay = min(self.settings.retry_backoff_s * 2 ** (attempt - 1), self.settings.retry_backoff_max_s)
                log.warning("commit retry %d/%d in %.2fs: %s", attempt, self.settings.max_retries, delay, exc)
                time.sleep(delay)  # not interruptible: a stopping worker still wants this commit

    # -- metrics --------------------------------------------------------------------------------------------------

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._last_metrics >= self.settings.metrics_interval_s:
            self._write_metrics(final=False)
        if self.on_progress is not None and now - self._last_progress >= 0.5:
            self._last_progress = now
            self.on_progress(self.metrics)

    def _write_metrics(self, final: bool) -> None:
        self._last_metrics = time.monotonic()
        if self.input_log is not None:
            try:
                lag = self.input_log.lag(self.positions)
                self.metrics.lag = {f"{t}[{p}]": n for (t, p), n in sorted(lag.items()) if n}
            except Exception as exc:  # metrics must never take a worker down
                log.debug("lag unavailable: %s", exc)
        snapshot = self.metrics.snapshot()
        log.info("metrics worker=%s instance=%s %s", self.producer.worker, self.producer.instance,
                 json.dumps(snapshot, sort_keys=True))
        if self.metrics_path is not None:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            line = {"t": time.time(), "worker": self.producer.worker, "instance": self.producer.instance,
                    "final": final, **snapshot}
            with self.metrics_path.open("a") as handle:
                handle.write(json.dumps(line, sort_keys=True) + "\n")


class SourceIO:
    """What a Source sees of the runner: publish, poll its inputs, commit, and whether to stop."""

    def __init__(self, runner: WorkerRunner) -> None:
        self._runner = runner

    @property
    def stopping(self) -> bool:
        return self._runner._check_limits()

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; returns True early when a stop was requested."""
        return self._runner._stop.wait(seconds)

    def publish(self, event: Event) -> None:
        self._runner.publish(event)

    def poll(self, timeout_ms: int | None = None) -> Iterator[tuple[Event, Origin]]:
        """Decoded input events (poison records are dead-lettered on the way). Positions advance as you iterate."""
        runner = self._runner
        if runner.input_log is None:
            raise InvalidStateError(f"{runner.worker.name} declares no inputs to poll")
        for record in runner.input_log.poll(runner.settings.poll_timeout_ms if timeout_ms is None else timeout_ms):
            if not runner.input_log.owns((record.topic, record.partition)):
                continue  # its partition moved to another member, which will read it
            runner.metrics.events_in += 1
            event = runner.decode_or_dead_letter(record)
            runner.positions[(record.topic, record.partition)] = record.offset + 1
            runner._uncommitted = True
            if event is not None:
                yield event, Origin(record.topic, record.partition, record.offset, record.timestamp_ms, record.key, record.log_id)
        runner._maybe_report()  # periodic metrics (with lag) for sources too: `crl run` reads them to see a drain

    def owns(self, position: Position) -> bool:
        """Whether this worker still owns `position` (a group rebalance may have moved it to another member)."""
        return self._runner.input_log is not None and self._runner.input_log.owns(position)

    def positions(self) -> dict[tuple[str, int], int]:
        """Next offset per input partition polled so far (poison records included: they were dead-lettered)."""
        return dict(self._runner.positions)

    def commit(self) -> None:
        """Flush everything published, then commit the positions of every input polled so far."""
        self._runner.commit()


class _StoppedDuringRetry(PipelineError):
    """A stop was requested while an event waited for its next retry."""


def _headers(event: Event) -> list[tuple[str, bytes]]:
    return [
        ("crl-kind", event.kind.encode()),
        ("crl-schema-version", str(event.schema_version).encode()),
        ("crl-event-id", str(event.event_id).encode()),
        ("crl-producer", event.producer.worker.encode()),
    ]

