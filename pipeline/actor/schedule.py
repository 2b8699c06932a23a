"""The run's schedule as pure functions of its settings and the step: which actor version may play a step, how many
slots of a group are guided, when merges and evaluations fall, and the `EpisodeAssigned` events of every train and
evaluation slot, with deterministic ids (so a restarted scheduler publishes exactly what is missing).

    schedule = settings.schedule()
    schedule.train_assignments(run_id, producer, step=3)     # the same events every time

Group size, groups per step and warm-up are the actor trainer's settings, passed in here, so the scheduler and the
trainer cannot disagree.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Protocol

from pipeline.actor.settings import FROZEN_ACTOR_ARMS, SchedulerSettings
from pipeline.envs.registry import draw_tasks, env_spec, task_pool
from pipeline.envs.settings import EnvSettings
from schemas.base import Producer
from schemas.tasks import EpisodeAssigned

_NAMESPACE = uuid.UUID("9b1f3c52-6f0e-4d8b-a7f4-2c61e0d4b9a3")
EVAL_GROUP_SIZE = 2
"""Evaluation plays each eval task twice per repeat (`envs.eval_repeats`): the first half of the slots guided, the
rest free (the `grpo` arm: free slots only)."""


def scheduled_id(run_id: str, *parts: object) -> uuid.UUID:
    """The deterministic event id of something the scheduler publishes."""
    return uuid.uuid5(_NAMESPACE, "/".join([run_id, *map(str, parts)]))


def trajectory_event_id(assignment_event_id: str) -> uuid.UUID:
    """The `TrajectoryCompleted` id of an assignment's episode. An assignment re-delivered after a stop (its offset
    was held back while other episodes were in flight) is played again and published under the same id, so every
    reader keeps the first one on the log and counts it once."""
    return uuid.uuid5(_NAMESPACE, f"trajectory/{assignment_event_id}")


def finished_id(run_id: str, attempt: int) -> uuid.UUID:
    """The `RunFinished` id of a run's attempt: 0 for the first, then one per `crl run --resume` (`RunResumed`)."""
    return scheduled_id(run_id, "finished" if attempt == 0 else f"finished-{attempt}")


class GroupShape(Protocol):
    """What the schedule takes from the actor trainer's settings (`ActorTrainerSettings`)."""

    @property
    def group_size(self) -> int: ...
    @property
    def groups_per_step(self) -> int: ...
    @property
    def warmup_steps(self) -> int: ...


