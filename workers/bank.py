"""Bank: the experience bank as a projection of `crl.experience-ops`, persisted to SQL, with periodic snapshots.

    crl worker bank --run-dir runs/demo

It reads the op topic (one partition) in assign mode. Each op goes through the pure state machine
(`pipeline.bank.state`); at every commit point the changed experiences, their new versions and the position (next
offset, log id, state hash, counts) are written to SQL in one transaction (`pipeline.bank.store`). Every
`CRL_BANK__SNAPSHOT_EVERY` ops it writes a snapshot (state + index + manifest, atomically) and publishes
`BankSnapshotWritten`.

Restart: the state comes from the newest snapshot of the current log and the worker re-reads the ops after it;
re-applying them to SQL is idempotent, so a kill at any point ends with the same hash as a clean rebuild
(`crl replay bank`). A bank built from another log (a restarted embedded broker) is refused, not mixed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from pipeline.bank.snapshots import newest_snapshot, read_snapshot, snapshots_root, write_snapshot
from pipeline.bank.state import Applied, BankState, Rejected
from pipeline.bank.store import BankPosition, BankStore
from pipeline.errors import ConfigError
from pipeline.launch import WorkerContext
from pipeline.offsets import LogPosition
from pipeline.runner import Origin, Processor
from pipeline.transport import OffsetStore, Position
from schemas.bank import BankSnapshotWritten
from schemas.base import Event, Producer
from schemas.topics import EXPERIENCE_OPS_TOPIC

log = logging.getLogger(__name__)


class _PositionInState:
    """The bank's input position is its state's `next_offset`: it is written with the state (SQL, snapshots), so
    the runner's separate offset commit has nothing left to do."""

    def __init__(self, bank: BankProjection) -> None:
        self.bank = bank

    def load(self) -> dict[Position, LogPosition]:
        if self.bank.log_id is None:
            return {}
        return {(EXPERIENCE_OPS_TOPIC.name, 0): LogPosition(self.bank.state.next_offset, self.bank.log_id)}

    def save(self, positions: Mapping[Position, LogPosition]) -> None:
        """Nothing to do: `BankProjection.flush()` stored the position in the same transaction as the state."""


class BankProjection(Processor):
    name = "bank"
    inputs = (EXPERIENCE_OPS_TOPIC,)
    consumption = "assign"

    def __init__(self, store: BankStore, context: WorkerContext) -> None:
        self.store = store
        self.snapshots = snapshots_root(context.run_dir)
        self.snapshot_every = context.settings.bank.snapshot_every
        self.exact_threshold = context.settings.bank.exact_threshold
        self.run_id = context.settings.resolved_run_id
        self.producer = Producer(worker=self.name, instance=context.instance)
        self.state = BankState()
        self.log_id: str | None = None
        self.changed: set[str] = set()
        self.since_snapshot = 0
        position = store.position(EXPERIENCE_OPS_TOPIC.name, 0)
        if position is not None:
            self.log_id = position.log_id
            newest = newest_snapshot(self.snapshots, log_id=position.log_id)
            if newest is not None:
                self.state, manifest = read_snapshot(newest)
                log.info("bank resumes from snapshot %s (next offset %d); SQL is at %d", newest.name,
                         manifest.next_offset, position.next_offset)
            else:
                log.info("bank rebuilds from offset 0 of log %s; SQL is at %d", position.log_id, position.next_offset)

    @classmethod
    def build(cls, context: WorkerContext) -> BankProjection:
        return cls(BankStore(context.engine), context)

    def offset_store(self, context: WorkerContext) -> OffsetStore:
        return _PositionInState(self)

    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        if self.log_id is None:
            self.log_id = origin.log_id
        elif origin.log_id != self.log_id:
            raise ConfigError(
                f"this run's bank was built from log {self.log_id} of {origin.topic}, but the broker now serves log "
                f"{origin.log_id} (a restarted embedded broker or a re-created topic). Use a new run directory; "
                "`crl replay bank` rebuilds a bank from an archive."
            )
        outcome = self.state.apply(event, origin.offset)  # type: ignore[arg-type]
        if isinstance(outcome, Rejected):
            log.info("op %s at offset %d rejected: %s", outcome.op_id, origin.offset, outcome.reason)
        elif isinstance(outcome, Applied):
            self.changed.update(outcome.touched)
        self.since_snapshot += 1
        if self.since_snapshot < self.snapshot_every:
            return ()
        self.since_snapshot = 0
        path, manifest = write_snapshot(self.snapshots, self.state, self.log_id, self.exact_threshold)
        return [BankSnapshotWritten(
            run_id=self.run_id, producer=self.producer, next_offset=manifest.next_offset,
            state_hash=manifest.state_hash, uri=path.resolve().as_uri(),
            active_experiences=manifest.active_experiences, ops_applied=manifest.ops_applied,
        )]

    def flush(self) -> None:
        if self.log_id is None:
            return
        stored = self.store.position(EXPERIENCE_OPS_TOPIC.name, 0)
        if stored is not None and stored.log_id == self.log_id and stored.next_offset > self.state.next_offset:
            # Catching up after a restart from an older snapshot: SQL is already ahead; re-writing these rows would
            # be idempotent, but moving the recorded position backwards would not be true.
            self.changed.clear()
            return
        self.store.save(self.state, self.changed, BankPosition(
            topic=EXPERIENCE_OPS_TOPIC.name, partition=0, next_offset=self.state.next_offset, log_id=self.log_id,
            state_hash=self.state.state_hash(), applied=self.state.applied, duplicates=self.state.duplicates,
            rejected=self.state.rejected,
        ))
        self.changed.clear()
