"""Rebuild the bank from the op log and check it against what the live bank recorded.

    crl replay bank runs/demo                 # ops from the Parquet archive
    crl replay bank runs/demo --from-kafka    # ops from crl.experience-ops, offset 0 to the end

The replay applies every op to a fresh `BankState`, in log order, and takes the state hash at the offsets where the
live bank recorded one: the SQL position (`bank_position`) and the newest snapshot. Equal hashes at equal offsets
are the bank's reproducibility contract; any mismatch is reported and makes the command exit 1.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kafka import TopicPartition

from infra.kafka import KafkaSettings, make_consumer
from pipeline.audit import Audit
from pipeline.bank.state import BankState, ExperienceOp
from schemas.codec import decode
from schemas.topics import EXPERIENCE_OPS_TOPIC


@dataclass(frozen=True)
class Checkpoint:
    """A hash the live bank recorded at `next_offset` (all ops before it applied)."""

    name: str
    next_offset: int
    state_hash: str


@dataclass
class ReplayResult:
    state: BankState
    ops: int = 0
    hashes: dict[str, str | None] = field(default_factory=dict)
    """Checkpoint name -> the replay's hash at that offset (None: the log ended before it)."""

    def mismatches(self, checkpoints: Iterable[Checkpoint]) -> list[str]:
        problems = []
        for checkpoint in checkpoints:
            replayed = self.hashes.get(checkpoint.name)
            if replayed is None:
                problems.append(f"{checkpoint.name}: the log ended before offset {checkpoint.next_offset}")
            elif replayed != checkpoint.state_hash:
                problems.append(f"{checkpoint.name} at offset {checkpoint.next_offset}: recorded "
                                f"{checkpoint.state_hash}, replay {replayed}")
        return problems


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a bulk replay, then back as it was.

    Decoding and applying an op log allocates millions of container objects while the bank state grows; the
    collector's repeated passes over that growing state were half the replay's time (an 8,000-op log: decode ~55
    -> ~28 us per op). Ops and bank state hold no reference cycles, so reference counting frees what the replay drops.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def replay(ops: Iterable[tuple[int, ExperienceOp]], checkpoints: Iterable[Checkpoint] = ()) -> ReplayResult:
    """Apply `(offset, op)` pairs in order, taking the hash wherever a checkpoint's offset is reached.

    Runs with the garbage collector paused (`collector_paused`); `ops` may decode lazily inside it."""
    with collector_paused():
        return _replay(ops, checkpoints)


def _replay(ops: Iterable[tuple[int, ExperienceOp]], checkpoints: Iterable[Checkpoint]) -> ReplayResult:
    pending = sorted(checkpoints, key=lambda c: c.next_offset)
    result = ReplayResult(BankState())
    result.hashes = {checkpoint.name: None for checkpoint in pending}

    def take_due() -> None:
        while pending and pending[0].next_offset <= result.state.next_offset:
            checkpoint = pending.pop(0)
            if checkpoint.next_offset == result.state.next_offset:
                result.hashes[checkpoint.name] = result.state.state_hash()

    take_due()
    for offset, op in ops:
        while pending and pending[0].next_offset <= offset:
            # The checkpoint lies between two archived ops (a gap): the state now is the state at that offset.
            checkpoint = pending.pop(0)
            result.hashes[checkpoint.name] = result.state.state_hash()
        result.state.apply(op, offset)
        result.ops += 1
        take_due()
    return result


def archived_logs(run_dir: Path) -> list[tuple[str, int, str]]:
    """(log id, records, last record time) of every op log in the archive, most recent first."""
    with Audit(run_dir) as audit:
        _, rows = audit.query(
            "SELECT log_id, count(*), max(record_timestamp)::VARCHAR FROM events "
            f"WHERE topic = '{EXPERIENCE_OPS_TOPIC.name}' GROUP BY log_id ORDER BY max(record_timestamp) DESC"
        )
    return [(row[0], row[1], row[2]) for row in rows]


def ops_from_archive(run_dir: Path, log_id: str) -> Iterator[tuple[int, ExperienceOp]]:
    """Every archived record of the op log `log_id`, once per offset, in offset order.

    Not the `events` view: it keeps one row per event id, but the bank consumed records, and the same event can sit
    at two offsets (a producer retry); the bank counted the second one as a duplicate, so the replay must see it.
    """
    with Audit(run_dir) as audit:
        if not (audit.root / EXPERIENCE_OPS_TOPIC.name).is_dir():
            return
        pattern = str(audit.root / EXPERIENCE_OPS_TOPIC.name / "*.parquet").replace("'", "''")
        _, rows = audit.query(
            f"SELECT \"offset\", any_value(payload) FROM read_parquet('{pattern}') "
            f"WHERE log_id = '{log_id.replace(chr(39), '')}' GROUP BY \"offset\" ORDER BY \"offset\""
        )
    for offset, payload in rows:
        yield offset, decode(EXPERIENCE_OPS_TOPIC, payload.encode())  # type: ignore[misc]


def ops_from_kafka(kafka: KafkaSettings, idle_timeout_s: float = 5.0) -> Iterator[tuple[int, ExperienceOp]]:
    """Every op from offset 0 up to the high watermark seen when reading starts (caught up via `highwater()`)."""
    consumer = make_consumer(kafka, client_id="crl-replay")
    partition = TopicPartition(EXPERIENCE_OPS_TOPIC.name, 0)
    try:
        consumer.assign([partition])
        consumer.seek_to_beginning(partition)
        target: int | None = None
        last_progress = time.monotonic()
        position = 0
        while True:
            batches = consumer.poll(timeout_ms=200)
            for record in batches.get(partition, []):
                position = record.offset + 1
                last_progress = time.monotonic()
                yield record.offset, decode(EXPERIENCE_OPS_TOPIC, record.value)  # type: ignore[misc]
            if target is None:
                target = consumer.highwater(partition)
            if target is not None and position >= target:
                return
            if time.monotonic() - last_progress > idle_timeout_s:
                raise TimeoutError(f"no op records for {idle_timeout_s}s at offset {position} (high watermark {target})")
    finally:
        consumer.close(autocommit=False)
