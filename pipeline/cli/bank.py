"""`crl bank show`: a run's experience bank."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from pipeline.bank.state import undecodable
from pipeline.cli.common import console
from pipeline.cli.listing import Format, FormatOption, bank_store, print_rows, resolve_id, table_console

bank_app = typer.Typer(help="Inspect a run's experience bank.", no_args_is_help=True)


class BankSort(StrEnum):
    id = "id"
    served = "served"
    success = "success"
    recent = "recent"


SORT_KEYS = {
    BankSort.id: lambda row: row["experience_id"],
    BankSort.served: lambda row: (-row["retrievals"], row["experience_id"]),
    BankSort.success: lambda row: (-(row["success"] if row["success"] is not None else -1.0), -row["retrievals"],
                                   row["experience_id"]),
    BankSort.recent: lambda row: (-max(row["op_offsets"], default=-1), row["experience_id"]),
}
"""`--sort`: by id; most served first; highest success rate of the episodes guided first (never served last); the
most recently written (its newest op's offset) first."""

COLUMNS = ("experience", "family", "v", "status", "served", "success", "trained", "text")


@bank_app.command("show")
def bank_show(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    experience_id: Annotated[str | None, typer.Argument(
        help="One experience, by its id or a unique beginning of it: every version and its op.")] = None,
    family: Annotated[str | None, typer.Option(help="Only this task family.")] = None,
    all_statuses: Annotated[bool, typer.Option("--all", help="Include retired experiences.")] = False,
    sort: Annotated[BankSort, typer.Option(
        help="id; served (most served first); success (highest success rate of the episodes it guided first, "
        "never served last); recent (most recently written first).")] = BankSort.id,
    limit: Annotated[int | None, typer.Option(min=1, help="At most this many experiences.")] = None,
    output: FormatOption = Format.table,
) -> None:
    """List the bank's experiences (columns: experience, family, v, status, served, success, trained, text), or show
    one with its whole version history."""
    store = bank_store(run_dir)
    if experience_id is None:
        _list(store, family, all_statuses, sort, limit, output)
        return
    experience_id = resolve_id(experience_id, (row["experience_id"] for row in store.experiences()), "experience")
    row = store.experience(experience_id)
    assert row is not None
    say = table_console()
    say.print(f"[bold]{row['experience_id']}[/bold]  family {row['task_family']}  version {row['version']}  "
              f"{row['status']}" + (f" ({row['retired_reason']}, merged into {row['merged_into']})"
                                    if row["merged_into"] else f" ({row['retired_reason']})"
                                    if row["retired_reason"] else ""))
    if row["parents"]:
        say.print(f"merged from {', '.join(row['parents'])}", markup=False)
    say.print(f"served {row['retrievals']} times, trained {row['trainings']} times")
    table = Table("v", "op", "offset", "generation", "extractor", "sources", "text")
    for version in store.versions(experience_id):
        table.add_row(str(version["version"]), f"{version['op_kind']} {version['op_id']}", str(version["op_offset"]),
                      version["generation_id"], str(version["extractor_version"]),
                      ", ".join(version["source_trajectory_ids"]), version["text"])
    say.print(table, markup=False)


def _list(store: Any, family: str | None, all_statuses: bool, sort: BankSort, limit: int | None,
          output: Format) -> None:
    rows = store.experiences(status=None if all_statuses else "active", task_family=family)
    wins = store.successes()
    for row in rows:
        served = row["retrievals"]
        row["success"] = wins.get(row["experience_id"], 0) / served if served else None
    rows.sort(key=SORT_KEYS[sort])
    shown = rows[:limit] if limit is not None else rows
    position = store.position("crl.experience-ops", 0)
    footer = f"{len(shown)} of {len(rows)} experiences" if len(shown) < len(rows) else f"{len(rows)} experiences"
    if position is not None:
        footer += f"; bank at offset {position.next_offset}, state_hash {position.state_hash}"
    print_rows(COLUMNS, ([row["experience_id"], row["task_family"], row["version"], row["status"], row["retrievals"],
                          None if row["success"] is None else round(row["success"], 3), row["trainings"],
                          row["text"]] for row in shown), output, footer=footer, cut={"text": 90})
    if output is Format.table and not shown:
        console.print("the bank holds no experience" + (f" of family {family}" if family else ""), highlight=False)
    garbled = [row["experience_id"] for row in shown if undecodable(row["text"])]
    if output is Format.table and garbled:
        console.print(f"{len(garbled)} of these hold undecodable text (U+FFFD or UTF-8 read as Latin-1), shown as "
                      f"written: {', '.join(garbled[:3])}" + (" ..." if len(garbled) > 3 else ""),
                      markup=False, highlight=False, soft_wrap=True)
