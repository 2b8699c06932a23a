"""`crl audit sql | events | experience`: read-only DuckDB over a run's archive."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from typer.core import TyperCommand

from pipeline.cli.common import console, fail
from pipeline.cli.listing import Format, FormatOption, print_rows, resolve_id, run_directory

audit_app = typer.Typer(help="Read-only DuckDB over a run's Parquet archive.", no_args_is_help=True)


def _open_audit(run_dir: Path) -> Any:
    from pipeline.audit.views import Audit

    return Audit(run_directory(run_dir))


class _ListsViews(TyperCommand):
    """`crl audit sql --help`: after the usual help, every view and its columns (read from an empty archive)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:  # typer's own click types
        super().format_help(ctx, formatter)
        from pipeline.audit.views import view_columns

        lines = ["", "Views and their columns:"]
        for name, columns in view_columns().items():
            lines.append(f"  {name}: {', '.join(column for column, _ in columns)}")
        typer.echo("\n".join(lines))


KEYWORD_COLUMN = re.compile(r'(?<![".\w])offset(?![".\w])\s*(,|\bFROM\b|\bAS\b|=|<|>|\)|$)', re.IGNORECASE)
"""`offset` used as a column without quotes: an SQL keyword, which DuckDB reads as the start of an OFFSET clause."""


def _short_error(sql: str, message: str) -> str:
    """DuckDB's message in one line, with what a person most often needs next."""
    first = message.strip().splitlines()[0] if message.strip() else "the query failed"
    if KEYWORD_COLUMN.search(sql):
        return f'{first} (`offset` is an SQL keyword: quote the column, "offset")'
    if "does not exist" in first or "not found" in first:
        return f"{first} (SHOW TABLES lists the views; `crl audit sql --help` lists their columns)"
    return first


@audit_app.command("sql", cls=_ListsViews)
def audit_sql(
    run_dir: Annotated[Path, typer.Argument(help="Run directory with an archive/ folder.")],
    sql: Annotated[str, typer.Argument(help="One SELECT over the views (listed below with their columns).")],
    output: FormatOption = Format.table,
) -> None:
    """Run one read-only SQL statement over the run's archive: SELECT, EXPLAIN, SHOW TABLES or DESCRIBE VIEW."""
    from pipeline.errors import AuditQueryError

    with _open_audit(run_dir) as audit:
        try:
            columns, rows = audit.query(sql)
        except AuditQueryError as exc:
            raise fail(_short_error(sql, str(exc))) from exc
    print_rows(columns, rows, output, footer=f"{len(rows)} rows")


@audit_app.command("events")
def audit_events(
    run_dir: Annotated[Path, typer.Argument(help="Run directory with an archive/ folder.")],
    kind: Annotated[str | None, typer.Option(help="Only this event kind, e.g. TrajectoryCompleted.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many rows.")] = 20,
    output: FormatOption = Format.table,
) -> None:
    """Print archived events in time order (envelope, coordinates, start of the payload)."""
    with _open_audit(run_dir) as audit:
        columns, rows = audit.recent_events(kind, limit)
    print_rows(columns, rows, output, footer=f"{len(rows)} rows")


