"""The worker runner through the broker-free harness: dead letters, retries, commit ordering, limits, sources."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Sequence
from typing import ClassVar

import pytest

from pipeline.errors import GroupMembershipLostError, PoisonMessageError, RetryableError, WorkerFailedError
from pipeline.runtime.blobs import BlobStore
from pipeline.runtime.harness import Journal, MemoryOutput, RawRecord, run_worker
from pipeline.runtime.runner import Origin, Worker, WorkerIO
from pipeline.runtime.settings import RunnerSettings
from schemas.base import Event, Producer
from schemas.codec import encode
from schemas.examples import example_events
from schemas.runs import RunFinished, StopRequested
from schemas.tasks import EpisodeAssigned
from schemas.topics import CONTROL, RUNS, TASKS, TRAJECTORIES
from schemas.trajectories import TrajectoryCompleted

PRODUCER = Producer(worker="test", instance="test-0")


def _examples() -> dict[str, Event]:
    return {event.kind: event for event in example_events("unit-run")}


class EchoStop(Worker):
    """For every StopRequested, publish a RunFinished with the same reason (a stand-in for real logic)."""

    name = "echo"
    consumes = (CONTROL, TRAJECTORIES, RUNS)

    def __init__(self) -> None:
        self.seen: list[str] = []

    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        self.seen.append(f"{event.kind}@{origin.topic}[{origin.partition}]{origin.offset}")
        if isinstance(event, StopRequested):
            return [RunFinished(run_id=event.run_id, producer=PRODUCER, status="stopped", steps_completed=0,
                                reason=event.reason)]
        return []


def _trajectory_payload(**changes: object) -> bytes:
    payload = json.loads(encode(_examples()["TrajectoryCompleted"]))
    payload.update(changes)
    return json.dumps(payload).encode()


def test_valid_events_are_handled_and_outputs_published_with_positions_committed():
    stop = _examples()["StopRequested"]
    result = run_worker(EchoStop(), [stop, stop])
    assert [event.kind for event in result.outputs] == ["RunFinished", "RunFinished"]
    assert all(event.reason == "operator pressed Ctrl-C" for event in result.outputs)
    assert result.dead_letters == []
    assert result.committed == {("crl.control", 0): 2}


@pytest.mark.parametrize(
    ("value", "error_class", "message_part"),
    [
        (b"\x00garbage", "MalformedPayloadError", "not a JSON document"),
        (b"[1, 2]", "MalformedPayloadError", "expected a JSON object"),
        (encode(_examples()["RunStarted"]), "WrongTopicError", "belongs on crl.runs"),
        (_trajectory_payload(kind="NoSuchEvent"), "WrongTopicError", "'NoSuchEvent'"),
        (json.dumps({k: v for k, v in json.loads(encode(_examples()["TrajectoryCompleted"])).items()
                     if k != "reward"}).encode(), "InvalidEventError", "reward: Field required"),
        (_trajectory_payload(reward=float("nan")), "InvalidEventError", "reward"),
        (_trajectory_payload(reward=float("inf")), "InvalidEventError", "reward"),
        (_trajectory_payload(group_id=""), "InvalidEventError", "group_id"),
        (_trajectory_payload(schema_version=7), "SchemaVersionError", "newer than this code"),
        (b"{" + b" " * (1 << 20) + b"}", "PayloadTooLargeError", "over the 1048576-byte payload cap"),
    ],
    ids=["garbage", "json-array", "wrong-topic", "unknown-kind", "missing-field", "nan-reward", "inf-reward",
         "empty-id", "future-version", "oversize"],
)
def test_poison_records_become_dead_letters_and_the_worker_keeps_going(value, error_class, message_part, tmp_path):
    stop = _examples()["StopRequested"]
    poison = RawRecord(TRAJECTORIES.name, value, key=b"k1", partition=3)
    blobs = BlobStore(tmp_path / "blobs")
    result = run_worker(EchoStop(), [stop, poison, stop], blobs=blobs)
    assert [event.kind for event in result.outputs] == ["RunFinished", "RunFinished"]
    assert len(result.dead_letters) == 1
    letter = result.dead_letters[0]
    assert letter.error_class == error_class
    assert message_part in letter.error_message
    assert (letter.source_topic, letter.source_partition, letter.source_offset) == (TRAJECTORIES.name, 3, 0)
    kept = base64.b64decode(letter.raw_b64) if letter.raw_b64 is not None else blobs.get(letter.raw_uri)
    assert kept == value
    assert letter.raw_size == len(value)
    assert letter.raw_sha256 == hashlib.sha256(value).hexdigest()
    assert base64.b64decode(letter.source_key_b64) == b"k1"
    assert letter.producer.worker == "echo"
    # The poison record's offset is committed too: it is recorded, not lost, and not re-read forever.
    assert result.committed[(TRAJECTORIES.name, 3)] == 1
    assert result.runner.metrics.dead_letters == 1


def test_large_poison_record_is_kept_by_claim_check(tmp_path):
    value = b"x" * (300 * 1024)
    result = run_worker(EchoStop(), [RawRecord(TRAJECTORIES.name, value)], blobs=BlobStore(tmp_path / "blobs"))
    letter = result.dead_letters[0]
    assert letter.raw_b64 is None
    assert letter.raw_size == len(value)
    assert BlobStore(tmp_path / "blobs").get(letter.raw_uri) == value
    assert letter.raw_sha256 == hashlib.sha256(value).hexdigest()


class Flaky(Worker):
    """Fails with the given error `failures` times per event, then publishes a RunFinished."""

    name = "flaky"
    consumes = (CONTROL,)

    def __init__(self, failures: int, error: type[Exception]) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error(f"attempt {self.calls} failed")
        return [RunFinished(run_id=event.run_id, producer=PRODUCER, status="completed", steps_completed=1)]


def test_retryable_errors_are_retried_with_backoff_then_succeed():
    sleeps: list[float] = []
    processor = Flaky(failures=3, error=RetryableError)
    settings = RunnerSettings(max_retries=5, retry_backoff_s=0.1, retry_backoff_max_s=0.3)
    from pipeline.runtime.harness import MemoryInput, to_records
    from pipeline.runtime.runner import Limits, WorkerRunner

    journal = Journal()
    runner = WorkerRunner(
        processor,
        input_log=MemoryInput(to_records([_examples()["StopRequested"]]), journal),
        output_log=MemoryOutput(journal),
        producer=PRODUCER,
        run_id="unit-run",
        settings=settings,
        max_payload_bytes=1 << 20,
        limits=Limits(max_events=1),
        sleep=sleeps.append,
    )
    runner.run()
    assert processor.calls == 4
    assert sleeps == [0.1, 0.2, 0.3]  # doubling, capped at retry_backoff_max_s
    assert runner.metrics.retries == 3
    assert runner.metrics.events_out == 1
    assert runner.metrics.dead_letters == 0


def test_retries_exhausted_fail_the_worker_without_committing():
    processor = Flaky(failures=100, error=RetryableError)
    with pytest.raises(WorkerFailedError, match="still failing after 2 retries"):
        run_worker(processor, [_examples()["StopRequested"]],
                      settings=RunnerSettings(max_retries=2, retry_backoff_s=0.001))
    assert processor.calls == 3


@pytest.mark.parametrize(("error", "expected_class"), [(PoisonMessageError, "PoisonMessageError"),
                                                       (KeyError, "KeyError")])
def test_handler_errors_dead_letter_the_input(error, expected_class):
    result = run_worker(Flaky(failures=1, error=error), [_examples()["StopRequested"]] * 2)
    assert [letter.error_class for letter in result.dead_letters] == [expected_class]
    assert "attempt 1 failed" in result.dead_letters[0].error_message
    assert len(result.outputs) == 1  # the second, identical event succeeded
    assert result.committed == {("crl.control", 0): 2}


class Buffering(Worker):
    """Buffers events and writes them at flush(), recording the moment in the shared journal."""

    name = "buffering"
    consumes = (TASKS,)

    def __init__(self, journal: Journal, every: int) -> None:
        self.journal = journal
        self.every = every
        self.buffer: list[str] = []
        self.durable: list[str] = []

    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        self.buffer.append(str(event.event_id))
        return [StopRequested(run_id=event.run_id, producer=PRODUCER, reason=f"after {origin.offset}")]

    def flush_due(self, now: float) -> bool:
        return len(self.buffer) >= self.every

    def flush(self) -> None:
        self.journal.entries.append(("state-flush", len(self.buffer)))
        self.durable += self.buffer
        self.buffer = []


def test_state_and_outputs_are_flushed_before_input_offsets_are_committed():
    journal = Journal()
    processor = Buffering(journal, every=3)
    tasks = [_examples()["EpisodeAssigned"]] * 7
    result = run_worker(processor, tasks, output=MemoryOutput(journal), batch_size=2)
    assert len(result.outputs) == 7
    kinds = journal.kinds()
    commits = [i for i, kind in enumerate(kinds) if kind == "commit"]
    assert commits, "the runner committed nothing"
    for index in commits:
        before = kinds[:index]
        last_send = max(i for i, kind in enumerate(before) if kind == "send")
        assert "flush" in before[last_send:], f"commit at {index} before the outputs were flushed: {kinds}"
        assert before[index - 2] == "state-flush" and before[index - 1] == "flush"
    # Every committed position is covered by durable state.
    assert len(processor.durable) == 7
    assert result.committed == {("crl.tasks", 0): 7}


def test_failed_output_flush_commits_nothing():
    journal = Journal()
    output = MemoryOutput(journal)
    output.fail_next_flush = WorkerFailedError("broker said no")
    with pytest.raises(WorkerFailedError, match="broker said no"):
        run_worker(EchoStop(), [_examples()["StopRequested"]], output=output)
    assert "commit" not in journal.kinds()


def test_max_events_stops_and_commits_only_what_was_handled():
    from pipeline.runtime.harness import MemoryInput, to_records
    from pipeline.runtime.runner import Limits, WorkerRunner

    journal = Journal()
    processor = EchoStop()
    runner = WorkerRunner(
        processor,
        input_log=MemoryInput(to_records([_examples()["StopRequested"]] * 5), journal, batch_size=5),
        output_log=MemoryOutput(journal),
        producer=PRODUCER,
        run_id="unit-run",
        max_payload_bytes=1 << 20,
        limits=Limits(max_events=3),
    )
    runner.run()
    assert runner.stop_reason == "max_events=3 reached"
    assert len(processor.seen) == 3
    assert journal.entries[-3] == ("commit", {("crl.control", 0): 3})


def test_stop_request_finishes_the_current_event_then_commits_it():
    from pipeline.runtime.harness import MemoryInput, to_records
    from pipeline.runtime.runner import WorkerRunner

    class StopAfterFirst(EchoStop):
        def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
            outputs = super().handle(event, origin)
            runner.request_stop("SIGTERM")
            return outputs

    journal = Journal()
    output = MemoryOutput(journal)
    runner = WorkerRunner(
        StopAfterFirst(),
        input_log=MemoryInput(to_records([_examples()["StopRequested"]] * 4), journal, batch_size=4),
        output_log=output,
        producer=PRODUCER,
        run_id="unit-run",
        max_payload_bytes=1 << 20,
    )
    runner.run()
    assert len(output.delivered) == 1
    assert ("commit", {("crl.control", 0): 1}) in journal.entries


class Announcer(Worker):
    """Publishes three assignments when it starts, then answers each StopRequested after the poll it came in."""

    name = "unit-announcer"
    consumes = (CONTROL,)

    def __init__(self) -> None:
        self.stops: list[tuple[Event, Origin]] = []

    def start(self, io: WorkerIO) -> None:
        template = _examples()["EpisodeAssigned"]
        for slot in range(3):
            io.publish(template.model_copy(update={"slot": slot}))

    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        self.stops.append((event, origin))
        return []

    def after_poll(self, io: WorkerIO) -> None:
        for event, origin in self.stops:
            io.publish(RunFinished(run_id=event.run_id, producer=PRODUCER, status="stopped", steps_completed=0,
                                   reason=f"control offset {origin.offset}"))
        self.stops.clear()


def test_start_and_after_poll_publish_through_the_runner():
    result = run_worker(Announcer(), [_examples()["StopRequested"], RawRecord(CONTROL.name, b"junk")])
    assert [event.kind for event in result.outputs] == ["EpisodeAssigned"] * 3 + ["RunFinished"]
    assert [event.slot for event in result.outputs[:3]] == [0, 1, 2]
    assert isinstance(result.outputs[0], EpisodeAssigned)
    assert result.outputs[3].reason == "control offset 0"
    assert [letter.error_class for letter in result.dead_letters] == ["MalformedPayloadError"]
    assert result.committed == {("crl.control", 0): 2}


def test_outputs_carry_registry_keys_and_headers():
    journal = Journal()
    output = MemoryOutput(journal)
    run_worker(EchoStop(), [_examples()["StopRequested"]], output=output)
    topic, key, _value, headers = output.delivered[0]
    assert topic == "crl.runs"
    assert key == b"unit-run"
    assert dict(headers)["crl-kind"] == b"RunFinished"
    assert dict(headers)["crl-schema-version"] == b"1"


def test_trajectory_examples_survive_the_runner_unchanged():
    trajectory = _examples()["TrajectoryCompleted"]

    class Capture(Worker):
        name = "capture"
        consumes = (TRAJECTORIES,)
        got: ClassVar[list[TrajectoryCompleted]] = []

        def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
            self.got.append(event)
            return []

    capture = Capture()
    run_worker(capture, [trajectory])
    assert capture.got == [trajectory]


def _runner_over(processor: Worker, events: list, journal: Journal, **options) -> tuple:
    from pipeline.runtime.harness import MemoryInput, to_records
    from pipeline.runtime.runner import Limits, WorkerRunner

    input_log = MemoryInput(to_records(events), journal, batch_size=len(events))
    output = MemoryOutput(journal)
    runner = WorkerRunner(processor, input_log=input_log, output_log=output, producer=PRODUCER, run_id="unit-run",
                          max_payload_bytes=1 << 20, limits=Limits(max_events=len(events)), **options)
    return runner, input_log, output


def test_a_stop_during_a_retry_backoff_commits_what_came_before_and_exits_cleanly():
    class FailsOnSecond(EchoStop):
        def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
            if origin.offset == 1:
                raise RetryableError("database locked")
            return super().handle(event, origin)

    journal = Journal()
    stop = _examples()["StopRequested"]
    runner, input_log, output = _runner_over(
        FailsOnSecond(), [stop, stop, stop], journal,
        settings=RunnerSettings(max_retries=5, retry_backoff_s=0.01),
        sleep=lambda _delay: runner.request_stop("SIGTERM"),
    )
    runner.run()  # no WorkerFailedError: a stop is not a failure
    assert len(output.delivered) == 1  # the first event's output, flushed
    assert input_log.committed == {("crl.control", 0): 1}  # the second event stays uncommitted, read again later
    assert output.pending == []


def test_records_of_a_revoked_partition_are_neither_handled_nor_committed():
    class RevokesOnFirst(EchoStop):
        def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
            input_log.revoked.add(("crl.control", 0))  # a rebalance moved the partition during this event
            return super().handle(event, origin)

    journal = Journal()
    stop = _examples()["StopRequested"]
    processor = RevokesOnFirst()
    runner, input_log, _output = _runner_over(processor, [stop, stop, stop, _examples()["RunStarted"]], journal)
    runner.limits = type(runner.limits)(max_events=2)
    runner.run()
    assert len(processor.seen) == 2  # the first control record and the crl.runs record; the rest were skipped
    assert processor.seen[1].startswith("RunStarted@crl.runs")
    assert input_log.committed == {("crl.runs", 0): 1}  # never the revoked partition


def test_a_partition_assigned_again_is_not_committed_past_what_was_read_under_its_earlier_tenure():
    """A rebalance revokes crl.control[0] and gives it back to this member while its first record is handled: a
    worker may have dropped what it held of it meanwhile (the rollout worker drops queued episodes of a partition it
    no longer owns), so nothing read under the earlier tenure is committed; the member re-reads from the last
    commit. Committing the stale position is how a revoke and reassign lost episodes."""
    class ReassignsOnFirst(EchoStop):
        def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
            if origin.offset == 0 and origin.topic == "crl.control":
                input_log.revoked.add(("crl.control", 0))
                input_log.assign_again(("crl.control", 0))
            return super().handle(event, origin)

    journal = Journal()
    stop = _examples()["StopRequested"]
    processor = ReassignsOnFirst()
    runner, input_log, _output = _runner_over(processor, [stop, stop, _examples()["RunStarted"]], journal)
    runner.run()
    assert len(processor.seen) == 3  # the partition was ours throughout each record's handling
    assert input_log.committed == {("crl.runs", 0): 1}
    assert any(entry[0] == "commit" for entry in journal.entries)


def test_a_failed_offset_commit_is_retried():
    journal = Journal()
    runner, input_log, _output = _runner_over(EchoStop(), [_examples()["StopRequested"]], journal,
                                              settings=RunnerSettings(retry_backoff_s=0.001))
    commit = input_log.commit
    failures = [RetryableError("coordinator moved")]

    def flaky_commit(positions):
        if failures:
            raise failures.pop()
        commit(positions)

    input_log.commit = flaky_commit
    runner.run()
    assert input_log.committed == {("crl.control", 0): 1}
    assert runner.metrics.retries == 1


def test_a_commit_refused_for_a_lost_group_membership_is_dropped_not_retried(caplog):
    """The coordinator no longer counts the member in (kafka-python's CommitFailedError after a heartbeat answered
    UNKNOWN_MEMBER_ID): retrying cannot succeed before a poll rejoins, so the runner commits nothing of what it holds
    and goes on; retrying it for the outage time (5 minutes) without polling is how a resumed rollout worker stalled."""
    journal = Journal()
    runner, input_log, _output = _runner_over(EchoStop(), [_examples()["StopRequested"]], journal,
                                              settings=RunnerSettings(retry_backoff_s=0.001))
    attempts: list[dict] = []

    def refused(positions):
        attempts.append(dict(positions))
        raise GroupMembershipLostError("offset commit refused: CommitFailedError")

    input_log.commit = refused
    with caplog.at_level(logging.WARNING, logger="pipeline.runtime.runner"):
        runner.run()  # no WorkerFailedError: the member rejoins at its next poll
    assert attempts == [{("crl.control", 0): 1}]  # tried once, never again
    assert input_log.committed == {} and runner.positions == {}
    assert runner.metrics.retries == 0
    assert "nothing of 1 partitions committed" in caplog.text


def test_a_state_flush_that_fails_for_a_while_is_retried_then_commits():
    # The bank's database restarting: its flush raises RetryableError (having written nothing) until it is back.
    class FlakyFlush(EchoStop):
        failures = 3

        def flush(self) -> None:
            if self.failures:
                self.failures -= 1
                raise RetryableError("bank flush: the database is unavailable")

    journal = Journal()
    runner, input_log, output = _runner_over(FlakyFlush(), [_examples()["StopRequested"]], journal,
                                             settings=RunnerSettings(max_retries=1, retry_backoff_s=0.001,
                                                                     outage_s=30.0))
    runner.run()  # more failures than max_retries, inside outage_s: retried, not failed
    assert input_log.committed == {("crl.control", 0): 1} and len(output.delivered) == 1
    assert runner.metrics.retries == 3


def test_a_state_flush_failing_past_the_outage_time_fails_the_worker_without_committing():
    class NeverFlushes(EchoStop):
        def flush(self) -> None:
            raise RetryableError("bank flush: the database is unavailable")

    journal = Journal()
    runner, input_log, output = _runner_over(NeverFlushes(), [_examples()["StopRequested"]], journal,
                                             settings=RunnerSettings(max_retries=2, retry_backoff_s=0.001,
                                                                     outage_s=0.05))
    with pytest.raises(WorkerFailedError, match=r"state flush failed \d+ times over"):
        runner.run()
    assert input_log.committed == {} and output.delivered == []
    assert runner.metrics.retries >= 2


def test_wait_seconds_count_the_polls_of_an_idle_worker_and_not_those_of_a_busy_one():
    import time

    from pipeline.runtime.harness import MemoryInput
    from pipeline.runtime.runner import Limits, WorkerRunner

    class SlowEmptyInput(MemoryInput):
        def poll(self, timeout_ms: int) -> list:
            time.sleep(0.02)  # as a broker poll blocks until its timeout when nothing arrives
            return []

    class Busy(EchoStop):
        @property
        def busy(self) -> bool:
            return True

    waited = {}
    for worker in (EchoStop(), Busy()):
        journal = Journal()
        runner = WorkerRunner(worker, input_log=SlowEmptyInput([], journal), output_log=MemoryOutput(journal),
                              producer=PRODUCER, run_id="unit-run", max_payload_bytes=1 << 20,
                              limits=Limits(max_polls=5))
        runner.run()
        waited[type(worker).__name__] = runner.metrics.wait_seconds
    assert waited["EchoStop"] >= 5 * 0.02
    assert waited["Busy"] == 0.0
