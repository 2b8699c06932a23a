"""`crl replay bank | train`: rebuild projections from the log and compare them with the live ones."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from pipeline.cli.common import (
    bank_store,
    console,
    current_settings,
    errors,
    fail,
    kafka_of,
)

replay_app = typer.Typer(help="Rebuild projections from the log and compare them with the live ones.",
                         no_args_is_help=True)


@replay_app.command("bank")
def replay_bank(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (archive, SQL bank, snapshots).")],
    from_kafka: Annotated[bool, typer.Option("--from-kafka", help="Read the op log from Kafka, not the archive.")]
    = False,
    log_id: Annotated[str | None, typer.Option(help="Which archived op log (default: the live bank's).")] = None,
) -> None:
    """Rebuild the bank from offset 0 and compare its hash with the live SQL position and the newest snapshot."""
    from pipeline.audit.bank_replay import archived_logs, ops_from_archive, ops_from_kafka
    from pipeline.bank.replay import Checkpoint, replay
    from pipeline.bank.snapshots import restore_newest, snapshots_root
    from schemas.topics import EXPERIENCE_OPS_TOPIC

    store = bank_store(run_dir)
    live = store.position(EXPERIENCE_OPS_TOPIC.name, 0)
    if from_kafka:
        from infra.admin import topic_ids
        from infra.kafka import make_admin

        kafka = kafka_of(current_settings(run_dir))
        admin = make_admin(kafka)
        try:
            chosen = topic_ids(admin, [EXPERIENCE_OPS_TOPIC.name])[EXPERIENCE_OPS_TOPIC.name]
        finally:
            admin.close()
        ops = ops_from_kafka(kafka)
        source = f"crl.experience-ops on Kafka (log {chosen})"
    else:
        logs = archived_logs(run_dir)
        chosen = log_id or (live.log_id if live else None) or (logs[0][0] if logs else None)
        if chosen is None:
            raise fail(f"the archive of {run_dir} holds no experience ops", 1)
        ops = ops_from_archive(run_dir, chosen)
        source = f"the archive (log {chosen})"
    problems: list[str] = []
    checkpoints = []
    if live is not None and live.log_id == chosen:
        checkpoints.append(Checkpoint("live SQL bank", live.next_offset, live.state_hash))
        try:
            store.load_state()  # the stored rows themselves must hash to the recorded position
        except ValueError as exc:
            problems.append(f"live SQL rows: {exc}")
    elif live is not None:
        console.print(f"the live bank follows log {live.log_id}, not {chosen}: no comparison with it")
    restored = restore_newest(snapshots_root(run_dir), chosen)  # verified: file sha256s and the state hash
    if restored is not None:
        snapshot, snapshot_state = restored
        checkpoints.append(Checkpoint(f"snapshot {snapshot.name}", snapshot_state.next_offset,
                                      snapshot_state.state_hash()))
    result = replay(ops, checkpoints)
    state = result.state
    console.print(f"replayed {source}")
    console.print(f"ops {result.ops} applied {state.applied} duplicates {state.duplicates} "
                  f"rejected {state.rejected} state_hash {state.state_hash()}")
    table = Table("compared with", "offset", "recorded", "replay", "match")
    for checkpoint in checkpoints:
        replayed = result.hashes.get(checkpoint.name)
        table.add_row(checkpoint.name, str(checkpoint.next_offset), checkpoint.state_hash[:16],
                      (replayed or "log ended before")[:16],
                      "[green]yes[/green]" if replayed == checkpoint.state_hash else "[red]NO[/red]")
    if checkpoints:
        console.print(table)
    problems += result.mismatches(checkpoints)
    for problem in problems:
        errors.print(f"[red]mismatch:[/red] {problem}")
    if problems:
        raise typer.Exit(1)


class TrainRole(str, Enum):
    actor = "actor"
    extractor = "extractor"


@replay_app.command("train")
def replay_train(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (archive and checkpoints).")],
    role: Annotated[TrainRole | None, typer.Option(help="Only this role (default: both).")] = None,
) -> None:
    """Re-run every recorded training step from the archive and the initial checkpoint; compare weight hashes."""
    from pipeline.audit.training_replay import StepCheck, replay_training

    if not run_dir.is_dir():
        raise fail(f"no run directory at {run_dir}", 2)
    failed = False
    for chosen in [role.value] if role is not None else ["actor", "extractor"]:
        table = Table("role", "step", "version", "recorded", "replay", "match")

        def row(check: StepCheck, chosen: str = chosen) -> None:
            table.add_row(chosen, str(check.step), str(check.version), check.recorded[:16], check.replayed[:16],
                          "[green]yes[/green]" if check.ok else "[red]NO[/red]")

        with console.status(f"replaying {chosen} steps"):
            report = replay_training(run_dir, chosen, on_step=row)  # type: ignore[arg-type]
        if report.checks:
            console.print(table)
        if report.ok:
            console.print(f"{chosen}: {len(report.checks)} steps replayed, every weight hash matches")
        elif not report.checks and report.problem and report.problem.startswith("no PolicyPublished") and role is None:
            console.print(f"{chosen}: nothing recorded ({report.problem})")
        else:
            errors.print(f"[red]mismatch:[/red] {chosen}: {report.problem}")
            failed = True
            break
    if failed:
        raise typer.Exit(1)
