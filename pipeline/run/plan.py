"""Which worker processes a run needs, in which order they start and stop, and where the run lives.

Everything here is derived from what the worker kinds declare (`pipeline.runtime.runner.Worker`), for every kind of
the `crl.workers` registry, this repository's and any installed package's:

- which arms need a kind (`arms`; the grpo arm has no experience bank, so no bank, extractor or extractor trainer),
  and whether the settings turn it off (`enabled`: `tracker.enabled: false`);
- how many processes (`instances`, the `launch` setting that counts them; one by default), and how many
  data-parallel ranks a trainer process runs as (`trainer_ranks`: its `ranks` setting; above 1 under torchrun);
- the start order, consumers first: a kind starts after every kind that consumes a topic it produces, so nothing is
  published before its readers are up; the run's clock (the scheduler) starts last, and what it consumes (feedback
  from the others) orders nobody. For this repository's kinds that is archiver, bank, extractor trainer,
  extractor, actor trainer, rollout, scheduler;
- the stop order, the reverse: the clock first, the archiver last, so it archives what the others publish while
  stopping.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.run.trainer_worker import trainer_settings
from pipeline.runtime.launch import WorkerClass, load_worker_registry
from pipeline.settings import Settings


def start_order(kinds: Mapping[str, WorkerClass]) -> list[str]:
    """Kinds in start order: each after every other kind that consumes what it produces (ties keep registry
    order). Raises `ConfigError` on a cycle, naming the kinds in it."""
    clocks = [name for name, kind in kinds.items() if kind.clock]
    if len(clocks) > 1:
        raise ConfigError(f"more than one worker kind declares itself the run's clock: {clocks}")
    readers = {name: {other for other, reader in kinds.items()
                      if other != name and not reader.clock and set(reader.consumes) & set(kind.produces)}
               for name, kind in kinds.items()}
    order: list[str] = []
    while len(order) < len(kinds):
        ready = [name for name in kinds if name not in order and readers[name] <= set(order)]
        if not ready:
            stuck = {name: sorted(readers[name] - set(order)) for name in kinds if name not in order}
            raise ConfigError(f"worker kinds consume each other's topics in a cycle, so no start order exists: "
                              f"{stuck} (kind: the kinds that must start before it)")
        order.append(ready[0])
    return order


def planned_kinds(settings: Settings, registry: Mapping[str, WorkerClass]) -> dict[str, WorkerClass]:
    """The registry's kinds the run's arm needs, in start order."""
    arm = settings.scheduler.arm
    needed = {name: kind for name, kind in registry.items()
              if (kind.arms is None or arm in kind.arms) and kind.enabled(settings)}
    return {name: needed[name] for name in start_order(needed)}


def instance_count(settings: Settings, kind: WorkerClass) -> int:
    if kind.instances is None:
        return 1
    count = getattr(settings.launch, kind.instances, None)
    if not isinstance(count, int):
        raise ConfigError(f"worker kind {kind.name!r} counts its processes with launch.{kind.instances}, "
                          f"which is not a launch setting ({sorted(type(settings.launch).model_fields)})")
    return count


def trainer_ranks(kind: WorkerClass, settings: Settings) -> int:
    """How many data-parallel ranks `crl run` starts the kind as (its trainer settings' `ranks`; 1 for a kind that
    does not train data-parallel)."""
    trainer = trainer_settings(kind, settings)
    return 1 if trainer is None else int(trainer.ranks)


def worker_command(kind: WorkerClass, settings: Settings, instance: str, run_config: Path) -> list[str]:
    """The arguments after `python` that start one worker process of the run: `crl worker`, under torchrun with
    one process per rank when the kind trains data-parallel on more than one rank (torchrun tears every rank down
    when one fails, and its exit code says so)."""
    command = ["-m", "pipeline.cli", "--config", str(run_config), "--log-level", "warning", "worker", kind.name,
               "--instance", instance]
    ranks = trainer_ranks(kind, settings)
    if ranks > 1:
        command = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *command]
    return command


def worker_plan(settings: Settings, registry: Mapping[str, WorkerClass] | None = None) -> list[tuple[str, str]]:
    """(kind, instance) of every worker process the run needs, in start order (stop in the reverse)."""
    kinds = planned_kinds(settings, registry if registry is not None else load_worker_registry())
    return [(name, f"{name}-{i}") for name, kind in kinds.items() for i in range(instance_count(settings, kind))]


def default_run_dir(config: Path) -> Path:
    return Path("runs") / f"{config.stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run directory {run_dir} is not empty: a run starts from an empty directory; "
                          "pick another --run-dir")
