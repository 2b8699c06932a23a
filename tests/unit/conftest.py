"""Fixtures the unit tests of several packages share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import pytest
from sqlalchemy import Engine

from infra.db import make_engine, migrate
from pipeline.rl.settings import ActorTrainerSettings
from pipeline.rl.synthetic import synthetic_trajectories
from pipeline.rl.trainer import PolicyTrainer, events_of
from pipeline.rl.versions import checkpoints_root
from schemas.base import Event, Producer
from workers.actor_trainer import ClosedStep, actor_update


class RecordActorRun(Protocol):
    def __call__(self, run_dir: Path, settings: ActorTrainerSettings, *, behaviour_shift: float = 0.0) -> list[Event]:
        ...


@pytest.fixture
def sqlite_in() -> Iterator[Callable[[Path], Engine]]:
    """`sqlite_in(run_dir)`: the run's SQLite database (`RUN_DIR/crl.sqlite3`), migrated; disposed after the test."""
    engines: list[Engine] = []

    def make(run_dir: Path) -> Engine:
        engine = make_engine(f"sqlite:///{run_dir / 'crl.sqlite3'}")
        migrate(engine)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.dispose()


@pytest.fixture(scope="session")
def record_actor_run() -> RecordActorRun:
    """Records a two-step actor run into `run_dir` without a broker: version 0, then per step a batch sampled from
    the policy itself (`synthetic_trajectories`), the trainer's update and its checkpoint; returns every event in
    log order (policies, trajectories, train steps), ready to archive.

    `behaviour_shift`: added to every recorded sampling log-prob, as if another policy had sampled the batch (each
    token's importance ratio becomes exp(-shift)): off-policy steps, where the losses' clipping differs. On-policy,
    GRPO's and CISPO's gradients are the same function, and what tells them apart is only rounding, which some CPUs
    do not produce."""

    def record(run_dir: Path, settings: ActorTrainerSettings, *, behaviour_shift: float = 0.0) -> list[Event]:
        trainer = PolicyTrainer("actor", settings, checkpoints_root(run_dir, "actor"), "run",
                                Producer(worker="actor_trainer", instance="t"))
        events: list[Event] = [*events_of(trainer.current)]
        for step in (1, 2):
            batch = sorted(synthetic_trajectories(trainer.policy, run_id="run", step=step, groups=2, group_size=4,
                                                  seed=1), key=lambda t: (t.group_id, t.slot))
            if behaviour_shift:
                batch = [t.model_copy(update={"turns": tuple(  # validated: quantised to float32 as on the wire
                    turn.model_validate({**dict(turn), "sampling_logprobs": [x + behaviour_shift
                                                                             for x in turn.sampling_logprobs]})
                    for turn in t.turns)}) for t in batch]
            recorded = actor_update(trainer, settings, ClosedStep(step, batch, [], False, 0))
            assert recorded.weight_hash_before != recorded.weight_hash_after, "the batch should carry a signal"
            events += [*batch, *events_of(trainer.save(recorded))]
        return events

    return record
