"""`crl track`: load a run's archive into an experiment tracker."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli.common import State, console
from pipeline.cli.listing import run_directory


def track(
    run_dir: Annotated[Path, typer.Argument(help="The run directory whose archive to load.")],
    backend: Annotated[list[str] | None, typer.Option(
        "--backend", help="tensorboard, wandb or mlflow; repeat for several (default: tracker.backends).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Where the backends write (default: the run directory: RUN_DIR/tensorboard, ...).")] = None,
) -> None:
    """Write the scalars and sample episodes a tracker worker writes, from the run's archive: TensorBoard event
    files (`tensorboard --logdir OUT/tensorboard`), an offline W&B run (OUT/wandb) or an MLflow run (OUT/mlflow.db).
    What a ledger under OUT/tracking/ says was written already is not written again."""
    from pipeline.audit.track import track_archive

    run_directory(run_dir)
    assert State.settings is not None
    settings = State.settings.tracker
    backends = tuple(backend) if backend else settings.backends
    target = out or run_dir
    undecodable: Counter[str] = Counter()
    with console.status(f"reading the archive of {run_dir}"):
        tracker = track_archive(run_dir, backends, target, settings, undecodable)
    if undecodable:
        skipped = ", ".join(f"{count} on {topic}" for topic, count in sorted(undecodable.items()))
        console.print(f"skipped {sum(undecodable.values())} archived rows that do not decode ({skipped}): an event "
                      "kind or schema version this code does not know; `crl audit events` shows them",
                      markup=False, highlight=False)
    console.print(f"wrote {tracker.written} entries to {', '.join(backends)} under {target}"
                  + (" (everything was there already)" if tracker.written == 0 else ""),
                  markup=False, highlight=False)
    if "tensorboard" in backends:
        console.print(f"tensorboard --logdir {target / 'tensorboard'}", markup=False, highlight=False)
