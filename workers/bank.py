"""Bank: the experience bank as a projection of `crl.experience-ops`, persisted to SQL, with periodic snapshots.

    crl worker bank --run-dir runs/demo

It reads the op topic (one partition) in assign mode, and `crl.trajectories` for the experiences each guided episode
was served (`experience_served`, one row per trajectory and experience, so re-deliveries count once; the
`retrievals` counter is recounted from it), and `crl.extractions` + `crl.train-steps` for the extractor steps that
trained on the generations behind each experience (`trainings`, `last_trained_step`). Each op goes through the pure
state machine
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

from infra.db import transient_database_errors
from pipeline.actor.settings import ARMS_WITH_A_BANK
from pipeline.bank.snapshots import restore_newest, snapshots_root, write_snapshot
from pipeline.bank.state import Applied, BankState, ExperienceOp, Rejected
from pipeline.bank.store import BankPosition, BankStore, TrainingUsage
from pipeline.errors import ConfigError
from pipeline.runtime.context import WorkerContext
from pipeline.runtime.offsets import LogPosition, SqlOffsetStore
from pipeline.runtime.runner import Origin, Worker
from pipeline.runtime.transport import OffsetStore, Position
from schemas.bank import BankSnapshotWritten
from schemas.base import Event, Producer
from schemas.extractions import ExtractionGenerated
from schemas.runs import StepSettled
from schemas.topics import BANK_SNAPSHOTS, EXPERIENCE_OPS_TOPIC, EXTRACTIONS, TRAIN_STEPS, TRAJECTORIES
from schemas.training import TrainStepCompleted, WarmStartProgressed
from schemas.trajectories import TrajectoryCompleted

log = logging.getLogger(__name__)


class _BankPositions:
    """Where the bank's input positions live. The op log's is the state's `next_offset`, written with the state
    (SQL, snapshots), so the runner's commit has nothing to add for it; the trajectory topic's are kept in the SQL
    offset store and committed after `flush()` made their served rows durable."""

    def __init__(self, bank: BankProjection, others: SqlOffsetStore) -> None:
        self.bank = bank
        self.others = others

    def load(self) -> dict[Position, LogPosition]:
        positions = {position: stored for position, stored in self.others.load().items()
                     if position[0] != EXPERIENCE_OPS_TOPIC.name}
        if self.bank.log_id is not None:
            positions[(EXPERIENCE_OPS_TOPIC.name, 0)] = LogPosition(self.bank.state.next_offset, self.bank.log_id)
        return positions

    def save(self, positions: Mapping[Position, LogPosition]) -> None:
        others = {position: stored for position, stored in positions.items()
                  if position[0] != EXPERIENCE_OPS_TOPIC.name}
        if others:
            self.others.save(others)


class BankProjection(Worker):
    name = "bank"
    consumes = (EXPERIENCE_OPS_TOPIC, TRAJECTORIES, EXTRACTIONS, TRAIN_STEPS)
    consumption = "assign"
    produces = (BANK_SNAPSHOTS,)
    arms = ARMS_WITH_A_BANK

    def __init__(self, store: BankStore, context: WorkerContext) -> None:
        self.store = store
        self.snapshots = snapshots_root(context.run_dir)
        self.snapshot_every = context.settings.bank.snapshot_every
        self.exact_threshold = context.settings.bank.exact_threshold
        self.hnsw = context.settings.bank.hnsw_options()
        self.run_id = context.settings.resolved_run_id
        self.producer = Producer(worker=self.name, instance=context.instance)
        self.state = BankState(self.run_id)
        self.log_id: str | None = None
        self.changed: set[str] = set()
        self.served: list[dict[str, object]] = []
        self.usage = TrainingUsage()
        self.since_snapshot = 0
        position = store.position(EXPERIENCE_OPS_TOPIC.name, 0)
        if position is not None:
            self.log_id = position.log_id
            # Never from a snapshot ahead of SQL: it is written in `handle`, before that batch's SQL save, so a crash
            # between the two would leave the ops in between unwritten to SQL if the worker resumed past them.
            restored = restore_newest(self.snapshots, position.log_id, at_most=position.next_offset,
                                      run_id=self.run_id)
            if restored is not None:
                path, self.state = restored
                log.info("bank resumes from snapshot %s; SQL is at %d", path.name, position.next_offset)
            else:
                log.info("bank rebuilds from offset 0 of log %s; SQL is at %d", position.log_id, position.next_offset)

    @classmethod
    def build(cls, context: WorkerContext) -> BankProjection:
        return cls(BankStore(context.engine), context)

    def offset_store(self, context: WorkerContext) -> OffsetStore:
        return _BankPositions(self, context.sql_offset_store(self.name))

    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        if isinstance(event, TrajectoryCompleted | ExtractionGenerated | TrainStepCompleted) \
                and event.run_id != self.run_id:
            return ()  # another run's counters are not this bank's (its ops are rejected by the state machine)
        if isinstance(event, TrajectoryCompleted):
            self.served += [
                {"trajectory_id": event.trajectory_id, "experience_id": ref.experience_id, "version": ref.version,
                 "generation_id": ref.generation_id, "bank_offset": event.bank_offset, "step": event.step,
                 "success": event.success, "reward": event.reward}
                for ref in event.retrieved
            ]
            return ()
        if isinstance(event, ExtractionGenerated):
            self.usage.extractions[str(event.event_id)] = event.generation_id
            return ()
        if isinstance(event, TrainStepCompleted):
            if event.role == "extractor":
                self.usage.batches += [(event.step, event_id) for event_id in event.batch_event_ids]
            return ()
        if isinstance(event, WarmStartProgressed | StepSettled):
            return ()  # a trainer warming up, a step settled in deterministic mode: nothing of the bank's
        assert isinstance(event, ExperienceOp)  # the op log is the one consumed topic left
        if self.log_id is None:
            self.log_id = origin.log_id
        elif origin.log_id != self.log_id:
            raise ConfigError(
                f"this run's bank was built from log {self.log_id} of {origin.topic}, but the broker now serves log "
                f"{origin.log_id} (a restarted embedded broker or a re-created topic). Use a new run directory; "
                "`crl replay bank` rebuilds a bank from an archive."
            )
        outcome = self.state.apply(event, origin.offset)
        if isinstance(outcome, Rejected):
            log.info("op %s at offset %d rejected: %s", outcome.op_id, origin.offset, outcome.reason)
        elif isinstance(outcome, Applied):
            self.changed.update(outcome.touched)
        self.since_snapshot += 1
        if self.since_snapshot < self.snapshot_every:
            return ()
        self.since_snapshot = 0
        path, manifest = write_snapshot(self.snapshots, self.state, self.log_id, self.exact_threshold,
                                        self.hnsw)
        return [BankSnapshotWritten(
            run_id=self.run_id, producer=self.producer, next_offset=manifest.next_offset,
            state_hash=manifest.state_hash, uri=path.resolve().as_uri(),
            active_experiences=manifest.active_experiences, ops_applied=manifest.ops_applied,
        )]

    def flush(self) -> None:
        """Write what changed since the last flush — rows, versions, usage and the position — in one transaction. A
        database that is down raises `RetryableError` having written nothing, and the runner retries this flush."""
        with transient_database_errors("bank flush"):
            self._flush()

    def _flush(self) -> None:
        stored = self.store.position(EXPERIENCE_OPS_TOPIC.name, 0)
        catching_up = (stored is not None and stored.log_id == self.log_id
                       and stored.next_offset > self.state.next_offset)
        if self.log_id is None or catching_up:
            # No op yet, or catching up after a restart from an older snapshot: SQL is already ahead; re-writing
            # those rows would be idempotent, but moving the recorded position backwards would not be true.
            self.changed.clear()
            self.store.record_usage(self.served, self.usage)
            self.served, self.usage = [], TrainingUsage()
            return
        self.store.save(self.state, self.changed, BankPosition(
            topic=EXPERIENCE_OPS_TOPIC.name, partition=0, next_offset=self.state.next_offset, log_id=self.log_id,
            state_hash=self.state.state_hash(), applied=self.state.applied, duplicates=self.state.duplicates,
            rejected=self.state.rejected,
        ), served=self.served, usage=self.usage)
        self.changed.clear()
        self.served, self.usage = [], TrainingUsage()
