"""The worker runner: everything a worker does besides its own logic.

A worker (`Worker`) declares what it `consumes`, what it `produces` and what it `follows`, and implements
`handle(event, origin) -> list[Event]` for every input event; batch-oriented workers (the trainers, the extractor, the
rollout worker, the scheduler) also get `after_poll(io)`, a hook the runner calls after every poll, where they train,
generate or publish what is due. No worker polls Kafka or runs a loop of its own: the runner owns the loop, in this
order for every record:

1. decode -> upcast -> validate (`schemas.codec.decode`); a poison record becomes a `DeadLetter`;
2. `handle` with retries and exponential backoff on `RetryableError`; `PoisonMessageError` or any other exception
   from the handler dead-letters the record (the error class and message say why; the raw bytes are kept);
3. outputs are encoded and sent with the registry's key;
4. at a commit point: `worker.flush()` (durable state), producer flush (every output acknowledged), and only then
   the input offsets are committed (`worker.committable` may hold them back). A crash anywhere before that
   re-delivers the input: at-least-once, so projections must be idempotent (deterministic ids, dedupe by `event_id`).

What a worker follows (the newest policy of a role, the bank replica) it reads through `context.follow`, which the
runtime backs with a follower thread (`pipeline.runtime.log`) and stops when the worker stops.

Stopping: SIGTERM/SIGINT finish the current record, flush, commit and exit; so do `max_events`, `timeout_s` and a
worker that says it is `done`. Metrics (events in/out, dead letters, retries, handler time, time waiting for input,
lag) are logged every `metrics_interval_s` and appended as JSON lines to `RUN_DIR/metrics/<instance>.jsonl` when a
path is given.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import signal
import threading
import time
from abc import ABC
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pipeline.errors import (
    ConfigError,
    GroupMembershipLostError,
    PipelineError,
    PoisonMessageError,
    RetryableError,
    WorkerFailedError,
)
from pipeline.runtime.blobs import BlobStore
from pipeline.runtime.settings import RunnerSettings
from pipeline.runtime.transport import InputLog, OffsetStore, OutputLog, Position, Record
from schemas.base import Event, Producer
from schemas.codec import ClaimChecks, EventDecodeError, decode, encode_for_topic
from schemas.dead_letters import (
    MAX_INLINE_HEADER_BYTES,
    MAX_INLINE_KEY_BYTES,
    MAX_INLINE_RAW_BYTES,
    DeadLetter,
    dead_letter_id,
)
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


class Worker(ABC):
    """One worker kind: its declarations, what it does with each input event, and what it does after each poll."""

    name: ClassVar[str]
    """Worker kind; also the consumer-group id (`crl-<name>`) and the `WORKERS` key."""
    consumes: ClassVar[tuple[Topic, ...]] = ()
    """Input topics the runner polls and hands to `handle`."""
    consumption: ClassVar[Consumption] = "group"
    """`group`: a consumer group spreads the partitions over instances, offsets in Kafka; `assign`: every partition,
    positions kept by the worker (`offset_store`)."""
    produces: ClassVar[tuple[Topic, ...]] = ()
    """Topics its events go to (dead letters aside); `crl run` orders the workers by them."""
    follows: ClassVar[tuple[Topic, ...]] = ()
    """Topics it reads in the background through `context.follow` (the newest policy, the bank replica)."""
    clock: ClassVar[bool] = False
    """The worker that paces a run (the scheduler): `crl run` starts it last and stops it first, and its inputs
    (feedback on what the others did) do not order the others."""
    arms: ClassVar[frozenset[str] | None] = None
    """The arms (`scheduler.arm`) that need this worker; None: every arm."""
    instances: ClassVar[str | None] = None
    """The `launch` setting with its number of processes under `crl run` (None: one)."""

    @classmethod
    def build(cls, context: WorkerContext) -> Worker:
        """Construct the worker from its context (settings, run dir, database, log). Override to read settings."""
        return cls()

    @classmethod
    def enabled(cls, settings: Any) -> bool:
        """Whether `crl run` starts the kind under these settings (beside `arms`); default: always. The tracker
        reads `tracker.enabled`."""
        return True

    def offset_store(self, context: WorkerContext) -> OffsetStore:
        """Where assign-mode positions live; default the run's SQL database. A projection that stores its position
        with its state in one transaction overrides this."""
        return context.sql_offset_store(self.name)

    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        """Process one input event; return the events to publish. Default: remember nothing, publish nothing."""
        return ()

    def start(self, io: WorkerIO) -> None:
        """Called once before the first poll (publish what a previous run wrote but did not publish, ...)."""

    def after_poll(self, io: WorkerIO) -> None:
        """Called after every poll, the polled events handled: the batch hook (train a closed step, generate for a
        full batch, play a turn, issue a step). Publish through `io`."""

    def poll_timeout_ms(self) -> int | None:
        """How long the next poll may wait for input (None: the runner's `poll_timeout_ms`)."""
        return None

    def committable(self, positions: dict[Position, int]) -> dict[Position, int]:
        """The positions that may be committed, given the next offset handled per partition. A worker that works on
        events across several polls (a rollout worker's episodes in flight) holds its positions back to the oldest
        unfinished one, so a restart re-reads exactly what was not finished."""
        return positions

    def flush_due(self, now: float) -> bool:
        """Whether the runner should flush and commit now (`now` is `time.monotonic()`). Default: after every poll."""
        return True

    def flush(self) -> None:
        """Make everything handled so far durable; called before input offsets are committed. Default: nothing kept."""

    @property
    def done(self) -> bool:
        """True once the worker has nothing more to do in this run (the scheduler after `RunFinished`)."""
        return False

    @property
    def busy(self) -> bool:
        """True while it holds work that needs more polls to finish (episodes in flight); the harness waits for it."""
        return False

    def close(self) -> None:
        """Release resources after the final commit."""


@dataclass
class WorkerMetrics:
    events_in: int = 0
    events_out: int = 0
    dead_letters: int = 0
    retries: int = 0
    commits: int = 0
    handler_seconds: float = 0.0
    wait_seconds: float = 0.0
    """Time spent in input polls while the worker was not `busy`: waiting for input, with nothing else to do."""
    lag: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> dict[str, object]:
        data = asdict(self)
        data["handler_ms_mean"] = round(1000 * self.handler_seconds / self.events_in, 3) if self.events_in else 0.0
        return data


@dataclass(frozen=True)
class Limits:
    """Bounds for smoke runs: stop after `max_events` input events, `timeout_s` seconds or `max_polls` polls (None:
    unbounded)."""

    max_events: int | None = None
    timeout_s: float | None = None
    max_polls: int | None = None


class WorkerRunner:
    """Runs one worker against an input and an output log until stopped."""

    def __init__(
        self,
        worker: Worker,
        *,
        input_log: InputLog | None,
        output_log: OutputLog,
        producer: Producer,
        run_id: str,
        settings: RunnerSettings | None = None,
        max_payload_bytes: int,
        blobs: BlobStore | None = None,
        claim_check_bytes: int | None = None,
        metrics_path: Path | None = None,
        limits: Limits = Limits(),
        sleep: Callable[[float], None] | None = None,
        context: WorkerContext | None = None,
        until_idle: bool = False,
    ) -> None:
        self.worker = worker
        self.context = context
        """The worker's context; the runner closes it (and the followers it opened) when the worker stops."""
        self.until_idle = until_idle
        """Stop once the inputs are exhausted and the worker is not `busy` (the harness's end of a test)."""
        self.input_log = input_log
        self.output_log = output_log
        self.producer = producer
        self.run_id = run_id
        self.settings = settings or RunnerSettings()
        self.max_payload_bytes = max_payload_bytes
        self.blobs = blobs
        self.claims = ClaimChecks(blobs, claim_check_bytes) if blobs is not None and claim_check_bytes else None
        """Outputs over `claim_check_bytes` keep their bulky arrays in `blobs` (schemas/codec.py)."""
        self.metrics_path = metrics_path
        self.limits = limits
        self.metrics = WorkerMetrics()
        self.on_progress: Callable[[WorkerMetrics], None] | None = None
        """Called with the metrics at most every 0.5 s (the CLI's live status line)."""
        self._last_progress = 0.0
        self.positions: dict[Position, int] = {}
        self.tenures: dict[Position, int] = {}
        """The tenure (`InputLog.tenure`) each position was handled under."""
        self._uncommitted = False  # records handled since the last commit
        self.stop_reason: str | None = None
        self._stop = threading.Event()
        self._sleep = sleep or self._stop.wait
        self._started = time.monotonic()
        self._last_metrics = self._started
        self.io = WorkerIO(self)
        self.polls = 0

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
            self.worker.start(self.io)
            self._consume()
        finally:
            self._write_metrics(final=True)
            self.worker.close()
            if self.context is not None:
                self.context.close()
            if self.input_log is not None:
                self.input_log.close()
            self.output_log.close()
        log.info("worker %s stopped (%s): %s", self.producer.worker, self.stop_reason or "finished",
                 self.metrics.snapshot())
        return self.metrics

    def _consume(self) -> None:
        while not self._check_limits():
            self.polls += 1
            timeout = self.worker.poll_timeout_ms()
            timeout = self.settings.poll_timeout_ms if timeout is None else timeout
            if self.input_log is not None:
                waiting = not self.worker.busy
                polled = time.monotonic()
                records = self.input_log.poll(timeout)
                if waiting:  # a poll blocks until records arrive or its timeout passes: time waiting for input
                    self.metrics.wait_seconds += time.monotonic() - polled
                for record in records:
                    if self._check_limits():
                        break  # not handled, not committed: the next start reads it again
                    self._process(record)
            elif timeout:
                self._stop.wait(timeout / 1000)
            if self._stop.is_set():
                break
            self.worker.after_poll(self.io)
            if self.worker.flush_due(time.monotonic()) and self._uncommitted:
                self.commit()
            self._maybe_report()
            if self.worker.done:
                self.request_stop("finished")  # its work is done (the scheduler after RunFinished)
            elif self.until_idle and not self.worker.busy and self._inputs_exhausted():
                self.request_stop("inputs exhausted")
        self.commit()

    def _inputs_exhausted(self) -> bool:
        return self.input_log is None or bool(getattr(self.input_log, "exhausted", False))

    # -- per record -----------------------------------------------------------------------------------------------

    def _check_limits(self) -> bool:
        if self.limits.max_events is not None and self.metrics.events_in >= self.limits.max_events:
            self.request_stop(f"max_events={self.limits.max_events} reached")
        elif self.limits.timeout_s is not None and time.monotonic() - self._started >= self.limits.timeout_s:
            self.request_stop(f"timeout={self.limits.timeout_s}s reached")
        elif self.limits.max_polls is not None and self.polls >= self.limits.max_polls:
            self.request_stop(f"max_polls={self.limits.max_polls} reached")
        return self._stop.is_set()

    def decode_or_dead_letter(self, record: Record) -> Event | None:
        """The record's event, or None after publishing a dead letter for it."""
        try:
            return decode(topic_named(record.topic), record.value, self.max_payload_bytes, self.blobs)
        except Exception as exc:  # noqa: BLE001 - EventDecodeError, an unknown topic or anything else: a dead letter
            self.publish_dead_letter(record, exc)
            return None

    def _process(self, record: Record) -> None:
        assert self.input_log is not None
        if not self.input_log.owns((record.topic, record.partition)):
            return  # fetched before its partition moved to another member, which will read it
        self.metrics.events_in += 1
        event = self.decode_or_dead_letter(record)
        if event is not None:
            origin = Origin(record.topic, record.partition, record.offset, record.timestamp_ms, record.key,
                            record.log_id)
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
        self.tenures[(record.topic, record.partition)] = record.tenure
        self._uncommitted = True

    def _handle_with_retries(
        self, event: Event, origin: Origin, record: Record,
    ) -> list[tuple[str, bytes, bytes, list[tuple[str, bytes]]]] | None:
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
        topic, key, value = encode_for_topic(event, self.max_payload_bytes, self.claims)
        return topic.name, key, value, event_headers(event)

    def publish(self, event: Event) -> None:
        topic, key, value, headers = self.encode_output(event)
        self.output_log.send(topic, key, value, headers)
        self.metrics.events_out += 1
        self._uncommitted = True

    def publish_dead_letter(self, record: Record, error: BaseException) -> None:
        letter = self.dead_letter(record, error)
        log.warning("dead letter %s[%d]@%d %s: %s", record.topic, record.partition, record.offset,
                    letter.error_class, letter.error_message)
        topic, key, value, headers = self.encode_output(letter)
        self.output_log.send(topic, key, value, headers)
        self.metrics.dead_letters += 1

    def dead_letter(self, record: Record, error: BaseException) -> DeadLetter:
        raw = record.value or b""
        # Inline only what leaves the dead letter well inside the payload cap (base64 grows 4/3; the envelope, a key
        # of up to 1 KiB, headers of up to 4 KiB and a message of up to 2000 characters, each at most 6 bytes
        # escaped, fit in 24 KiB); larger values, keys and headers go to the blob store.
        inline_limit = min(MAX_INLINE_RAW_BYTES, (self.max_payload_bytes - 24 * 1024) * 3 // 4)
        inline = len(raw) <= inline_limit
        if inline:
            raw_b64, raw_uri, raw_sha256 = base64.b64encode(raw).decode("ascii"), None, None
        else:
            raw_b64 = None
            raw_uri, raw_sha256 = self._claim_check(record, raw, "value")
        key = record.key
        key_b64 = key_uri = key_sha256 = None
        if key is not None and len(key) <= MAX_INLINE_KEY_BYTES:
            key_b64 = base64.b64encode(key).decode("ascii")
        elif key is not None:
            key_uri, key_sha256 = self._claim_check(record, key, "key")
        headers = tuple((name, base64.b64encode(value or b"").decode("ascii")) for name, value in record.headers)
        headers_uri = None
        if sum(len(name) + len(value) for name, value in headers) > MAX_INLINE_HEADER_BYTES:
            headers_uri, _ = self._claim_check(record, json.dumps(headers).encode(), "headers")
            headers = ()
        raw_sha256 = raw_sha256 or hashlib.sha256(raw).hexdigest()
        message = str(error)
        return DeadLetter(
            event_id=dead_letter_id(record.log_id, record.topic, record.partition, record.offset, raw_sha256,
                                    type(error).__name__),
            run_id=self.run_id,
            producer=self.producer,
            source_topic=record.topic,
            source_partition=record.partition,
            source_offset=record.offset,
            source_key_b64=key_b64,
            source_key_uri=key_uri,
            source_key_size=len(key) if key_uri is not None and key is not None else None,
            source_key_sha256=key_sha256,
            source_headers=headers,
            source_headers_uri=headers_uri,
            raw_b64=raw_b64,
            raw_uri=raw_uri,
            raw_size=len(raw),
            raw_sha256=raw_sha256,
            error_class=type(error).__name__,
            error_message=message[:2000] if message else repr(error)[:2000],
        )

    def _claim_check(self, record: Record, data: bytes, what: str) -> tuple[str, str]:
        """(URI, sha256) of `data` written to the blob store, for a dead letter too large to carry it inline."""
        if self.blobs is None:
            raise WorkerFailedError(
                f"the {what} of record {record.topic}[{record.partition}]@{record.offset} ({len(data)} bytes) needs a"
                " claim check but the worker has no blob store"
            )
        return self.blobs.put(data)

    # -- commits --------------------------------------------------------------------------------------------------

    def commit(self) -> None:
        """Durable state, then every output acknowledged, then the input positions. Never the other way round."""
        self._retrying_an_outage("state flush", self.worker.flush)
        self.output_log.flush()
        if self.input_log is not None and self.positions:
            # A partition that moved to another member is not ours to commit: its new owner resumes at the last
            # commit and re-reads what was handled here since (at-least-once). One assigned to us again since its
            # position was handled is not committed either: the worker may have dropped what it held of it while
            # it was not ours, and this member re-reads it from the last commit.
            for position in list(self.positions):
                tenure = self.input_log.tenure(position)
                if tenure != self.tenures.get(position, 0):
                    log.info("not committing %s[%d]: the partition was %s", *position,
                             "revoked" if tenure is None else "revoked and assigned again")
                    del self.positions[position]
            positions = self.worker.committable(dict(self.positions))
            input_log = self.input_log
            try:
                self._retrying_an_outage("offset commit", lambda: input_log.commit(positions))
            except GroupMembershipLostError as exc:
                # The coordinator no longer counts this member in (it missed heartbeats, or a rebalance is on):
                # retrying without a poll cannot succeed, and by the rejoin at the next poll its partitions may be
                # another member's. As after a revoke, nothing handled since the last commit is committed; whoever
                # holds each partition after the rejoin reads it again from there (at-least-once).
                log.warning("%s; nothing of %d partitions committed: the member rejoins at its next poll and what "
                            "it handled since its last commit is read again", exc, len(positions))
                self.positions.clear()
                self._uncommitted = False
                return  # not counted as a commit: nothing was committed
        self.metrics.commits += 1
        self._uncommitted = False

    def _retrying_an_outage(self, what: str, action: Callable[[], None]) -> None:
        """Run `action`, retrying a `RetryableError` with capped exponential backoff for at least `max_retries`
        retries and `outage_s` seconds (a database or a broker restarting), then fail the worker without committing.
        An action that fails writes nothing (the bank's rows and position are one transaction), so retrying is safe.
        The waits are not cut short by a stop request: a stopping worker still wants this commit."""
        attempt, first_failure = 0, None
        while True:
            try:
                action()
                if attempt:
                    log.info("%s succeeded after %d retries (%.1fs)", what, attempt,
                             time.monotonic() - (first_failure or 0.0))
                return
            except RetryableError as exc:
                attempt += 1
                now = time.monotonic()
                first_failure = first_failure if first_failure is not None else now
                if attempt > self.settings.max_retries and now - first_failure >= self.settings.outage_s:
                    raise WorkerFailedError(
                        f"{what} failed {attempt} times over {now - first_failure:.0f}s: {exc}") from exc
                self.metrics.retries += 1
                delay = min(self.settings.retry_backoff_s * 2 ** (attempt - 1), self.settings.retry_backoff_max_s)
                log.warning("%s retry %d in %.2fs: %s", what, attempt, delay, exc)
                time.sleep(delay)

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
            except Exception as exc:  # noqa: BLE001 - metrics must never take a worker down
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


class WorkerIO:
    """What a worker's hooks (`start`, `after_poll`) may do: publish, commit, ask whether a partition is still its
    own, whether it has read its inputs to where they ended when it started, and whether it is stopping."""

    def __init__(self, runner: WorkerRunner) -> None:
        self._runner = runner
        self._start_ends: dict[Position, int] | None = None

    @property
    def stopping(self) -> bool:
        return self._runner._stop.is_set()

    def publish(self, event: Event) -> None:
        self._runner.publish(event)

    def commit(self) -> None:
        """Flush the worker's state and everything published, then commit the positions handled so far."""
        self._runner.commit()

    def owns(self, position: Position) -> bool:
        """Whether this worker still owns `position` (a group rebalance may have moved it to another member)."""
        return self._runner.input_log is not None and self._runner.input_log.owns(position)

    def positions(self) -> dict[Position, int]:
        """Next offset per input partition handled so far (poison records included: they were dead-lettered)."""
        return dict(self._runner.positions)

    def caught_up(self) -> bool:
        """Whether every input is handled up to where its partitions ended at the first call (a worker that
        rebuilds its state from its inputs asks this in `start`, then waits for it in `after_poll`)."""
        if self._start_ends is None:
            context = self._runner.context
            assert context is not None, "caught_up() needs the worker's context (its log)"
            self._start_ends = {(topic.name, partition): end for topic in self._runner.worker.consumes
                                for partition, end in context.log.end_offsets(topic).items()}
        positions = self._runner.positions
        return all(positions.get(position, 0) >= end for position, end in self._start_ends.items())


class _StoppedDuringRetry(PipelineError):
    """A stop was requested while an event waited for its next retry."""


def event_headers(event: Event) -> list[tuple[str, bytes]]:
    """The headers every published event carries (the envelope, readable without decoding the value)."""
    return [
        ("crl-kind", event.kind.encode()),
        ("crl-schema-version", str(event.schema_version).encode()),
        ("crl-event-id", str(event.event_id).encode()),
        ("crl-producer", event.producer.worker.encode()),
    ]