@dataclass(frozen=True)
class Schedule:
    """Which episodes each step plays: the scheduler's settings, the tasks, and the actor trainer's groups."""

    scheduler: SchedulerSettings
    envs: EnvSettings
    group_size: int
    groups_per_step: int
    warmup_steps: int

    @classmethod
    def of(cls, scheduler: SchedulerSettings, envs: EnvSettings, trainer: GroupShape) -> Schedule:
        """The one way a run's schedule is made: by the scheduler and the run's settings (`Settings.schedule`), and
        again from a run's recorded config by the tracker, so the two cannot disagree."""
        return cls(scheduler=scheduler, envs=envs, group_size=trainer.group_size,
                   groups_per_step=trainer.groups_per_step, warmup_steps=trainer.warmup_steps)

    def required_version(self, step: int) -> int:
        """Oldest actor version allowed to play `step`: every trainable step before it, less the staleness bound."""
        if self.scheduler.arm in FROZEN_ACTOR_ARMS:
            return 0  # the actor is frozen: version 0 plays every step
        return max(0, step - self.warmup_steps - self.scheduler.staleness)

    def guided_slots(self, step: int) -> int:
        if self.scheduler.arm == "grpo" or step < self.warmup_steps:
            return 0
        return self.group_size // 2

    def eval_due(self, step: int) -> bool:
        every = self.scheduler.eval_every
        return every > 0 and (step % every == 0 or step == self.scheduler.steps - 1)

    def merge_due(self, step: int) -> bool:
        """Whether `MergeRequested` (for the steps before) precedes step `step`."""
        every = self.scheduler.merge_every
        return every > 0 and self.scheduler.arm != "grpo" and step > 0 and step % every == 0

    def train_assignments(self, run_id: str, producer: Producer, step: int,
                          bank_position: int | None = None) -> list[EpisodeAssigned]:
        """The train slots of `step`, in publishing order (group, slot); `bank_position`: deterministic mode's
        op-log offset its guided slots are served at."""
        k = self.group_size
        guided = self.guided_slots(step)
        version = self.required_version(step)
        episodes = []
        for g, (entry, seed) in enumerate(draw_tasks(self.envs, step, self.groups_per_step)):
            spec = env_spec(entry.env_id)
            group_id = f"s{step:06d}-g{g:03d}"
            for slot in range(k):
                episodes.append(EpisodeAssigned(
                    event_id=scheduled_id(run_id, "train", step, g, slot), run_id=run_id, producer=producer,
                    step=step, split="train", env_id=entry.env_id, task_family=spec.task_family, seed=seed,
                    group_id=group_id, slot=slot, group_size=k, guided=slot < guided, policy_version=version,
                    max_turns=entry.max_turns or spec.max_turns, bank_position=bank_position))
        return episodes

    def eval_assignments(self, run_id: str, producer: Producer, step: int,
                         bank_position: int | None = None) -> list[EpisodeAssigned]:
        """Evaluation slots after `step`: every task of every environment's eval pool (unseen in training; group ids
        `eval-s<step>-<env>-t<i>`), then the first `eval_recurring_per_env` tasks of its train pool (tasks that come
        back; `...-r<i>`), each `eval_repeats` times guided and as often free (the `grpo` arm: free only)."""
        repeats = self.envs.eval_repeats
        size = repeats if self.scheduler.arm == "grpo" else EVAL_GROUP_SIZE * repeats
        guided_slots = 0 if self.scheduler.arm == "grpo" else repeats
        version = self.required_version(step)
        episodes = []
        for entry in self.envs.tasks:
            spec = env_spec(entry.env_id)
            eval_seed = self.envs.seed if self.envs.eval_seed is None else self.envs.eval_seed
            unseen = task_pool(entry.env_id, "eval", self.envs.eval_tasks_per_env, eval_seed)
            recurring = task_pool(entry.env_id, "train", self.envs.train_pool_size, self.envs.seed)[
                : self.envs.eval_recurring_per_env]
            tasks = [("t", "eval", t, seed) for t, seed in enumerate(unseen)]
            tasks += [("r", "eval-recurring", t, seed) for t, seed in enumerate(recurring)]
            for mark, id_kind, t, seed in tasks:
                group_id = f"eval-s{step:06d}-{entry.env_id}-{mark}{t:03d}"
                for slot in range(size):
                    episodes.append(EpisodeAssigned(
                        event_id=scheduled_id(run_id, id_kind, step, entry.env_id, t, slot), run_id=run_id,
                        producer=producer, step=step, split="eval", env_id=entry.env_id,
                        task_family=spec.task_family, seed=seed, group_id=group_id, slot=slot, group_size=size,
                        guided=slot < guided_slots, policy_version=version,
                        max_turns=entry.max_turns or spec.max_turns, bank_position=bank_position))
        return episodes

    def trajectory_ids(self, step: int, split: str | None = None) -> frozenset[str]:
        """The trajectory ids (`<group_id>-k<slot>`) of every episode `step` schedules, or of one split's."""
        producer = Producer(worker="schedule", instance="ids")
        episodes = self.train_assignments("ids", producer, step) if split in (None, "train") else []
        if split in (None, "eval") and self.eval_due(step):
            episodes += self.eval_assignments("ids", producer, step)
        return frozenset(f"{e.group_id}-k{e.slot}" for e in episodes)