@audit_app.command("experience", help=(
    "The whole history of one experience, from the archive alone (no bank database needed): every version's text "
    "with the op that wrote it (kind, op id, offset, generation, extractor version, source trajectories), the merges "
    "into and out of it, its retirement, how often it was served and how the episodes it guided went. The op log is "
    "replayed with the bank's own rules, so rejected and repeated ops do not show."
))
def audit_experience(
    run_dir: Annotated[Path, typer.Argument(help="Run directory with an archive/ folder.")],
    experience_id: Annotated[str, typer.Argument(
        help="Experience id as `crl bank show` prints it: whole, or a unique beginning of it.")],
    episodes: Annotated[int, typer.Option(help="List at most this many of the episodes it guided (the latest).")]
    = 20,
) -> None:
    """The whole history of one experience, from the archive alone (no bank database needed)."""
    from rich.markup import escape

    with _open_audit(run_dir) as audit:
        log_id = audit.op_log_id
        if log_id is None:
            raise fail(f"no experience {experience_id}: the archive of {run_dir} holds no experience ops")
        _, known = audit.query("SELECT experience_id FROM experiences")
        experience_id = resolve_id(experience_id, (row[0] for row in known), "experience")
        record = audit.experience_record(experience_id)
    assert record is not None

    def say(text: str) -> None:
        # Experience texts are free text: no markup, no wrapping inside them.
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    state = record.state
    status = state["status"]
    if record.merged_into is not None:
        into = record.merged_into
        status += (f": merged into {into['merged_id']} at version {into['source_version']} by {into['op_id']}"
                   f" at offset {into['op_offset']}")
    elif state["retired_reason"] is not None:
        status += f": {state['retired_reason']}, by {state['retired_op_id']} at offset {state['retired_offset']}"
    say(f"{experience_id}  family {state['task_family']}  version {state['version']}  {status}")
    if record.merged_from:
        sources = ", ".join(f"{row['source_id']} v{row['source_version']}" for row in record.merged_from)
        say(f"merged from {sources} by {record.merged_from[0]['op_id']} at offset {record.merged_from[0]['op_offset']}")
    say(f"op log {log_id} (replayed from the archive)")

    console.print("\n[bold]versions[/bold]")
    for version in record.versions:
        sources = json.loads(version["source_trajectory_ids"])
        say(f"v{version['version']}  {version['op_kind']} {version['op_id']} at offset {version['op_offset']}  "
            f"generation {version['generation_id']} (extractor {version['extractor_version']})  "
            f"sources {', '.join(sources) if sources else '-'}  {version['occurred_at']:%Y-%m-%d %H:%M:%S}")
        say(f"    {version['text']}")

    console.print("\n[bold]episodes guided[/bold]")
    if not record.episodes:
        say("never served")
        return
    served = len(record.episodes)
    say(f"served {state['retrievals']} times: {record.successes} succeeded, {served - record.successes} failed "
        f"(success rate {record.success_rate:.1%}), mean reward {record.mean_reward:.3f}")
    for version in record.versions:
        guided = [row for row in record.episodes if row["version"] == version["version"]]
        if guided:
            wins = sum(1 for row in guided if row["success"])
            say(f"  v{version['version']} served {len(guided)} times, success rate {wins / len(guided):.1%}")
    shown = record.episodes[-episodes:] if episodes > 0 else []
    table = Table("trajectory", "step", "version", "success", "reward",
                  title=f"latest {len(shown)} of {served} episodes" if len(shown) < served else None)
    for row in shown:
        table.add_row(escape(row["trajectory_id"]), str(row["step"]), str(row["version"]),
                      "yes" if row["success"] else "no", f"{row['reward']:g}")
    console.print(table)


@audit_app.command("fingerprint", help=(
    "Per step, hashes of what a run played (token ids, actions, rewards; sampling log-probs apart), the bank its "
    "guided episodes were served from and the weights after every train step, from the archive. With a second run "
    "directory: which of those differ between the two runs (exit 1 if any). Two runs of one config and seed in "
    "deterministic mode (`scheduler.deterministic`) agree on every line."
))
def audit_fingerprint(
    run_dir: Annotated[Path, typer.Argument(help="Run directory with an archive/ folder.")],
    other: Annotated[Path | None, typer.Argument(help="A second run directory to compare with.")] = None,
) -> None:
    from pipeline.audit.fingerprint import run_fingerprint

    for path in (run_dir, other):
        if path is not None:
            run_directory(path)
    mine = run_fingerprint(run_dir)
    if other is None:
        for name, digest in mine.parts().items():
            print(f"{name} {digest}")
        return
    theirs = run_fingerprint(other)
    differing = set(mine.differences(theirs))
    mine_parts, theirs_parts = mine.parts(), theirs.parts()
    for name in sorted(mine_parts.keys() | theirs_parts.keys(), key=lambda n: [int(p) if p.isdigit() else p
                                                                               for p in n.split("/")]):
        print(f"{'DIFFERS' if name in differing else 'same   '} {name}")
    print(f"{len(mine_parts.keys() | theirs_parts.keys()) - len(differing)} parts agree, {len(differing)} differ")
    if differing:
        raise typer.Exit(1)
