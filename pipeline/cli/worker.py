"""`crl worker NAME`: one worker of the `crl.workers` registry until SIGTERM / Ctrl-C or a bound."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from pipeline.cli.common import (
    RunDirOption,
    State,
    configure_logging,
    console,
    current_settings,
    errors,
    fail,
)


def worker(
    name: Annotated[str, typer.Argument(help="Worker kind, a key of the WORKERS registry (e.g. archiver).")],
    run_dir: RunDirOption = None,
    instance: Annotated[str | None, typer.Option(help="Instance name (default: NAME-host-pid).")] = None,
    max_events: Annotated[int | None, typer.Option(help="Stop after this many input events.")] = None,
    timeout: Annotated[float | None, typer.Option(help="Stop after this many seconds.")] = None,
) -> None:
    """Run one worker until SIGTERM / Ctrl-C (it finishes the current event, flushes and commits first)."""
    from pipeline.runtime.launch import build_runner, default_instance, load_worker_registry
    from pipeline.runtime.runner import Limits

    settings = current_settings(run_dir)
    registry = load_worker_registry()
    if name not in registry:
        raise fail(f"unknown worker {name!r}; known workers: {', '.join(sorted(registry))}", 2)
    instance = instance or default_instance(name)
    configure_logging(State.log_level, settings.run_dir / "logs" / f"{instance}.log")
    runner = build_runner(registry[name], settings, instance=instance,
                          limits=Limits(max_events=max_events, timeout_s=timeout))
    runner.install_signal_handlers()
    with errors.status(f"{name}: starting") as status:
        runner.on_progress = lambda m: status.update(
            f"{name} ({instance}): in {m.events_in}  out {m.events_out}  dead letters {m.dead_letters}"
            f"  retries {m.retries}  commits {m.commits}  lag {sum(m.lag.values())}"
        )
        metrics = runner.run()
    console.print(f"{name} stopped ({runner.stop_reason or 'finished'}): {json.dumps(metrics.snapshot())}")
