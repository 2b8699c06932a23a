"""`crl worker NAME`: one worker of the `crl.workers` registry until SIGTERM / Ctrl-C or a bound.

Under torchrun (`python -m torch.distributed.run --standalone --nproc-per-node N -m pipeline.cli worker
actor_trainer`) a data-parallel kind runs as N ranks: rank 0 is the worker, the others take the steps it broadcasts
(`pipeline.rl.data_parallel`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Annotated, NoReturn

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

if TYPE_CHECKING:
    from pipeline.rl.data_parallel import RankInfo


def worker(
    name: Annotated[str, typer.Argument(help="Worker kind, a key of the WORKERS registry (e.g. archiver).")],
    run_dir: RunDirOption = None,
    instance: Annotated[str | None, typer.Option(help="Instance name (default: NAME-host-pid).")] = None,
    max_events: Annotated[int | None, typer.Option(help="Stop after this many input events.")] = None,
    timeout: Annotated[float | None, typer.Option(help="Stop after this many seconds.")] = None,
) -> None:
    """Run one worker until SIGTERM / Ctrl-C (it finishes the current event, flushes and commits first)."""
    from pipeline.errors import ConfigError
    from pipeline.runtime.launch import build_runner, default_instance, load_worker_kind
    from pipeline.runtime.runner import Limits

    settings = current_settings(run_dir)
    try:
        kind = load_worker_kind(name)
    except ConfigError as exc:
        raise fail(str(exc), 2) from exc
    instance = instance or default_instance(name)
    rank = torchrun_rank()
    parallel = None
    if rank is not None:
        from pipeline.rl.data_parallel import DataParallel
        from pipeline.run.trainer_worker import TrainerWorker

        if not issubclass(kind, TrainerWorker):
            raise fail(f"worker {name!r} does not run data-parallel; start it without torchrun", 2)
        if rank.rank > 0:
            instance = f"{instance}-rank{rank.rank}"
        configure_logging(State.log_level, settings.run_dir / "logs" / f"{instance}.log")
        trainer = kind.trainer_settings(settings)
        parallel = DataParallel.join(rank, device=trainer.model.device, timeout_s=trainer.rank_timeout_s)
        if rank.rank > 0:
            # Rank 0 decides when to stop (after its current step) and releases the others; a signal meant for the
            # whole group (a terminal's Ctrl-C, torchrun passing on SIGTERM) must not cut a step short here.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                parallel.barrier(f"{name} rank {rank.rank} waiting for rank 0 to load its checkpoint")
                steps = kind.serve_rank(settings, parallel)
            finally:
                parallel.close()
            console.print(f"{name} rank {rank.rank} of {rank.world_size} stopped after {steps} steps")
            return
    else:
        configure_logging(State.log_level, settings.run_dir / "logs" / f"{instance}.log")
    try:
        runner = build_runner(kind, settings, instance=instance,
                              limits=Limits(max_events=max_events, timeout_s=timeout), parallel=parallel)
        if parallel is not None:
            parallel.barrier(f"{name} rank 0 waiting for the other {parallel.world_size - 1} ranks")
        runner.install_signal_handlers()
        with errors.status(f"{name}: starting") as status:
            runner.on_progress = lambda m: status.update(
                f"{name} ({instance}): in {m.events_in}  out {m.events_out}  dead letters {m.dead_letters}"
                f"  retries {m.retries}  commits {m.commits}  lag {sum(m.lag.values())}"
            )
            metrics = runner.run()
        if parallel is not None:
            parallel.finish()
    finally:
        if parallel is not None:
            parallel.close()
    console.print(f"{name} stopped ({runner.stop_reason or 'finished'}): {json.dumps(metrics.snapshot())}")
    if parallel is None:
        leave_now()


def leave_now() -> NoReturn:
    """End the process at once, after a clean stop: the runner has flushed, committed and closed everything the
    worker opened, and what the interpreter would still do is free torch, the model and MiniHack object by object,
    2-3 seconds on two busy cores for each worker of every stop of `crl run`, which stops its workers one after the
    other. Logs and the console are flushed first; a data-parallel rank leaves the normal way (torch.distributed)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrun_rank() -> RankInfo | None:
    """This process's rank when torchrun started it with a world size above 1 (its RANK, WORLD_SIZE and LOCAL_RANK
    variables, read here at the edge); None otherwise."""
    from pipeline.rl.data_parallel import RankInfo

    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))
