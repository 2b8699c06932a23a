"""How listing commands print rows, and how commands that read a run check their path and find ids.

- `print_rows` prints one table three ways (`--format table|csv|json`). A table on a terminal fits it; a table
  written to a pipe or a file is as wide as its widest row, so nothing in it is cut.
- `run_directory` is the check every command that reads a run makes first: a path without `archive/` is refused
  with one line and exit 2, and nothing is created.
- `resolve_id` takes an id as the tools print it: whole, a unique beginning of it, or cut with an ellipsis.
- `bank_store` opens the bank of a run, never creating one.
"""

from __future__ import annotations

import csv
import difflib
import json
import sys
from collections.abc import Iterable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from pipeline.cli.common import console, current_settings, fail


class Format(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


FormatOption = Annotated[Format, typer.Option(
    "--format", help="table (as wide as its rows when piped: nothing is cut), csv (with a header row) or json (one "
    "object per line).")]

PIPED_WIDTH = 100_000
"""The width tables are laid out in when the output is not a terminal: wider than any row, so none is cut."""


def table_console() -> Console:
    """The console a table is printed on: the terminal's, or, piped, one as wide as the widest row."""
    if console.is_terminal:
        return console
    return Console(width=PIPED_WIDTH, soft_wrap=True, color_system=None, highlight=False)


def print_rows(columns: Sequence[str], rows: Iterable[Sequence[Any]], output: Format, footer: str | None = None,
               cut: dict[str, int] | None = None) -> None:
    """`rows` under `columns` as a table, CSV or JSON lines. `footer` (a count, a position) follows a table only:
    CSV and JSON hold the rows and nothing else. `cut` shortens the named columns of a table to so many characters
    (long free text); CSV and JSON always hold whole values."""
    rows = list(rows)
    if output is Format.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(["" if value is None else value for value in row] for row in rows)
        return
    if output is Format.json:
        for row in rows:
            sys.stdout.write(json.dumps(dict(zip(columns, row, strict=True)), default=str, ensure_ascii=False) + "\n")
        return
    limits = cut or {}
    table = Table(*columns)
    for row in rows:
        cells = []
        for column, value in zip(columns, row, strict=True):
            text = "" if value is None else str(value)
            limit = limits.get(column)
            if limit is not None and len(text) > limit:
                text = text[:limit - 1] + "…"
            cells.append(text)
        table.add_row(*cells)
    out = table_console()
    out.print(table, markup=False)
    if footer is not None:
        out.print(footer, markup=False, highlight=False)


def run_directory(path: Path) -> Path:
    """`path`, if it is a run directory (it holds `archive/`); else exit 2 with one line. Nothing is created."""
    if not path.exists():
        raise fail(f"no run directory at {path}", 2)
    if not path.is_dir():
        raise fail(f"{path} is a file, not a run directory", 2)
    if not (path / "archive").is_dir():
        raise fail(f"{path} is not a run directory: it has no archive/ folder", 2)
    return path


ELLIPSES = ("…", "...")


def resolve_id(given: str, known: Iterable[str], what: str) -> str:
    """The one id of `known` that `given` names: the id itself, a unique beginning of it, or a beginning cut with an
    ellipsis as a narrow table prints it. None or several: exit 1 with one line (the closest ids, or those that
    begin so)."""
    ids = sorted(set(known))
    if given in ids:
        return given
    stem = given
    for ellipsis in ELLIPSES:
        stem = stem.removesuffix(ellipsis)
    matches = [known_id for known_id in ids if known_id.startswith(stem)] if stem else []
    if len(matches) == 1:
        return matches[0]
    if matches:
        shown = ", ".join(matches[:4]) + (f" and {len(matches) - 4} more" if len(matches) > 4 else "")
        raise fail(f"{len(matches)} {what}s begin with {stem}: {shown}; give more of the id", 1)
    close = difflib.get_close_matches(given, ids, n=3, cutoff=0.6)
    raise fail(f"no {what} {given}" + (f"; did you mean {' or '.join(close)}?" if close else ""), 1)


def bank_store(run_dir: Path, log_from_kafka: bool = False) -> Any:
    """The bank of the run at `run_dir`, which must exist: a command that reads a bank never creates one. The run
    directory must hold `archive/`, but where the op log is read from Kafka (`log_from_kafka`) a directory with the
    bank's database is enough. (An existing database of an older schema is migrated, as every worker does on start.)"""
    from infra.db import SQLITE_FILE_NAME, database_url, make_engine, migrate
    from pipeline.bank.store import BankStore

    settings = current_settings(run_dir).db
    database = run_dir / SQLITE_FILE_NAME
    if not (log_from_kafka and run_dir.is_dir() and (settings.url is not None or database.is_file())):
        run_directory(run_dir)
    if settings.url is None and not database.is_file():
        raise fail(f"{run_dir} has no bank database ({SQLITE_FILE_NAME}): it ran against another database (set "
                   "CRL_DB__URL) or never started its bank", 2)
    engine = make_engine(database_url(settings, run_dir))
    migrate(engine)
    return BankStore(engine)
