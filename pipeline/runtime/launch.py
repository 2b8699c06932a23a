"""Turning a worker class plus settings into a running worker: its context (`pipeline.runtime.context`) and its
Kafka wiring.

`crl worker NAME` is `build_runner(registry[NAME], settings).run()`. The registry is every mapping published under the
`crl.workers` entry-point group (this repository publishes `workers:WORKERS`), so a package of your own can add
worker kinds; within this repository a new kind is one file in `workers/` and one line in `WORKERS`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from infra.admin import unowned_partitions
from infra.kafka import KafkaSettings, make_admin, make_consumer, make_producer
from pipeline.errors import ConfigError
from pipeline.runtime.context import RuntimeSettings, WorkerContext, resolve_kafka
from pipeline.runtime.group_commits import GroupCommitLog
from pipeline.runtime.log import KafkaLog
from pipeline.runtime.runner import Limits, Worker, WorkerRunner, event_headers
from pipeline.runtime.transport import GroupWatch, InputLog, KafkaAssignedInput, KafkaGroupInput, KafkaOutput
from schemas.base import Event, Producer
from schemas.codec import encode_for_topic

WorkerClass = type[Worker]

ENTRY_POINT_GROUP = "crl.workers"


def _registries() -> list[tuple[str, Mapping[str, WorkerClass]]]:
    """(entry-point value, registry) of every `crl.workers` entry point: this project's own (`workers`) first, then
    the others by value, so the order (which breaks ties in `crl run`'s start order) does not depend on how the
    installed distributions happen to be listed."""
    entries = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.module != "workers", e.value, e.name))
    registries = [(entry.value, entry.load()) for entry in entries]
    if not registries:
        raise ConfigError(f"no worker registry found under entry points {ENTRY_POINT_GROUP!r}; is the package "
                          "installed?")
    return registries


def load_worker_registry() -> dict[str, WorkerClass]:
    """Every worker kind published under the `crl.workers` entry-point group, each class imported."""
    registry: dict[str, WorkerClass] = {}
    for value, kinds in _registries():
        for name, worker in kinds.items():
            if name in registry and registry[name] is not worker:
                raise ConfigError(f"worker kind {name!r} is registered twice ({value} and another registry)")
            registry[name] = worker
    if not registry:
        raise ConfigError(f"no worker kind is registered under entry points {ENTRY_POINT_GROUP!r}")
    return registry


def load_worker_kind(name: str) -> WorkerClass:
    """Worker kind `name`, importing no other kind where its registry imports on lookup (this project's does: a
    scheduler process never imports torch). `ConfigError` when no registry has it (naming the kinds there are) or
    two registries have different classes for it."""
    registries = _registries()
    found = [(value, kinds[name]) for value, kinds in registries if name in kinds]
    if not found:
        known = sorted({kind for _, kinds in registries for kind in kinds})
        raise ConfigError(f"unknown worker {name!r}; known workers: {', '.join(known)}")
    if any(worker is not found[0][1] for _, worker in found[1:]):
        raise ConfigError(f"worker kind {name!r} is registered twice ({' and '.join(value for value, _ in found)})")
    return found[0][1]


def default_instance(worker: str) -> str:
    return f"{worker}-{socket.gethostname()}-{os.getpid()}"


def group_watch(kafka: KafkaSettings, group_id: str, instance: str, topics: list[str],
                stuck_after_s: float = 30.0) -> GroupWatch:
    """What a group member uses to find out it is stuck with no partitions, and to join again (`GroupWatch`)."""
    def unowned() -> set[tuple[str, int]]:
        admin = make_admin(kafka, client_id=f"{instance}-watch")
        try:
            return unowned_partitions(admin, group_id, topics, asking_client=instance)
        finally:
            admin.close()

    return GroupWatch(lambda: make_consumer(kafka, group_id=group_id, client_id=instance), unowned, stuck_after_s)


def build_runner(
    worker_class: WorkerClass, settings: RuntimeSettings, *, instance: str | None = None, limits: Limits = Limits(),
    parallel: Any = None,
) -> WorkerRunner:
    """Build the worker and connect it to Kafka: group or assign mode as it declares, producer for its outputs.
    `parallel`: the data-parallel group (`pipeline.rl.data_parallel.DataParallel`) the worker is rank 0 of."""
    kafka = resolve_kafka(settings)
    instance = instance or default_instance(worker_class.name)
    log = KafkaLog(kafka, client_id=instance)
    output_log = KafkaOutput(make_producer(kafka, client_id=instance))

    def announce(event: Event) -> None:
        topic, key, value = encode_for_topic(event, settings.max_payload_bytes)
        output_log.send(topic.name, key, value, event_headers(event))

    context = WorkerContext(settings, instance, log, follows=worker_class.follows, parallel=parallel,
                            announce=announce)
    worker = worker_class.build(context)
    input_log: InputLog | None = None
    if worker_class.consumes:
        names = [topic.name for topic in worker_class.consumes]
        log_ids = {topic.name: log.log_id(topic) for topic in worker_class.consumes}
        if worker_class.consumption == "group":
            group_id = f"crl-{worker_class.name}"
            input_log = KafkaGroupInput(make_consumer(kafka, group_id=group_id, client_id=instance), names, log_ids,
                                        GroupCommitLog(context.engine, group_id, instance, output_log.produced_ends),
                                        group_watch(kafka, group_id, instance, names))
        else:
            input_log = KafkaAssignedInput(make_consumer(kafka, client_id=instance, auto_offset_reset="none"),
                                           names, worker.offset_store(context), log_ids)
    return WorkerRunner(
        worker,
        input_log=input_log,
        output_log=output_log,
        producer=Producer(worker=worker_class.name, instance=instance),
        run_id=settings.resolved_run_id,
        settings=settings.runner,
        max_payload_bytes=settings.max_payload_bytes,
        blobs=context.blobs,
        claim_check_bytes=settings.claim_check_bytes,
        metrics_path=settings.run_dir / "metrics" / f"{instance}.jsonl",
        limits=limits,
        context=context,
    )
