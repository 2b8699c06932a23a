"""`crl replay bank | train`: rebuild projections from the log and compare them with the live ones."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from pipeline.cli.common import (
    console,
    current_settings,
    fail,
    kafka_of,
)
from pipeline.cli.listing import bank_store, run_directory
from pipeline.errors import ConfigError, HashMismatchError
from pipeline.rl.settings import DEFAULT_REPLAY_RANKS

replay_app = typer.Typer(help="Rebuild projections from the log and compare them with the live ones.",
                         no_args_is_help=True)


@replay_app.command("bank")
def bank_command(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (archive, SQL bank, snapshots).")],
    from_kafka: Annotated[bool, typer.Option("--from-kafka", help="Read the op log from Kafka, not the archive.")]
    = False,
    log_id: Annotated[str | None, typer.Option(help="Which archived op log (default: the live bank's).")] = None,
) -> None:
    """Rebuild the bank from offset 0 and compare its hash with the live SQL position and the newest snapshot."""
    from pipeline.audit.bank_replay import replay_bank

    store = bank_store(run_dir, log_from_kafka=from_kafka)
    kafka = kafka_of(current_settings(run_dir)) if from_kafka else None
    report = replay_bank(run_dir, store, kafka, log_id)
    for note in report.notes:
        console.print(note)
    state = report.result.state
    console.print(f"replayed {report.source}")
    console.print(f"ops {report.result.ops} applied {state.applied} duplicates {state.duplicates} "
                  f"rejected {state.rejected} state_hash {state.state_hash()}")
    table = Table("compared with", "offset", "recorded", "replay", "match")
    for checkpoint in report.checkpoints:
        replayed = report.result.hashes.get(checkpoint.name)
        table.add_row(checkpoint.name, str(checkpoint.next_offset), checkpoint.state_hash[:16],
                      (replayed or "log ended before")[:16],
                      "[green]yes[/green]" if replayed == checkpoint.state_hash else "[red]NO[/red]")
    if report.checkpoints:
        console.print(table)
    report.check()


class TrainRole(StrEnum):
    actor = "actor"
    extractor = "extractor"


@replay_app.command("train")
def train_command(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (archive and checkpoints).")],
    role: Annotated[TrainRole | None, typer.Option(help="Only this role (default: both).")] = None,
    max_ranks: Annotated[int, typer.Option(
        min=1, help="Most local gloo ranks to start for a step taken data-parallel; a step recorded with more is "
        "reported as not replayable here (exit 2), not as a mismatch.")] = DEFAULT_REPLAY_RANKS,
) -> None:
    """Re-run every recorded training step from the archive and the initial checkpoint; compare weight hashes. A step
    taken by N data-parallel ranks is replayed on N local gloo ranks."""
    from pipeline.audit.training_replay import StepCheck, replay_training

    run_directory(run_dir)
    compared = 0
    for chosen in [role.value] if role is not None else ["actor", "extractor"]:
        table = Table("role", "step", "version", "ranks", "recorded", "replay", "match")

        def row(check: StepCheck, chosen: str = chosen, table: Table = table) -> None:
            table.add_row(chosen, str(check.step), str(check.version), str(check.world_size), check.recorded[:16],
                          check.replayed[:16], "[green]yes[/green]" if check.ok else "[red]NO[/red]")

        with console.status(f"replaying {chosen} steps"):
            report = replay_training(run_dir, chosen, on_step=row, max_ranks=max_ranks)  # type: ignore[arg-type]
        compared += len(report.checks)
        if report.checks:
            console.print(table)
        sizes = " and ".join(str(size) for size in report.world_sizes)
        if report.ok:
            console.print(f"{chosen}: {len(report.checks)} steps replayed, every weight hash matches (world size "
                          f"{sizes or 1})")
        elif not report.checks and report.problem and report.problem.startswith("no PolicyPublished") and role is None:
            console.print(f"{chosen}: nothing recorded ({report.problem})")
        elif report.unavailable is not None:
            raise ConfigError(f"{chosen}: cannot replay here after {len(report.checks)} matching steps: "
                              f"{report.unavailable}")
        else:
            raise HashMismatchError(f"{chosen}: {report.problem}")
    if not compared:
        raise fail(f"compared nothing: the archive of {run_dir} records no training step"
                   + (f" of the {role.value}" if role is not None else ""), 1)
