"""Worker kinds. A new kind is one file here, one line in `WORKERS`, one test and one compose service.

Imports flow `schemas <- pipeline <- workers`: workers may use everything, nothing imports workers (the CLI finds
this registry through the `crl.workers` entry point in pyproject.toml).
"""

from pipeline.runtime.launch import WorkerClass
from workers.actor_trainer import ActorTrainer
from workers.archiver import Archiver
from workers.bank import BankProjection
from workers.extractor import Extractor
from workers.extractor_trainer import ExtractorTrainer
from workers.rollout import Rollout
from workers.scheduler import Scheduler
from workers.tracker import Tracker

WORKERS: dict[str, WorkerClass] = {
    Scheduler.name: Scheduler,
    Rollout.name: Rollout,
    Extractor.name: Extractor,
    Archiver.name: Archiver,
    BankProjection.name: BankProjection,
    ActorTrainer.name: ActorTrainer,
    ExtractorTrainer.name: ExtractorTrainer,
    Tracker.name: Tracker,
}
