"""`crl doctor`: is everything a run needs here and working (`pipeline.run.doctor`)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from pipeline.cli.common import (
    BrokerOption,
    RunDirOption,
    console,
    current_settings,
    with_broker,
)


def doctor(
    embedded: Annotated[bool, typer.Option("--embedded", help="Start a throwaway embedded broker to check.")] = False,
    run_dir: RunDirOption = None,
    broker_kind: BrokerOption = None,
) -> None:
    """Check broker, its limits, topics, a Kafka round trip of every event kind, SQL, embedding model and NLE; exit 1
    on any failure."""
    from pipeline.run.doctor import run_checks

    checks = run_checks(with_broker(current_settings(run_dir), broker_kind), embedded=embedded)
    table = Table("check", "result", "detail")
    for check in checks:
        table.add_row(check.name, "[green]ok[/green]" if check.ok else "[red]FAIL[/red]", check.detail)
    console.print(table)
    failed = [check for check in checks if not check.ok]
    console.print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    if failed:
        raise typer.Exit(1)
