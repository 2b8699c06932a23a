"""How each trainer forms its batches from the log, before the update (`pipeline.rl.trainer.TrainerStep`).

- `StepCollector` (actor, GRPO): collects the train episodes of each step and closes steps in order, once
  `groups_per_step` groups of `group_size` are complete, or after `group_timeout_s` with the complete ones (the rest
  dropped and listed); the batch is in canonical (group, slot) order.
- `ExtractorJoin` (extractor, CISPO): joins every `ExtractionGenerated` with the outcomes of the guided train
  episodes that were served its experiences, and forms a batch of the oldest `buffer_size` generations with new
  outcomes: reward = mean outcome, advantage = (r - mean r) * Eq. 7 weight. With `parse_error_reward` set, a
  rejected answer is a sample too, its one outcome that reward.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pipeline.errors import PoisonMessageError
from pipeline.rl.advantages import NEVER_TRAINED, batch_mean_advantages, training_count_weights
from pipeline.rl.policy_step import Sample
from pipeline.rl.trainer import extractor_samples
from pipeline.runtime.transport import Position
from schemas.extractions import ExtractionGenerated
from schemas.training import TrainStepCompleted
from schemas.trajectories import TrajectoryCompleted


@dataclass
class ClosedStep:
    """A step ready to train: its complete groups in canonical order, and what was dropped."""

    step: int
    trajectories: list[TrajectoryCompleted]
    dropped_event_ids: list[str]
    timed_out: bool
    late: int


@dataclass
class _Pending:
    groups: dict[str, dict[int, tuple[TrajectoryCompleted, Position, int]]] = field(
        default_factory=lambda: defaultdict(dict))
    waiting_since: float | None = None


class StepCollector:
    """Collects train episodes per step and closes steps in order: complete, or timed out."""

    def __init__(self, group_size: int, groups_per_step: int, timeout_s: float, next_step: int) -> None:
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.timeout_s = timeout_s
        self.next_step = next_step
        self.steps: dict[int, _Pending] = defaultdict(_Pending)
        self.late = 0

    def add(self, trajectory: TrajectoryCompleted, position: Position, offset: int, now: float) -> None:
        if trajectory.split != "train":
            return
        if trajectory.step < self.next_step:
            self.late += 1  # a warm-up step, a step already trained, or a straggler of a closed step
            return
        if trajectory.slot >= self.group_size:
            # This input, not the worker: a dead letter (a misconfigured scheduler shows as one per episode).
            raise PoisonMessageError(f"trajectory {trajectory.trajectory_id} has slot {trajectory.slot} but the "
                                     f"trainer's group_size is {self.group_size}: the scheduler and the trainer "
                                     "disagree, or the record was not written by this run's scheduler")
        pending = self.steps[trajectory.step]
        pending.groups[trajectory.group_id].setdefault(trajectory.slot, (trajectory, position, offset))
        if pending.waiting_since is None:
            pending.waiting_since = now

    def close(self, now: float) -> ClosedStep | None:
        """The next step, if all its groups are complete or its timeout passed."""
        pending = self.steps.get(self.next_step)
        if pending is None:
            return None
        complete = sorted(g for g, slots in pending.groups.items() if len(slots) == self.group_size)
        timed_out = pending.waiting_since is not None and now - pending.waiting_since >= self.timeout_s
        if len(complete) < self.groups_per_step and not timed_out:
            return None
        trajectories = [pending.groups[g][slot][0] for g in complete[: self.groups_per_step]
                        for slot in sorted(pending.groups[g])]
        kept = {t.event_id for t in trajectories}
        dropped = sorted(str(t.event_id) for slots in pending.groups.values() for t, _, _ in slots.values()
                         if t.event_id not in kept)
        closed = ClosedStep(self.next_step, trajectories, dropped, timed_out and len(complete) < self.groups_per_step,
                            self.late)
        del self.steps[self.next_step]
        self.next_step += 1
        self.late = 0
        if self.next_step in self.steps:
            self.steps[self.next_step].waiting_since = max(self.steps[self.next_step].waiting_since or now, now)
        return closed

    def pending_offsets(self) -> dict[Position, int]:
        """Lowest offset per partition of an episode collected but not yet trained."""
        lowest: dict[Position, int] = {}
        for pending in self.steps.values():
            for slots in pending.groups.values():
                for _, position, offset in slots.values():
                    lowest[position] = min(offset, lowest.get(position, offset))
        return lowest


def is_sample(event: ExtractionGenerated, parse_errors: bool = False) -> bool:
    """Whether a generation is an extractor sample: it produced experiences (parse status ok), or, with
    `parse_errors` (the trainer's `parse_error_reward` set), its answer was rejected by the parser."""
    return event.parse_status == "ok" or (parse_errors and event.parse_status == "parse_error")


PARSE_ERROR = "parse-error"
"""The outcome key of a rejected answer's own reward in `ExtractorJoin.outcomes` (no trajectory has this id)."""


def trained_copies(events: Iterable[ExtractionGenerated],
                   parse_errors: bool = False) -> dict[str, ExtractionGenerated]:
    """By event id, the copy of each generation `ExtractorJoin` keeps from `events` in log order: the first one that
    is a sample. A generation's event id is derived from its generation id, so an extractor that distils a
    trajectory again (a re-delivered trajectory, a restart) publishes it again under the same id with what it samples
    then: other tokens, and possibly another parse status. A copy that is not a sample never enters the join, so the
    copy a step trained on is not always the first one on the log; what `crl replay train` must rebuild is this one."""
    kept: dict[str, ExtractionGenerated] = {}
    for event in events:
        if is_sample(event, parse_errors):
            kept.setdefault(str(event.event_id), event)
    return kept


@dataclass
class _Generation:
    event: ExtractionGenerated
    arrival: tuple[int, str]
    """What "oldest" means: the order of arrival, or (canonical) the generation's step and id."""
    trainings: set[int] = field(default_factory=set)
    """Extractor steps that trained on it."""
    outcomes_trained: int = 0
    """Outcomes its reward averaged when it was last trained."""


@dataclass(frozen=True)
class ExtractorBatch:
    event_ids: tuple[str, ...]
    samples: list[Sample]
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]
    outcome_counts: tuple[int, ...]
    weights: tuple[float, ...]


