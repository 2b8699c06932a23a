"""`crl bank show`: a run's experience bank."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from pipeline.cli.common import (
    bank_store,
    console,
    fail,
)

bank_app = typer.Typer(help="Inspect a run's experience bank.", no_args_is_help=True)


@bank_app.command("show")
def bank_show(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    experience_id: Annotated[str | None, typer.Argument(help="One experience: every version and its op.")] = None,
    family: Annotated[str | None, typer.Option(help="Only this task family.")] = None,
    all_statuses: Annotated[bool, typer.Option("--all", help="Include retired experiences.")] = False,
) -> None:
    """List the bank's experiences, or show one with its whole version history."""
    store = bank_store(run_dir)
    if experience_id is None:
        rows = store.experiences(status=None if all_statuses else "active", task_family=family)
        table = Table("experience", "family", "v", "status", "served", "trained", "text")
        for row in rows:
            table.add_row(row["experience_id"], row["task_family"], str(row["version"]), row["status"],
                          str(row["retrievals"]), str(row["trainings"]), row["text"][:90])
        console.print(table)
        position = store.position("crl.experience-ops", 0)
        if position is not None:
            console.print(f"{len(rows)} experiences; bank at offset {position.next_offset}, "
                          f"state_hash {position.state_hash}")
        return
    row = store.experience(experience_id)
    if row is None:
        raise fail(f"no experience {experience_id} in {run_dir}", 1)
    console.print(f"[bold]{row['experience_id']}[/bold]  family {row['task_family']}  version {row['version']}  "
                  f"{row['status']}" + (f" ({row['retired_reason']}, merged into {row['merged_into']})"
                                        if row["merged_into"] else f" ({row['retired_reason']})"
                                        if row["retired_reason"] else ""))
    if row["parents"]:
        console.print(f"merged from {', '.join(row['parents'])}")
    console.print(f"served {row['retrievals']} times, trained {row['trainings']} times")
    table = Table("v", "op", "offset", "generation", "extractor", "sources", "text")
    for version in store.versions(experience_id):
        table.add_row(str(version["version"]), f"{version['op_kind']} {version['op_id']}", str(version["op_offset"]),
                      version["generation_id"], str(version["extractor_version"]),
                      ", ".join(version["source_trajectory_ids"]), version["text"])
    console.print(table)
