"""`crl report`: report.html and curves from one or more runs' archives."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli.common import console, fail
from pipeline.cli.listing import run_directory


def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories; several overlay as lines per run and arm.")],
    out: Annotated[Path | None, typer.Option(
        "--out", help="Output directory (default: RUN_DIR/report for one run; required for several).")] = None,
) -> None:
    """Write report.html and PNG curves from the runs' archives: per arm (its runs pooled), evaluation success before
    and after with 95% intervals and success against environment steps with bands; per run, success, actions,
    bank, extractor and retrieval."""
    from pipeline.audit.learning import row_line
    from pipeline.audit.report import summary_line, write_report

    for run_dir in run_dirs:
        run_directory(run_dir)
    if out is None and len(run_dirs) > 1:
        raise fail(f"{len(run_dirs)} runs need an output directory: pass --out DIR", 2)
    with console.status(f"reading {len(run_dirs)} run(s) and drawing"):
        written = write_report(run_dirs, out)
    for line in [*map(row_line, written.arms), *map(summary_line, written.runs),
                 *(f"wrote {path}" for path in (written.html, *written.figures))]:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
