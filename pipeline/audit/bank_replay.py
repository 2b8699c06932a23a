"""Rebuild the bank from the op log and check it against what the live bank recorded.

    crl replay bank runs/demo                 # ops from the Parquet archive
    crl replay bank runs/demo --from-kafka    # ops from crl.experience-ops, offset 0 to the end

The replay (`pipeline.bank.replay`) applies every op to a fresh `BankState`, in log order, and takes the state hash at
the offsets where the live bank recorded one: the SQL position (`bank_position`) and the newest snapshot. Equal hashes
at equal offsets are the bank's reproducibility contract; `BankReplayReport.check()` raises `HashMismatchError` on any
mismatch (the command then exits 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from infra.kafka import KafkaSettings
from pipeline.audit.views import Audit
from pipeline.bank.replay import Checkpoint, ReplayResult, replay
from pipeline.bank.snapshots import restore_newest, snapshots_root
from pipeline.bank.state import BankOp, read_op
from pipeline.bank.store import BankStore
from pipeline.errors import ConfigError, HashMismatchError
from pipeline.runtime.log import KafkaLog
from schemas.codec import EventDecodeError
from schemas.topics import EXPERIENCE_OPS_TOPIC


def archived_run_id(run_dir: Path) -> str | None:
    """The run `run_dir`'s archive records (its first `RunStarted`), whose ops a replayed bank applies."""
    with Audit(run_dir) as audit:
        return audit.run_id


def archived_logs(run_dir: Path) -> list[tuple[str, int, str]]:
    """(log id, records, last record time) of every op log in the archive, most recent first."""
    with Audit(run_dir) as audit:
        _, rows = audit.query(
            "SELECT log_id, count(*), max(record_timestamp)::VARCHAR FROM events "
            f"WHERE topic = '{EXPERIENCE_OPS_TOPIC.name}' GROUP BY log_id ORDER BY max(record_timestamp) DESC"
        )
    return [(row[0], row[1], row[2]) for row in rows]


def ops_from_archive(run_dir: Path, log_id: str) -> Iterator[tuple[int, BankOp]]:
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
        yield offset, read_op(payload.encode())


def ops_from_kafka(kafka: KafkaSettings, idle_timeout_s: float = 5.0) -> Iterator[tuple[int, BankOp]]:
    """Every op from offset 0 up to the end the op log had when reading started. A record that does not decode is
    passed over, as the bank worker did (it dead-lettered it; the archive holds the dead letter, not an op)."""
    for record in KafkaLog(kafka, client_id="crl-replay").iterate_to_end(EXPERIENCE_OPS_TOPIC, idle_timeout_s):
        try:
            op = read_op(record.value)
        except EventDecodeError:
            continue
        yield record.offset, op


@dataclass
class BankReplayReport:
    """What `replay_bank` did: where the ops came from, the replay, and every recorded hash it was compared with."""

    source: str
    result: ReplayResult
    checkpoints: list[Checkpoint] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Raise `HashMismatchError` naming every mismatch, one per line (nothing when every hash matches)."""
        if self.problems:
            raise HashMismatchError("\n".join(self.problems))


def replay_bank(run_dir: Path, store: BankStore, kafka: KafkaSettings | None = None,
                log_id: str | None = None) -> BankReplayReport:
    """Replay the op log of `run_dir` (from the archive, or from `kafka` when given) and compare it with the live SQL
    bank in `store` and the newest snapshot."""
    live = store.position(EXPERIENCE_OPS_TOPIC.name, 0)
    chosen: str | None
    if kafka is not None:
        chosen = KafkaLog(kafka, client_id="crl-replay").log_id(EXPERIENCE_OPS_TOPIC)
        ops = ops_from_kafka(kafka)
        source = f"crl.experience-ops on Kafka (log {chosen})"
    else:
        logs = archived_logs(run_dir)
        chosen = log_id or (live.log_id if live else None) or (logs[0][0] if logs else None)
        if chosen is None:
            raise ConfigError(f"the archive of {run_dir} holds no experience ops")
        ops = ops_from_archive(run_dir, chosen)
        source = f"the archive (log {chosen})"
    checkpoints: list[Checkpoint] = []
    problems: list[str] = []
    notes: list[str] = []
    if live is not None and live.log_id == chosen:
        checkpoints.append(Checkpoint("live SQL bank", live.next_offset, live.state_hash))
        try:
            store.load_state()  # the stored rows themselves must hash to the recorded position
        except HashMismatchError as exc:
            problems.append(f"live SQL rows: {exc}")
    elif live is not None:
        notes.append(f"the live bank follows log {live.log_id}, not {chosen}: no comparison with it")
    restored = restore_newest(snapshots_root(run_dir), chosen)  # verified: file sha256s and the state hash
    if restored is not None:
        snapshot, snapshot_state = restored
        checkpoints.append(Checkpoint(f"snapshot {snapshot.name}", snapshot_state.next_offset,
                                      snapshot_state.state_hash()))
    result = replay(ops, checkpoints, run_id=archived_run_id(run_dir))
    return BankReplayReport(source, result, checkpoints, problems + result.mismatches(checkpoints), notes)
