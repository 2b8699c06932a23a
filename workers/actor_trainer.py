"""Actor trainer: GRPO with subgroup advantages over the trajectories of each training step.

    crl worker actor_trainer --run-dir runs/demo

It reads `crl.trajectories` in assign mode with its own positions, collects the train-split episodes of the next step
until the step's `groups_per_step` groups of `group_size` slots are complete (or `group_timeout_s` passes: complete
groups train, incomplete ones are dropped and listed in the event), sorts them canonically (group id, slot), and -
after the warm-up steps, which only fill the bank - runs one update (`pipeline.rl.trainer.TrainerStep`): advantages
normalised inside the guided and the free half of each group, one sample per turn, the clipped ratio against the
recorded sampling log-probs, AdamW, gradient clip. It writes the checkpoint, then publishes `PolicyPublished(actor)`
and `TrainStepCompleted`, then commits its positions.

Positions never pass a trajectory that is collected but not yet trained, so a restart re-reads exactly what was
pending; what belongs to steps already trained (the newest checkpoint says which) is ignored. A crash between
checkpoint and publish is healed on restart by publishing the checkpoint's own events (`pipeline.rl.trainer`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Mapping

import torch

from pipeline.actor.metrics import episode_metrics
from pipeline.actor.settings import FROZEN_ACTOR_ARMS
from pipeline.rl.batching import ClosedStep, StepCollector
from pipeline.rl.settings import ActorTrainerSettings
from pipeline.rl.trainer import (
    PolicyTrainer,
    PolicyVersion,
    WarmStart,
    actor_batch,
    events_of,
    unpublished,
)
from pipeline.run.trainer_worker import TrainerWorker
from pipeline.runtime.context import WorkerContext
from pipeline.runtime.offsets import LogPosition, SqlOffsetStore
from pipeline.runtime.runner import Origin, WorkerIO
from pipeline.runtime.transport import OffsetStore, Position
from pipeline.settings import Settings
from schemas.base import Event
from schemas.topics import POLICY, TRAIN_STEPS, TRAJECTORIES
from schemas.training import TrainStepCompleted
from schemas.trajectories import TrajectoryCompleted

log = logging.getLogger(__name__)


class _PendingAwarePositions:
    """Saves positions no further than the oldest pending episode of each partition."""

    def __init__(self, inner: SqlOffsetStore, collector: StepCollector) -> None:
        self.inner = inner
        self.collector = collector

    def load(self) -> dict[Position, LogPosition]:
        return self.inner.load()

    def save(self, positions: Mapping[Position, LogPosition]) -> None:
        pending = self.collector.pending_offsets()
        self.inner.save({
            position: LogPosition(min(stored.next_offset, pending.get(position, stored.next_offset)), stored.log_id)
            for position, stored in positions.items()
        })


def step_metrics(trajectories: list[TrajectoryCompleted], advantages: torch.Tensor, policy_version: int
                 ) -> dict[str, float]:
    """Per-subgroup success and advantage statistics and sample staleness, namespaced for logging."""
    metrics: dict[str, float] = {}
    for name, guided in (("guided", True), ("free", False)):
        members = [i for i, t in enumerate(trajectories) if t.guided == guided]
        metrics[f"rollout/episodes_{name}"] = float(len(members))
        if members:
            metrics[f"rollout/success_{name}"] = statistics.fmean(float(trajectories[i].success) for i in members)
            values = advantages[members]
            metrics[f"train/advantage_mean_{name}"] = float(values.mean())
            metrics[f"train/advantage_abs_mean_{name}"] = float(values.abs().mean())
    staleness = [policy_version - t.policy_version for t in trajectories]
    metrics["train/staleness_mean"] = statistics.fmean(staleness)
    metrics["train/staleness_max"] = float(max(staleness))
    return metrics


def actor_update(trainer: PolicyTrainer, settings: ActorTrainerSettings, closed: ClosedStep) -> TrainStepCompleted:
    """One update (the loss of `settings.loss`, GRPO by default) on a closed step; returns the `TrainStepCompleted`
    that records it (not yet saved)."""
    trajectories = closed.trajectories
    samples, advantages = actor_batch(trajectories, settings)
    started = time.perf_counter()
    before = trainer.weight_hash
    result = trainer.step(samples)
    metrics = {
        **result.diagnostics(), "train/clipped_low": float(result.clipped_low),
        "train/clipped_high": float(result.clipped_high), "train/grad_norm": result.grad_norm,
        "train/trained_tokens": float(result.trained_tokens), "train/sequences": float(result.sequences),
        "train/lr": settings.lr, "train/threads": float(settings.threads),
        "train/late_trajectories": float(closed.late), "train/seconds": time.perf_counter() - started,
        "rollout/reward_mean": statistics.fmean(t.reward for t in trajectories),
        **step_metrics(trajectories, advantages, trainer.current.version),
        **episode_metrics(trajectories, "rollout"),  # per environment and subgroup: success, actions, invalid rate
    }
    return trainer.train_step_event(
        step=closed.step, batch_event_ids=tuple(str(t.event_id) for t in trajectories),
        dropped_event_ids=tuple(closed.dropped_event_ids), timed_out=closed.timed_out,
        weight_hash_before=before, weight_hash_after=trainer.weight_hash, loss=result.loss,
        tokens=result.tokens, metrics=metrics, rewards=tuple(t.reward for t in trajectories),
        advantages=tuple(advantages.tolist()),
    )


def actor_warm_start(settings: Settings) -> WarmStart | None:
    """Behaviour cloning of a freshly built actor, when the config asks for it (`actor_trainer.warm_start`)."""
    warm = settings.actor_trainer.warm_start
    if warm.steps == 0:
        return None
    from pipeline.rl.warm_start import warm_start_actor

    return lambda policy, progress: warm_start_actor(policy, warm, settings.envs.tasks, settings.envs,
                                                     settings.rollout, progress,
                                                     precision=settings.actor_trainer.model.precision)


class ActorTrainer(TrainerWorker):
    name = "actor_trainer"
    role = "actor"
    consumes = (TRAJECTORIES,)
    consumption = "assign"
    produces = (POLICY, TRAIN_STEPS)

    def __init__(self, context: WorkerContext) -> None:
        self.settings = context.settings.actor_trainer
        self.log = context.log
        self.arm = context.settings.scheduler.arm
        self.frozen = self.arm in FROZEN_ACTOR_ARMS
        self.trainer = self.policy_trainer(context, actor_warm_start(context.settings))
        self.collector = StepCollector(
            self.settings.group_size, self.settings.groups_per_step,
            # deterministic mode never trains a step short of a group
            math.inf if context.settings.scheduler.deterministic else self.settings.group_timeout_s,
            next_step=max(self.settings.warmup_steps, self.trainer.current.step + 1 if self.trainer.current.version
                          else 0),
        )

    def offset_store(self, context: WorkerContext) -> OffsetStore:
        return _PendingAwarePositions(context.sql_offset_store(self.name), self.collector)

    def start(self, io: WorkerIO) -> None:
        for event in unpublished(self.trainer.current, self.log):
            log.info("publishing %s of version %d (written before the last stop, not yet on the log)", event.kind,
                     self.trainer.current.version)
            io.publish(event)
        io.commit()

    def handle(self, event: Event, origin: Origin) -> list[Event]:
        if isinstance(event, TrajectoryCompleted) and event.run_id == self.trainer.run_id:  # never another run's
            self.collector.add(event, (origin.topic, origin.partition), origin.offset, time.monotonic())
        return []

    def after_poll(self, io: WorkerIO) -> None:
        """Train every step that closed; the runner then commits positions that stop at the oldest episode not yet
        trained (`_PendingAwarePositions`)."""
        self.trainer.keep_alive()  # data parallel: the other ranks wait for the next batch
        while (closed := self.collector.close(time.monotonic())) is not None:
            self.train(closed, io)

    def train(self, closed: ClosedStep, io: WorkerIO) -> None:
        if self.frozen:
            log.info("arm %s: the actor stays at version 0; step %d (%d episodes) is not trained", self.arm,
                     closed.step, len(closed.trajectories))
            return
        if not closed.trajectories:
            log.warning("step %d timed out with no complete group; %d episodes dropped, no update", closed.step,
                        len(closed.dropped_event_ids))
            return
        event = actor_update(self.trainer, self.settings, closed)
        version = self.trainer.save(event)
        self.publish_version(version, io)
        log.info("actor step %d -> version %d: loss %.5f, clip %.3f, %d tokens, success guided %.2f free %.2f",
                 closed.step, version.version, event.loss, event.metrics["train/clip_fraction"], event.tokens,
                 event.metrics.get("rollout/success_guided", float("nan")),
                 event.metrics.get("rollout/success_free", float("nan")))

    def publish_version(self, version: PolicyVersion, io: WorkerIO) -> None:
        for event in events_of(version):
            io.publish(event)
        io.commit()
