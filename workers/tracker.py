"""Tracker: the run followed in the experiment trackers people already have open (TensorBoard by default; Weights &
Biases and MLflow as options).

    crl worker tracker --run-dir runs/demo          # follows the broker of `crl stack up --run-dir runs/demo`
    tensorboard --logdir runs/demo/tensorboard

It reads every topic from offset 0 at every start (its state is a fold of the whole run: `pipeline.tracking.fold`)
and writes namespaced scalars and sample episodes against the step to each of `tracker.backends`; a ledger per
backend keeps a restart from writing an entry twice (`pipeline.tracking.tracker`). It publishes nothing.
`crl track RUN_DIR` writes the same entries from a run's archive.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pipeline.runtime.context import WorkerContext
from pipeline.runtime.offsets import FromTheStart
from pipeline.runtime.runner import Origin, Worker
from pipeline.runtime.transport import OffsetStore
from pipeline.tracking.backends import open_backends
from pipeline.tracking.tracker import Tracker as TrackerCore
from schemas.base import Event
from schemas.topics import TOPICS


class Tracker(Worker):
    name = "tracker"
    consumes = TOPICS
    consumption = "assign"

    def __init__(self, tracker: TrackerCore, flush_interval_s: float) -> None:
        self.tracker = tracker
        self.flush_interval_s = flush_interval_s
        self._flushed = time.monotonic()

    @classmethod
    def enabled(cls, settings: Any) -> bool:
        return settings.tracker.enabled

    @classmethod
    def build(cls, context: WorkerContext) -> Tracker:
        settings = context.settings
        run_id = settings.resolved_run_id
        config = settings.model_dump(mode="json", exclude={"config"})  # secrets stay masked
        backends = open_backends(settings.tracker.backends, context.run_dir, run_id, config, settings.tracker)
        return cls(TrackerCore(backends, context.run_dir, run_id, settings.tracker.samples_per_step),
                   settings.tracker.flush_interval_s)

    def offset_store(self, context: WorkerContext) -> OffsetStore:
        return FromTheStart()

    def handle(self, event: Event, origin: Origin) -> Sequence[Event]:
        self.tracker.add(event, origin.offset)
        return ()

    def flush_due(self, now: float) -> bool:
        return now - self._flushed >= self.flush_interval_s

    def flush(self) -> None:
        self.tracker.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        self.tracker.close()
