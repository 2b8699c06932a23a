"""What a run has done so far, from the log: every topic followed from offset 0 in a thread (`LogFollower`) and
folded into `RunProgress` (the trainers' warm starts, step, episodes assigned and finished per step, success of
guided and free episodes, when each train step's episodes had all finished, evaluation, bank size and op mix under the
bank's own rules, parse statuses, extractor reward, versions)."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from pipeline.actor.schedule import finished_id
from pipeline.bank.state import Applied, BankState, Rejected
from pipeline.runtime.blobs import BlobStore
from pipeline.runtime.log import FollowedView, KafkaLog
from pipeline.runtime.transport import Record
from pipeline.settings import Settings
from schemas.base import Role, Split
from schemas.codec import EventDecodeError, decode
from schemas.experiences import ExperienceAdded, ExperienceMerged, ExperienceRefined, ExperienceRetired
from schemas.extractions import ExtractionGenerated
from schemas.runs import RunFinished, RunStarted
from schemas.tasks import EpisodeAssigned
from schemas.topics import TOPICS
from schemas.training import PolicyPublished, TrainStepCompleted, WarmStartProgressed
from schemas.trajectories import TrajectoryCompleted


@dataclass
class RunProgress:
    """Everything the live view shows, from the records of every topic (read from offset 0)."""

    run_id: str
    attempt: int = 0
    """Which attempt this is (`crl run --resume` counts up): only its own `RunFinished` ends the view."""
    started: RunStarted | None = None
    finished: RunFinished | None = None
    step_issued: int = -1
    actor_version: int = 0
    extractor_version: int = 0
    train: dict[int, list[TrajectoryCompleted]] = field(default_factory=lambda: defaultdict(list))
    evaluation: dict[int, list[TrajectoryCompleted]] = field(default_factory=lambda: defaultdict(list))
    bank: BankState = field(default_factory=BankState)
    ops: Counter[str] = field(default_factory=Counter)
    parse: Counter[str] = field(default_factory=Counter)
    extractor_reward: float | None = None
    actor_loss: float | None = None
    warm: dict[Role, WarmStartProgressed] = field(default_factory=dict)
    """Each trainer's newest warm-start progress."""
    warm_base: dict[Role, WarmStartProgressed] = field(default_factory=dict)
    """Each trainer's first progress of its current fine-tuning phase, to measure its step rate from."""
    assigned: dict[tuple[int, Split], set[str]] = field(default_factory=lambda: defaultdict(set))
    """Per (step, split): the event ids of its `EpisodeAssigned`s."""
    played: dict[tuple[int, Split], set[str]] = field(default_factory=lambda: defaultdict(set))
    """Per (step, split): the assignments whose episode finished (a replayed episode counts once)."""
    step_finished: dict[int, datetime] = field(default_factory=dict)
    """Train step -> when the last of its episodes finished (`occurred_at`)."""
    step_started: dict[int, datetime] = field(default_factory=dict)
    """Train step -> when its first episode was assigned."""
    records: int = 0
    last_record: float = field(default_factory=time.time)

    def add(self, event: object, offset: int) -> None:
        if getattr(event, "run_id", self.run_id) != self.run_id:
            return
        if isinstance(event, RunStarted):
            self.started = event
        elif isinstance(event, RunFinished) and event.event_id == finished_id(self.run_id, self.attempt):
            self.finished = event
        elif isinstance(event, EpisodeAssigned):
            self.step_issued = max(self.step_issued, event.step)
            self.assigned[(event.step, event.split)].add(str(event.event_id))
            if event.split == "train":
                self.step_started.setdefault(event.step, event.occurred_at)
                self._check_step_finished(event.step)
        elif isinstance(event, TrajectoryCompleted):
            played = self.played[(event.step, event.split)]
            if event.assignment_event_id in played:
                return  # the same episode again (re-delivered after a stop): counted once
            played.add(event.assignment_event_id)
            (self.train if event.split == "train" else self.evaluation)[event.step].append(event)
            if event.split == "train":
                self._check_step_finished(event.step)
        elif isinstance(event, WarmStartProgressed):
            previous = self.warm.get(event.role)
            if event.phase == "train" and (previous is None or previous.phase != "train"):
                self.warm_base[event.role] = event
            self.warm[event.role] = event
        elif isinstance(event, ExtractionGenerated):
            self.parse[event.parse_status] += 1
        elif isinstance(event, ExperienceAdded | ExperienceRefined | ExperienceMerged | ExperienceRetired):
            outcome = self.bank.apply(event, offset)
            if isinstance(outcome, Applied):
                self.ops[event.kind.removeprefix("Experience").lower()] += 1
            elif isinstance(outcome, Rejected):
                self.ops["rejected"] += 1
        elif isinstance(event, PolicyPublished):
            if event.role == "actor":
                self.actor_version = max(self.actor_version, event.version)
            else:
                self.extractor_version = max(self.extractor_version, event.version)
        elif isinstance(event, TrainStepCompleted):
            if event.role == "extractor":
                self.extractor_reward = event.metrics.get("extractor/reward_mean")
            else:
                self.actor_loss = event.loss

    def _check_step_finished(self, step: int) -> None:
        """A train step has finished once the episodes played are exactly those assigned: checked on both kinds of
        record, since one read of several topics may bring a step's trajectories before its assignments. It finished
        when the last of its episodes did."""
        played, assigned = self.played[(step, "train")], self.assigned[(step, "train")]
        if step not in self.step_finished and assigned and played == assigned:
            self.step_finished[step] = max(t.occurred_at for t in self.train[step])

    @staticmethod
    def _success(trajectories: list[TrajectoryCompleted], guided: bool) -> float | None:
        chosen = [t.success for t in trajectories if t.guided == guided]
        return sum(chosen) / len(chosen) if chosen else None

    def latest(self, table: dict[int, list[TrajectoryCompleted]]) -> tuple[int | None, float | None, float | None]:
        """(step, guided success, free success) of the newest step with episodes in `table`."""
        if not table:
            return None, None, None
        step = max(table)
        return step, self._success(table[step], True), self._success(table[step], False)

    def families(self, table: dict[int, list[TrajectoryCompleted]]) -> dict[str, tuple[float | None, float | None]]:
        """Task family -> (guided success, free success) over the newest step with episodes in `table`."""
        if not table:
            return {}
        newest = table[max(table)]
        return {family: (self._success([t for t in newest if t.task_family == family], True),
                         self._success([t for t in newest if t.task_family == family], False))
                for family in sorted({t.task_family for t in newest})}

    def episodes(self, step: int, split: Split) -> tuple[int, int]:
        """(episodes finished, episodes assigned) of a step's split."""
        return len(self.played.get((step, split), ())), len(self.assigned.get((step, split), ()))

    def step_seconds(self, recent: int = 3) -> float | None:
        """Mean seconds per train step over the newest `recent` finished steps: from one step's last episode to the
        next's (the first finished step: from its first assignment); None before any step has finished."""
        finished = sorted(self.step_finished)
        if not finished:
            return None
        durations = [(self.step_finished[b] - self.step_finished[a]).total_seconds()
                     for a, b in itertools.pairwise(finished)]
        if not durations and finished[0] in self.step_started:
            durations = [(self.step_finished[finished[0]] - self.step_started[finished[0]]).total_seconds()]
        durations = [d for d in durations[-recent:] if d >= 0]
        return sum(durations) / len(durations) if durations else None

    def warm_start_seconds_left(self) -> float | None:
        """Seconds until every warm start is done, from each one's own step rate in its fine-tuning phase; None while
        one has not measured its rate yet (still playing its data episodes, or no step taken)."""
        left = 0.0
        for role, latest in self.warm.items():
            if latest.phase == "done":
                continue
            base = self.warm_base.get(role)
            if latest.phase != "train" or base is None or latest.done <= base.done:
                return None
            per_step = (latest.elapsed_s - base.elapsed_s) / (latest.done - base.done)
            left = max(left, per_step * (latest.total - latest.done))
        return left

    @property
    def bank_size(self) -> int:
        return sum(1 for _ in self.bank.active())


class LogFollower(FollowedView):
    """Follows every partition of every topic from offset 0 (`pipeline.runtime.log`) and feeds `RunProgress`."""

    def __init__(self, settings: Settings, progress: RunProgress) -> None:
        self.progress = progress
        self.lock = threading.Lock()
        self._topics = {topic.name: topic for topic in TOPICS}
        self._blobs = BlobStore(settings.run_dir / "blobs")
        self.follower = KafkaLog(settings.kafka, client_id="crl-run").follow(TOPICS, self._on_record, name="run")

    def _on_record(self, record: Record) -> None:
        try:
            event = decode(self._topics[record.topic], record.value, blobs=self._blobs)
        except EventDecodeError:
            return  # a dead letter's business, not the live view's
        with self.lock:
            self.progress.add(event, record.offset)
            self.progress.records += 1
            self.progress.last_record = time.time()