class ExtractorJoin:
    """Generations, the outcomes credited to them, and which were trained: all rebuilt from events."""

    def __init__(self, canonical: bool = False, parse_error_reward: float | None = None) -> None:
        """canonical: order samples by (step, generation id) rather than by arrival, so which generations form a
        batch does not depend on when they were read (deterministic mode).

        parse_error_reward: when set, a generation whose answer the parser rejected is a sample too, with this one
        outcome, known when it is read: its tokens are pushed down like those of a lesson that failed, so the
        answer format is not left to drift (otherwise nothing of a rejected answer is ever trained). Its outcome
        counts from the step after the one it distilled, by which the deterministic trainer has read every
        generation of that step."""
        self.canonical = canonical
        self.parse_error_reward = parse_error_reward
        self.generations: dict[str, _Generation] = {}  # by ExtractionGenerated event id
        self.by_generation_id: dict[str, str] = {}
        self.outcomes: dict[str, dict[str, float]] = {}  # generation id -> trajectory id -> +1 / -1
        self.trajectory_steps: dict[str, int] = {}  # trajectory id -> scheduler step, of those credited
        self.trained: dict[str, list[tuple[int, int]]] = {}  # event id -> [(step, outcomes)] seen before the event
        self.rejected: dict[str, int] = {}  # generation id of a rejected answer -> the step its outcome counts from
        self._arrivals = 0

    def add_extraction(self, event: ExtractionGenerated) -> None:
        if not is_sample(event, self.parse_error_reward is not None) or str(event.event_id) in self.generations:
            return  # only generations that produced experiences (or were rejected) are samples; copies count once
        key = str(event.event_id)
        self._arrivals += 1
        order = ((-1 if event.step is None else event.step, event.generation_id) if self.canonical
                 else (self._arrivals, ""))
        generation = _Generation(event, order)
        self.generations[key] = generation
        self.by_generation_id[event.generation_id] = key
        if event.parse_status == "parse_error" and self.parse_error_reward is not None:
            self.outcomes.setdefault(event.generation_id, {})[PARSE_ERROR] = self.parse_error_reward
            self.rejected[event.generation_id] = -1 if event.step is None else event.step + 1
        for step, outcomes in self.trained.pop(key, []):
            self._mark(generation, step, outcomes)

    def add_trajectory(self, trajectory: TrajectoryCompleted) -> None:
        if not trajectory.guided or trajectory.split != "train" or trajectory.env_error is not None:
            return  # evaluation episodes measure; they do not train; an engine failure says nothing of the lesson
        outcome = 1.0 if trajectory.success else -1.0
        self.trajectory_steps[trajectory.trajectory_id] = trajectory.step
        for generation_id in {ref.generation_id for ref in trajectory.retrieved}:
            self.outcomes.setdefault(generation_id, {})[trajectory.trajectory_id] = outcome

    def add_train_step(self, step: TrainStepCompleted) -> None:
        if step.role != "extractor":
            return
        counts = step.outcome_counts or (0,) * len(step.batch_event_ids)
        for event_id, outcomes in zip(step.batch_event_ids, counts, strict=True):
            generation = self.generations.get(event_id)
            if generation is None:
                self.trained.setdefault(event_id, []).append((step.step, outcomes))
            else:
                self._mark(generation, step.step, outcomes)

    @staticmethod
    def _mark(generation: _Generation, step: int, outcomes: int) -> None:
        if step not in generation.trainings:
            generation.trainings.add(step)
            generation.outcomes_trained = max(generation.outcomes_trained, outcomes)

    def _outcomes(self, generation_id: str, through: int | None) -> dict[str, float]:
        outcomes = self.outcomes.get(generation_id, {})
        if generation_id in self.rejected:
            # the trained copy was rejected: a later copy's lessons, credited under the same id, are not its own
            outcomes = {PARSE_ERROR: outcomes[PARSE_ERROR]}
        if through is None:
            return outcomes
        return {t: o for t, o in outcomes.items()
                if (self.rejected[generation_id] if t == PARSE_ERROR else self.trajectory_steps[t]) <= through}

    def ready(self, through: int | None = None) -> list[str]:
        """Samples with outcomes they were not trained on yet, oldest first; `through`: counting only the outcomes
        of episodes of that scheduler step and earlier (deterministic mode)."""
        ready = [(g.arrival, key) for key, g in self.generations.items()
                 if len(self._outcomes(g.event.generation_id, through)) > g.outcomes_trained]
        return [key for _, key in sorted(ready)]

    def batch(self, step: int, size: int, alpha: float, delta: int,
              through: int | None = None) -> ExtractorBatch | None:
        """The next batch for extractor step `step`, or None while fewer than `size` samples are ready (`through`: as
        in `ready`)."""
        ready = self.ready(through)
        if len(ready) < size:
            return None
        # the oldest `size`, in event-id order (canonical: (step, generation id) order; event ids carry the run id)
        chosen = ready[:size] if self.canonical else sorted(ready[:size])
        generations = [self.generations[key] for key in chosen]
        outcome_sets = [self._outcomes(g.event.generation_id, through) for g in generations]
        rewards = torch.tensor([statistics.fmean(o.values()) for o in outcome_sets])
        weights = training_count_weights(
            torch.tensor([len(g.trainings) for g in generations]),
            torch.tensor([step - max(g.trainings) if g.trainings else NEVER_TRAINED for g in generations]),
            alpha, delta,
        )
        advantages = batch_mean_advantages(rewards) * weights
        samples = extractor_samples([g.event for g in generations], advantages.tolist())
        return ExtractorBatch(tuple(chosen), samples, tuple(rewards.tolist()), tuple(advantages.tolist()),
                              tuple(len(o) for o in outcome_sets), tuple(weights.tolist()))
