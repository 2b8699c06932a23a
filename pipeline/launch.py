"""Turning a worker class plus settings into a running worker: the context it is built from, the Kafka wiring.

`crl worker NAME` is `launch_worker(registry[NAME], settings)`. The registry is every mapping published under the
`crl.workers` entry-point group (this repository publishes `workers:WORKERS`), so a package of your own can add
worker kinds; within this repository a new kind is one file in `workers/` and one line in `WORKERS`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

from sqlalchemy import Engine

from infra.db import database_url, make_engine, migrate
from infra.admin import topic_ids
from infra.kafka import make_admin, make_consumer, make_producer
from pipeline.blobs import BlobStore
from pipeline.errors import ConfigError
from pipeline.offsets import SqlOffsetStore
from pipeline.runner import Limits, Processor, Source, WorkerRunner
from pipeline.settings import Settings
from pipeline.transport import InputLog, KafkaAssignedInput, KafkaGroupInput, KafkaOutput
from schemas.base import Producer

WorkerClass = type[Processor] | type[Source]

ENTRY_POINT_GROUP = "crl.workers"


@dataclass
class WorkerContext:
    """What a worker may use to build itself: frozen settings, its instance name, the run's database and blobs."""

    settings: Settings
    instance: str
    _engine: Engine | None = field(default=None, repr=False)

    @property
    def run_dir(self) -> Path:
        return self.settings.run_dir

    @property
    def engine(self) -> Engine:
        """The run's SQL database, migrated to the latest schema on first use."""
        if self._engine is None:
            self._engine = make_engine(database_url(self.settings.db, self.run_dir), echo=self.settings.db.echo)
            migrate(self._engine)
        return self._engine

    @property
    def blobs(self) -> BlobStore:
        return BlobStore(self.run_dir / "blobs")

    def sql_offset_store(self, worker: str) -> SqlOffsetStore:
        return SqlOffsetStore(self.engine, worker)


def load_worker_registry() -> dict[str, WorkerClass]:
    """Every worker kind published under the `crl.workers` entry-point group."""
    registry: dict[str, WorkerClass] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        for name, worker in entry.load().items():
            if name in registry and registry[name] is not worker:
                raise ConfigError(f"worker kind {name!r} is registered twice ({entry.value} and another registry)")
            registry[name] = worker
    if not registry:
        raise ConfigError(f"no worker registry found under entry points {ENTRY_POINT_GROUP!r}; is the package installed?")
    return registry


def default_instance(worker: str) -> str:
    return f"{worker}-{socket.gethostname()}-{os.getpid()}"


def build_runner(
    worker_class: WorkerClass, settings: Settings, *, instance: str | None = None, limits: Limits = Limits()
) -> WorkerRunner:
    """Build the worker and connect it to Kafka: group or assign mode as it declares, producer for its outputs."""
    kafka = settings.resolve_kafka()
    instance = instance or default_instance(worker_class.name)
    context = WorkerContext(settings, instance)
    worker = worker_class.build(context)
    input_log: InputLog | None = None
    if worker_class.inputs:
        names = [topic.name for topic in worker_class.inputs]
        admin = make_admin(kafka, client_id=instance)
        try:
            log_ids = topic_ids(admin, names)
        finally:
            admin.close()
        if worker_class.consumption == "group":
            input_log = KafkaGroupInput(make_consumer(kafka, group_id=f"crl-{worker_class.name}", client_id=instance),
                                        names, log_ids)
        else:
            input_log = KafkaAssignedInput(make_consumer(kafka, client_id=instance, auto_offset_reset="none"),
                                           names, worker.offset_store(context), log_ids)
    return WorkerRunner(
        worker,
        input_log=input_log,
        output_log=KafkaOutput(make_producer(kafka, client_id=instance)),
        producer=Producer(worker=worker_class.name, instance=instance),
        run_id=settings.resolved_run_id,
        settings=settings.runner,
        max_payload_bytes=settings.max_payload_bytes,
        blobs=context.blobs,
        metrics_path=settings.run_dir / "metrics" / f"{instance}.jsonl",
        limits=limits,
    )
