"""Scheduler: the run's clock. It announces the run, issues each step's GRPO groups, requests merges, schedules
evaluation, and closes the run.

    crl worker scheduler --run-dir runs/demo        # CRL_CONFIG=configs/tiny-minihack-room.yaml for a run config

In order:
1. `RunStarted` with the resolved settings and the code version.
2. Per step s (0 .. steps-1): `groups_per_step` task groups drawn from the mixture (`draw_tasks`), each `group_size`
   `EpisodeAssigned` slots sharing the task's seed; the first half of a group is guided after the warm-up steps, none
   is during warm-up or in the `grpo` arm. Before issuing step s it waits until
   - the actor has published version `s - warmup - staleness` (the staleness bound; `exp_only` never waits), and
   - every train episode of step `s - 1 - max_steps_ahead` has finished (bounds the queue), and
   - (step 0, every arm with a bank) the extractor has published its version 0, so the warm-up fills the bank.
   Every `merge_every` steps it publishes `MergeRequested` first; every `eval_every` steps (and after the last) it
   adds evaluation groups on the fixed eval pool: one guided and one free slot per task (`grpo`: one free). Step 0's
   evaluation, the baseline, is issued first and played before its train groups are issued, so it is played by
   actor version 0 with an empty bank in every mode.
   Deterministic mode (`scheduler.deterministic`, docs/determinism.md) adds a barrier: step s is issued only once
   every episode of step s - 1 (evaluation included) finished, the merge due after s - 1 was requested, and the
   extractor published `StepSettled` for s - 1; its slots carry that event's `bank_offset` as `bank_position`, the
   bank their guided episodes are served from.
3. `RunFinished` once every scheduled episode has a `TrajectoryCompleted`, with the run's rollout metrics; or early
   (status `stopped`) on `StopRequested`.

Restart: every event it publishes has an id derived from (run, what, step, group, slot) and every draw is a pure
function of the settings and the step, so a restarted scheduler reads what is already on `crl.runs`, `crl.tasks` and
`crl.control`, publishes only what is missing — the same events — and carries on: no step is issued twice or skipped.
Its view of policies and finished episodes is rebuilt by reading `crl.policy` and `crl.trajectories` from offset 0.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from pipeline.actor.metrics import episode_metrics, summary_line
from pipeline.actor.schedule import finished_id, scheduled_id
from pipeline.actor.settings import ARMS_WITH_A_BANK
from pipeline.envs.registry import env_spec
from pipeline.provenance import code_version, resolved_config
from pipeline.runtime.context import WorkerContext
from pipeline.runtime.log import events_to_end
from pipeline.runtime.offsets import FromTheStart
from pipeline.runtime.runner import Origin, Worker, WorkerIO
from pipeline.runtime.transport import OffsetStore
from schemas.base import Event, Producer
from schemas.runs import MergeRequested, RunFinished, RunResumed, RunStarted, StepSettled, StopRequested
from schemas.tasks import EpisodeAssigned
from schemas.topics import CONTROL, POLICY, RUNS, TASKS, TRAIN_STEPS, TRAJECTORIES
from schemas.training import PolicyPublished
from schemas.trajectories import TrajectoryCompleted

log = logging.getLogger(__name__)

@dataclass
class _StepRecord:
    train_ids: set[uuid.UUID] = field(default_factory=set)
    eval_ids: set[uuid.UUID] = field(default_factory=set)
    reported: bool = False
    eval_reported: bool = False


class Scheduler(Worker):
    name = "scheduler"
    consumes = (POLICY, TRAJECTORIES, CONTROL, TRAIN_STEPS)
    consumption = "assign"
    produces = (RUNS, CONTROL, TASKS)
    clock = True

    def __init__(self, context: WorkerContext) -> None:
        self.settings = context.settings
        self.schedule = context.settings.schedule()
        self.log = context.log
        self.run_id = context.settings.resolved_run_id
        self.producer = Producer(worker=self.name, instance=context.instance)
        self.actor_version = -1
        self.extractor_version = -1
        self.finished: dict[uuid.UUID, TrajectoryCompleted] = {}
        self.steps: dict[int, _StepRecord] = {}
        self.stop_request: StopRequested | None = None
        self.last_eval: dict[str, float] = {}
        self.on_log: set[uuid.UUID] = set()
        """Ids of what this run's scheduler already published (read back at start, then added as it publishes)."""
        self.next_step = 0
        self.run_finished = False
        self.attempt = 0
        """How many times the run was resumed (`RunResumed` on crl.control, counted at start)."""
        self.resumes_seen = 0
        """`RunResumed` events handled so far: a `StopRequested` is in force only after the last of them."""
        self._last_wait_log = 0.0
        self.deterministic = context.settings.scheduler.deterministic
        self.settled: dict[int, StepSettled] = {}
        """Deterministic mode: the extractor's `StepSettled` by step."""

    @classmethod
    def build(cls, context: WorkerContext) -> Scheduler:
        return cls(context)

    def offset_store(self, context: WorkerContext) -> OffsetStore:
        return FromTheStart()

    @property
    def done(self) -> bool:
        return self.run_finished

    # -- the schedule ---------------------------------------------------------------------------------------------

    def start(self, io: WorkerIO) -> None:
        ours = [e for topic in (RUNS, TASKS, CONTROL) for e in events_to_end(self.log, topic)
                if e.run_id == self.run_id]
        self.on_log = {e.event_id for e in ours}
        self.attempt = sum(1 for e in ours if isinstance(e, RunResumed))
        if self._finished_id() in self.on_log:
            log.info("run %s already finished; nothing to schedule", self.run_id)
            self.run_finished = True
            return
        started = RunStarted(event_id=scheduled_id(self.run_id, "started"), run_id=self.run_id,
                             producer=self.producer, config=resolved_config(self.settings),
                             code_version=code_version())
        self._publish_missing(io, [started])

    def handle(self, event: Event, origin: Origin) -> list[Event]:
        if event.run_id != self.run_id:
            return []
        if isinstance(event, PolicyPublished) and event.role == "actor":
            self.actor_version = max(self.actor_version, event.version)
        elif isinstance(event, PolicyPublished):
            self.extractor_version = max(self.extractor_version, event.version)
        elif isinstance(event, TrajectoryCompleted):
            self.finished.setdefault(uuid.UUID(event.assignment_event_id), event)
        elif isinstance(event, RunResumed):
            self.resumes_seen += 1
            self.stop_request = None  # a stop before a resume ended the previous attempt, not this one
        elif isinstance(event, StopRequested) and self.resumes_seen >= self.attempt:
            self.stop_request = event
        elif isinstance(event, StepSettled) and event.role == "extractor":
            self.settled.setdefault(event.step, event)
        return []

    def after_poll(self, io: WorkerIO) -> None:
        """Issue every step that is due, in order; close the run once every episode is in (or on a stop)."""
        if self.run_finished:
            return
        self._report()
        total = self.settings.scheduler.steps
        if self.stop_request is not None:
            return self._finish(io, "stopped", self.next_step)
        while self.next_step < total:
            step = self.next_step
            planned = self._planned(step)
            if not all(e.event_id in self.on_log for e in planned):  # else issued before a restart
                if not self._ready(step) or (self.deterministic and not self._settled(io, step, planned)):
                    return self._waiting(f"step {step}")
                if step == 0 and not self._baseline_finished(io, planned):
                    return self._waiting("the step-0 evaluation (actor version 0, an empty bank)")
                self._publish_missing(io, self._planned(step))  # deterministic: now with its bank position
                train = [e for e in planned if isinstance(e, EpisodeAssigned) and e.split == "train"]
                log.info("step %d issued: %d train episodes (%d guided), %d eval episodes, actor version >= %d%s",
                         step, len(train), sum(e.guided for e in train), len(self.steps[step].eval_ids),
                         self.schedule.required_version(step),
                         ", merge requested" if any(isinstance(e, MergeRequested) for e in planned) else "")
            self.next_step += 1
        if not self._all_finished():
            return self._waiting("the last episodes")
        self._finish(io, "completed", total)

    def _planned(self, step: int) -> list[Event]:
        """What step `step` publishes: a merge request if due, its train groups, its evaluation if due."""
        position = self._bank_position(step)
        train = self.schedule.train_assignments(self.run_id, self.producer, step, position)
        evaluation = self.schedule.eval_assignments(self.run_id, self.producer, step, position) \
            if self.schedule.eval_due(step) else []
        record = self.steps.setdefault(step, _StepRecord())
        record.train_ids = {e.event_id for e in train}
        record.eval_ids = {e.event_id for e in evaluation}
        merge = [MergeRequested(
            event_id=scheduled_id(self.run_id, "merge", step - 1), run_id=self.run_id, producer=self.producer,
            merge_id=f"{self.run_id}-merge-{step - 1:06d}", step=step - 1,
            task_families=tuple(sorted({env_spec(t.env_id).task_family for t in self.settings.envs.tasks})),
        )] if self.schedule.merge_due(step) else []
        return [*merge, *train, *evaluation]

    def _baseline_finished(self, io: WorkerIO, planned: list[Event]) -> bool:
        """Step 0's evaluation is the baseline every later one is compared with, so it is played before anything
        else: its episodes are issued first and step 0's train groups only once they all finished. Then no actor
        version but 0 exists yet (the first is trained on step `warmup`), and nothing has been distilled (evaluation
        episodes never are), so it measures the warm-started actor with an empty bank, in every mode."""
        evaluation: list[Event] = [e for e in planned if isinstance(e, EpisodeAssigned) and e.split == "eval"]
        self._publish_missing(io, evaluation)
        return self._done({e.event_id for e in evaluation})

    def _bank_position(self, step: int) -> int | None:
        """Deterministic mode: the op-log offset step `step` is served at, the end of the log once the extractor
        settled step - 1 (None before that is known, for step 0, whose bank is empty, and outside the mode)."""
        settled = self.settled.get(step - 1) if self.deterministic else None
        return settled.bank_offset if settled is not None else None

    def _settled(self, io: WorkerIO, step: int, planned: list[Event]) -> bool:
        """Deterministic mode's barrier before `step`: every episode of the step before finished; then the merge due
        is requested (the extractor runs it after distilling that step) and the extractor settled that step."""
        if step == 0:
            return True
        before = self.steps[step - 1]
        if not self._done(before.train_ids | before.eval_ids):
            return False
        merge: list[Event] = [e for e in planned if isinstance(e, MergeRequested) and e.event_id not in self.on_log]
        if merge:
            self._publish_missing(io, merge)
        return self.settings.scheduler.arm not in ARMS_WITH_A_BANK or step - 1 in self.settled

    def _waiting(self, what: str) -> None:
        now = time.monotonic()
        if now - self._last_wait_log > 30:
            self._last_wait_log = now
            log.info("waiting for %s: actor version %d, %d episodes finished", what, self.actor_version,
                     len(self.finished))

    def _ready(self, step: int) -> bool:
        needed = self.schedule.required_version(step)
        if needed > 0 and self.actor_version < needed:
            return False
        if step == 0 and self.settings.scheduler.arm != "grpo" and self.extractor_version < 0:
            return False  # the warm-up steps fill the bank: nothing is distilled before the extractor's version 0
        earlier = step - 1 - self.settings.scheduler.max_steps_ahead
        return earlier < 0 or self._done(self.steps[earlier].train_ids)

    def _all_finished(self) -> bool:
        return all(self._done(r.train_ids | r.eval_ids) for r in self.steps.values())

    def _done(self, ids: set[uuid.UUID]) -> bool:
        return all(i in self.finished for i in ids)

    def _report(self) -> None:
        for step, record in sorted(self.steps.items()):
            if not record.reported and record.train_ids and self._done(record.train_ids):
                record.reported = True
                metrics = episode_metrics([self.finished[i] for i in record.train_ids], "train")
                log.info("step %d train episodes: %s", step, summary_line(metrics, "train"))
            if not record.eval_reported and record.eval_ids and self._done(record.eval_ids):
                record.eval_reported = True
                self.last_eval = episode_metrics([self.finished[i] for i in record.eval_ids], "eval")
                log.info("step %d evaluation: %s", step, summary_line(self.last_eval, "eval"))

    def _publish_missing(self, io: WorkerIO, events: list[Event]) -> None:
        for event in events:
            if event.event_id not in self.on_log:
                io.publish(event)
                self.on_log.add(event.event_id)
        io.commit()

    def _finished_id(self) -> uuid.UUID:
        return finished_id(self.run_id, self.attempt)

    def _finish(self, io: WorkerIO, status: str, steps_completed: int) -> None:
        """`RunFinished`. Only a `StopRequested` stops the run early: a signal stops this process, and a restarted
        scheduler carries on with the same schedule."""
        train = [t for t in self.finished.values() if t.split == "train"]
        metrics = {**episode_metrics(train, "train"), **self.last_eval}
        reason = self.stop_request.reason if status == "stopped" and self.stop_request is not None else None
        self.run_finished = True
        io.publish(RunFinished(event_id=self._finished_id(), run_id=self.run_id,
                               producer=self.producer, status=status, steps_completed=steps_completed,
                               reason=reason, metrics=metrics))
        io.commit()
        log.info("run %s %s after %d steps: %s", self.run_id, status, steps_completed,
                 summary_line(metrics, "train"))
