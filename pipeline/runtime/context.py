"""What a worker is built from: its settings, its instance name, the run's database and blobs, and the log it reads
beyond its inputs (`log`: Kafka under `crl worker`, memory in the harness), through which it follows topics.

The runtime reads only the few settings every worker shares (`RuntimeSettings`); a worker's own sections come with
the full settings object it is given (`context.settings`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Engine

from infra.broker import read_broker_file
from infra.db import DbSettings, database_url, make_engine, migrate
from infra.kafka import KafkaSettings
from pipeline.errors import ConfigError, InvalidArgumentError
from pipeline.runtime.blobs import BlobStore
from pipeline.runtime.log import Follower, Log, OnRecord
from pipeline.runtime.offsets import SqlOffsetStore
from pipeline.runtime.settings import RunnerSettings
from schemas.base import Event
from schemas.topics import Topic


class RuntimeSettings(Protocol):
    """The settings the runtime reads; `pipeline.settings.Settings` has them all."""

    # Read-only members: `Settings` is frozen.
    @property
    def run_dir(self) -> Path: ...

    @property
    def kafka(self) -> KafkaSettings: ...

    @property
    def db(self) -> DbSettings: ...

    @property
    def runner(self) -> RunnerSettings: ...

    @property
    def max_payload_bytes(self) -> int: ...

    @property
    def claim_check_bytes(self) -> int: ...

    @property
    def resolved_run_id(self) -> str: ...


def resolve_kafka(settings: RuntimeSettings) -> KafkaSettings:
    """Kafka settings with the bootstrap address filled in: the configured one, else the run dir's embedded broker."""
    if settings.kafka.bootstrap_servers:
        return settings.kafka
    broker = read_broker_file(settings.run_dir)
    if broker is not None:
        return settings.kafka.model_copy(update={"bootstrap_servers": broker["bootstrap_servers"]})
    raise ConfigError(
        f"no broker: set CRL_KAFKA__BOOTSTRAP_SERVERS, or start one with `crl stack up --run-dir {settings.run_dir}`"
    )


@dataclass
class WorkerContext:
    """What a worker may use to build itself: frozen settings, its instance name, the run's database and blobs."""

    settings: Any
    """The full settings (`pipeline.settings.Settings`): the runtime reads its `RuntimeSettings` part."""
    instance: str
    log: Log
    """The log beyond the worker's inputs: what it follows and reads to the end."""
    follows: tuple[Topic, ...] = ()
    """The topics the worker declared it follows; `follow` refuses others."""
    parallel: Any = None
    """The data-parallel group (`pipeline.rl.data_parallel.DataParallel`) this worker is rank 0 of, when it was
    started under torchrun; None otherwise."""
    announce: Callable[[Event], None] | None = None
    """Publishes an event while the worker is still building itself, before it runs (a trainer's warm-start
    progress): sent on the worker's own producer, flushed with its first commit. None: nowhere (the harness)."""
    _engine: Engine | None = field(default=None, repr=False)
    _followers: list[Follower] = field(default_factory=list, repr=False)

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

    def follow(self, topics: Sequence[Topic], on_record: OnRecord, *,
               start: Mapping[tuple[str, int], int] | None = None, name: str = "follower") -> Follower:
        """A follower of `topics` (declared in the worker's `follows`), not yet started; stopped when the worker
        stops."""
        undeclared = sorted({t.name for t in topics} - {t.name for t in self.follows})
        if undeclared:
            raise InvalidArgumentError(f"{self.instance} follows {undeclared}, which its worker kind does not declare "
                                       f"in `follows` ({[t.name for t in self.follows]})")
        follower = self.log.follow(topics, on_record, start=start, name=f"{self.instance}-{name}")
        self._followers.append(follower)
        return follower

    def close(self) -> None:
        """Stop every follower the worker opened, and the database engine."""
        for follower in self._followers:
            follower.stop()
        self._followers.clear()
        if self._engine is not None:
            self._engine.dispose()
