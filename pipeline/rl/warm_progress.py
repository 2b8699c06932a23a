"""A warm start's progress on the log: a warm start (`pipeline.rl.warm_start`) tells a `Progress` how far it has
come; `WarmStartReporter`, the one a trainer hands it, publishes that as `WarmStartProgressed` on `crl.train-steps`.

Warm starts take hundreds of steps, so not every step is published: the first and the last of each phase, the
`done`, and in between at most one every `interval_s`. Each event's id is derived from (run, role, phase, done)
(`warm_start_id`): a trainer restarted before version 0 was written warms up again and publishes the points it
reaches again under the same ids.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from typing import Protocol

from schemas.base import Event, Producer, Role
from schemas.training import WarmStartGateCheck, WarmStartPhase, WarmStartProgressed

_NAMESPACE = uuid.UUID("0f6b2d1e-7c4a-4f3b-9e85-3a9d51c7e204")

Announce = Callable[[Event], None]
"""Publishes an event while the worker is still building itself (`WorkerContext.announce`)."""


class Progress(Protocol):
    """Told how far a warm start has come: at the start of each phase, after every data episode and every step, and
    once when it is done (or loaded from the cache), with its gate's checks where the config sets a gate. It must
    not touch the random state: the weights are the same whoever listens."""

    def __call__(self, phase: WarmStartPhase, done: int, total: int, *, loss: float | None = None,
                 cached: bool = False, gate: tuple[WarmStartGateCheck, ...] | None = None) -> None: ...


def no_progress(phase: WarmStartPhase, done: int, total: int, *, loss: float | None = None,
                cached: bool = False, gate: tuple[WarmStartGateCheck, ...] | None = None) -> None:
    """The `Progress` of a warm start nobody watches."""


def warm_start_id(run_id: str, role: Role, phase: WarmStartPhase, done: int) -> uuid.UUID:
    """The deterministic event id of a warm start's progress at `done` of `phase`."""
    return uuid.uuid5(_NAMESPACE, f"{run_id}/{role}/warm-start/{phase}/{done}")


class WarmStartReporter:
    """Publishes a warm start's progress through `announce`, throttled; `clock` is for tests."""

    def __init__(self, run_id: str, role: Role, producer: Producer, announce: Announce, *, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_id = run_id
        self.role = role
        self.producer = producer
        self.announce = announce
        self.interval_s = interval_s
        self.clock = clock
        self.started = clock()
        self._phase: WarmStartPhase | None = None
        self._last_sent = -math.inf

    def __call__(self, phase: WarmStartPhase, done: int, total: int, *, loss: float | None = None,
                 cached: bool = False, gate: tuple[WarmStartGateCheck, ...] | None = None) -> None:
        now = self.clock()
        first = phase != self._phase
        last = done >= total
        if not (first or last or phase == "done" or now - self._last_sent >= self.interval_s):
            return
        self._phase = phase
        self._last_sent = now
        self.announce(WarmStartProgressed(
            event_id=warm_start_id(self.run_id, self.role, phase, done), run_id=self.run_id, producer=self.producer,
            role=self.role, phase=phase, done=done, total=total,
            loss=loss if loss is not None and math.isfinite(loss) else None,  # events carry finite numbers only
            cached=cached, elapsed_s=max(0.0, now - self.started), gate=gate,
        ))
