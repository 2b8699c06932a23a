"""The contract of a worker kind that trains a policy: what `crl run` and `crl worker` need beyond `Worker`.

A `TrainerWorker` names its role (`actor`, `extractor`), which says its trainer settings and the temperature its
policy samples at (`Settings.trainer`, `Settings.sampling_temperature`). From them it builds its `PolicyTrainer`
(checkpoints under `RUN_DIR/checkpoints/<role>`) and, with `ranks` above 1, `crl run` starts it under torchrun, one
process per rank: rank 0 is the worker itself (it reads and writes the log), and the ranks above it run
`serve_rank`, taking the steps rank 0 broadcasts (`pipeline.rl.data_parallel`). The actor and extractor trainers are
the two such kinds.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

from pipeline.rl.settings import TrainerSettings
from pipeline.rl.versions import checkpoints_root
from pipeline.runtime.runner import Worker
from pipeline.settings import Settings
from schemas.base import Producer, Role

if TYPE_CHECKING:  # torch: imported by the trainers, not by `crl run`
    from pipeline.rl.data_parallel import DataParallel
    from pipeline.rl.trainer import PolicyTrainer, WarmStart
    from pipeline.runtime.context import WorkerContext


class TrainerWorker(Worker):
    """A worker kind that updates the policy of `role`, on one process or on several data-parallel ranks."""

    role: ClassVar[Role]

    @abstractmethod
    def __init__(self, context: WorkerContext) -> None:
        """Built from the worker's context, as `crl worker` builds it (`build`)."""

    @classmethod
    def build(cls, context: WorkerContext) -> TrainerWorker:
        return cls(context)

    @classmethod
    def trainer_settings(cls, settings: Settings) -> TrainerSettings:
        """The settings of its trainer: its `ranks` decide how many processes `crl run` starts."""
        return settings.trainer(cls.role)

    @classmethod
    def temperature(cls, settings: Settings) -> float:
        """The temperature the policy samples at (its log-probs are taken at the same)."""
        return settings.sampling_temperature(cls.role)

    @classmethod
    def policy_trainer(cls, context: WorkerContext, warm_start: WarmStart | None) -> PolicyTrainer:
        """The trainer of rank 0: the newest checkpoint of the run, or version 0 (warm-started when asked)."""
        from pipeline.rl.trainer import PolicyTrainer

        settings = context.settings
        return PolicyTrainer(cls.role, cls.trainer_settings(settings), checkpoints_root(context.run_dir, cls.role),
                             settings.resolved_run_id, Producer(worker=cls.name, instance=context.instance),
                             warm_start=warm_start, announce=context.announce, parallel=context.parallel,
                             temperature=cls.temperature(settings))

    @classmethod
    def serve_rank(cls, settings: Settings, parallel: DataParallel) -> int:
        """A rank above 0: the newest checkpoint rank 0 wrote, then the steps rank 0 broadcasts until it says stop;
        returns the steps taken."""
        from pipeline.rl.trainer import replica_step

        step = replica_step(cls.role, cls.trainer_settings(settings), checkpoints_root(settings.run_dir, cls.role),
                            cls.temperature(settings))
        return parallel.follow(step)


def trainer_settings(kind: type[Worker], settings: Settings) -> TrainerSettings | None:
    """The trainer settings of a kind that trains a policy; None for every other kind (it runs as one process)."""
    return kind.trainer_settings(settings) if issubclass(kind, TrainerWorker) else None
