"""What an experiment tracker shows of a run, as a fold over the run's events: namespaced scalars and texts against
the step (`RunTracking`).

The tracker worker (`workers/tracker.py`) feeds it the records it reads live; `crl track` feeds it an archive. The
two read the topics interleaved differently, so nothing here depends on the order across topics: an entry is emitted
once the events it is computed from are all in, and then it never changes. Within a partition both see the log's
order, and where an event was written twice (a retry, a replayed episode) the first one counts, as for every other
reader. So a live tracker and `crl track` of the same run write the same entries.

Every tag, its step axis and its source are listed in docs/tracking.md.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.actor.schedule import Schedule, trajectory_event_id
from pipeline.actor.settings import SchedulerSettings
from pipeline.bank.state import Applied, BankState, Rejected
from pipeline.envs.settings import EnvSettings
from pipeline.extractor.ops import generation_event_id
from pipeline.extractor.protocol import distill_generation_id
from pipeline.rl.settings import ActorTrainerSettings
from schemas.base import Event, Producer
from schemas.experiences import ExperienceAdded, ExperienceMerged, ExperienceRefined, ExperienceRetired
from schemas.extractions import ExtractionGenerated
from schemas.runs import RunStarted
from schemas.training import TrainStepCompleted, WarmStartProgressed
from schemas.trajectories import TrajectoryCompleted

METRIC_ALIASES = {"clip_fraction": "clip_frac", "reward_mean": "reward"}
"""Trainer metric names shown under the shorter names trackers' users know (PPO's `clip_frac`,
`train/extractor/reward`)."""

_TRACKER = Producer(worker="tracker", instance="tracker")
"""Stands in for the scheduler when the tracker recomputes the ids of a step's assignments (ids do not depend on
who publishes them)."""

_OP_KINDS = {ExperienceAdded: "add", ExperienceRefined: "refine", ExperienceMerged: "merge",
             ExperienceRetired: "retire"}


@dataclass(frozen=True)
class Scalar:
    tag: str
    step: int
    value: float
    wall_time: float
    """Seconds since the epoch: when the newest event the value is computed from was made (not when it was read)."""


@dataclass(frozen=True)
class Text:
    tag: str
    step: int
    text: str
    wall_time: float


@dataclass(frozen=True)
class Histogram:
    tag: str
    step: int
    values: tuple[float, ...]
    wall_time: float

    def summary(self) -> tuple[float, float, float, float]:
        """(count, sum, min, max): what every backend's reader gives back of a histogram."""
        return (float(len(self.values)), float(sum(self.values)), float(min(self.values)), float(max(self.values)))


Entry = Scalar | Text | Histogram

_ENTRY_KINDS = {Scalar: "scalar", Text: "text", Histogram: "histogram"}


def entry_key(entry: Entry) -> str:
    """What identifies an entry across restarts: its kind, tag and step (a tracker writes each one once)."""
    return f"{_ENTRY_KINDS[type(entry)]}\t{entry.tag}\t{entry.step}"


HPARAM_SECTIONS = ("scheduler", "envs", "actor_trainer", "extractor_trainer", "rollout", "extractor", "bank",
                   "retrieval", "embedding")
"""The sections of a run's settings that say what was run (not where: brokers, databases, paths, tracking)."""


def hparams(config: dict[str, Any]) -> dict[str, str | float | bool]:
    """A run's settings as flat hyperparameters for comparing runs (TensorBoard's HParams, MLflow's params): every
    leaf of `HPARAM_SECTIONS` under its dotted name, lists as their JSON text, None as "none"."""
    flat: dict[str, str | float | bool] = {}

    def walk(value: Any, name: str) -> None:
        if isinstance(value, dict):
            for key in sorted(value):
                walk(value[key], f"{name}.{key}")
        elif isinstance(value, bool | str):
            flat[name] = value
        elif isinstance(value, int | float):
            flat[name] = float(value)
        elif value is None:
            flat[name] = "none"
        else:
            flat[name] = json.dumps(value, sort_keys=True)

    for section in HPARAM_SECTIONS:
        if section in config:
            walk(config[section], section)
    return flat


def _wall(event: Event) -> float:
    return event.occurred_at.timestamp()


def _mean(values: Iterable[float]) -> float | None:
    chosen = list(values)
    return statistics.fmean(chosen) if chosen else None


def _metric_name(name: str) -> str:
    return METRIC_ALIASES.get(name, name)


def schedule_from(started: RunStarted) -> Schedule:
    """The run's schedule as `RunStarted` recorded its settings (the same function of them the scheduler used)."""
    config = started.config
    return Schedule.of(SchedulerSettings.model_validate(config.get("scheduler", {})),
                       EnvSettings.model_validate(config.get("envs", {})),
                       ActorTrainerSettings.model_validate(config.get("actor_trainer", {})))


@dataclass
class _Step:
    """One (split, step) of the schedule: the trajectory ids it will have, and those that arrived (first wins)."""

    expected: frozenset[str]
    seen: set[str] = field(default_factory=set)
    held: list[TrajectoryCompleted] = field(default_factory=list)
    """The episodes that arrived, until the step's entries are out (a run's episodes carry every token id)."""
    emitted: bool = False
    wall: float = 0.0
    """When its newest episode was made (set once the step is complete)."""
    samples: list[TrajectoryCompleted] = field(default_factory=list)
    """The episodes shown as text, kept until the bank they were served from is known."""

    @property
    def complete(self) -> bool:
        return len(self.seen) == len(self.expected)

    def episodes(self) -> list[TrajectoryCompleted]:
        """The step's episodes in schedule order (group, slot), whatever order they arrived in."""
        return sorted(self.held, key=lambda t: (t.group_id, t.slot))


@dataclass(frozen=True)
class _AppliedOp:
    offset: int
    label: str
    """add | refine | merge | retire | rejected."""
    active_after: int
    summary: str


class RunTracking:
    """The fold: `add` each event (with its topic and offset) and get back the entries that became final."""

    def __init__(self, run_id: str | None = None, samples_per_step: int = 2) -> None:
        self.run_id = run_id
        self.samples_per_step = samples_per_step
        self.started: RunStarted | None = None
        self.schedule: Schedule | None = None
        self.steps: dict[tuple[str, int], _Step] = {}
        self._early: list[TrajectoryCompleted] = []
        """Episodes read before `RunStarted` (another partition may be read first): placed once it arrives."""
        self.train_steps: set[tuple[str, int]] = set()
        self.bank = BankState()
        self.ops: list[_AppliedOp] = []
        self.ops_read_to = 0
        """One past the newest op offset read."""
        self.active = 0
        self.parse: dict[str, tuple[str, float]] = {}
        """Generation event id -> (parse status, when it was made) of its first copy."""
        self.generations: dict[str, tuple[str, str]] = {}
        """Generation event id -> (generation id, its text) of its first copy, until its step's entries are out."""
        self._distilled: dict[int, frozenset[str]] = {}
        """Scheduler step -> the generation ids distilling its train episodes, until all are read."""
        self._bank_cuts: dict[int, int] = {}
        """Scheduler step -> the op offset its bank stopped at (once its train episodes are all in)."""
        self._last_cut = 0
        self._warm_steps: set[tuple[str, int]] = set()

    # -- the fold -------------------------------------------------------------------------------------------------

    def add(self, event: Event, offset: int) -> list[Entry]:
        if self.run_id is None and isinstance(event, RunStarted):
            self.run_id = event.run_id
        if self.run_id is not None and event.run_id != self.run_id:
            return []
        if isinstance(event, RunStarted):
            return self._started(event)
        if isinstance(event, TrajectoryCompleted):
            return self._trajectory(event)
        if isinstance(event, TrainStepCompleted):
            return self._train_step(event)
        if isinstance(event, ExtractionGenerated):
            self.parse.setdefault(str(event.event_id), (event.parse_status, _wall(event)))
            self.generations.setdefault(str(event.event_id), (event.generation_id, generation_text(event)))
            return self._parse_entries()
        if isinstance(event, ExperienceAdded | ExperienceRefined | ExperienceMerged | ExperienceRetired):
            self._op(event, offset)
            return self._bank_entries()
        return self._other(event)

    def _other(self, event: Event) -> list[Entry]:
        """The warm start's loss against its own step (each step once: a restarted warm start repeats them)."""
        if not isinstance(event, WarmStartProgressed) or event.loss is None or event.phase == "data":
            return []
        key = (event.role, event.done)
        if key in self._warm_steps:
            return []
        self._warm_steps.add(key)
        return [Scalar(f"warm_start/{event.role}/loss", event.done, event.loss, _wall(event))]

    def _started(self, event: RunStarted) -> list[Entry]:
        if self.started is not None:
            return []
        self.started = event
        self.schedule = schedule_from(event)
        early, self._early = self._early, []
        entries: list[Entry] = [Text("run/config", 0, "```\n" + json.dumps(event.config, indent=2, sort_keys=True)
                                     + "\n```", _wall(event))]
        for trajectory in early:
            entries += self._trajectory(trajectory)
        return entries

    # -- episodes ---------------------------------------------------------------------------------------------------

    def _step(self, split: str, step: int) -> _Step:
        key = (split, step)
        if key not in self.steps:
            assert self.schedule is not None and self.run_id is not None
            planned = (self.schedule.train_assignments(self.run_id, _TRACKER, step) if split == "train"
                       else self.schedule.eval_assignments(self.run_id, _TRACKER, step))
            self.steps[key] = _Step(frozenset(str(trajectory_event_id(str(a.event_id))) for a in planned))
        return self.steps[key]

    def _trajectory(self, event: TrajectoryCompleted) -> list[Entry]:
        if self.schedule is None:
            self._early.append(event)
            return []
        record = self._step(event.split, event.step)
        event_id = str(event.event_id)
        if event_id not in record.expected or event_id in record.seen:
            return []  # not this schedule's (another attempt's config) or a replayed episode: the first counts
        record.seen.add(event_id)
        record.held.append(event)
        if not record.complete or record.emitted:
            return []
        record.emitted = True
        episodes = record.episodes()
        record.wall = max(_wall(t) for t in episodes)
        entries = self._episode_scalars(event.split, event.step, episodes)
        if event.split == "train":
            chosen = [t for t in episodes if t.guided][: self.samples_per_step]
            record.samples = chosen + [t for t in episodes if not t.guided][: self.samples_per_step]
            offsets = [t.bank_offset for t in episodes if t.bank_offset is not None]
            if offsets:
                # Samples show the experiences served: they wait until the ops up to that bank have been read.
                self._bank_cuts[event.step] = max(offsets)
            else:
                entries += self._samples(event.step, record)
            distilled = self._distilled_ids(episodes)
            if distilled:
                self._distilled[event.step] = distilled
                entries += self._parse_entries()
        record.held = []
        return entries + self._bank_entries()

    def _episode_scalars(self, split: str, step: int, episodes: Sequence[TrajectoryCompleted]) -> list[Entry]:
        prefix = "rollout" if split == "train" else "eval"
        wall = max(_wall(t) for t in episodes)
        entries = self._success_scalars(prefix, step, episodes, wall)
        if split == "train":
            for name, values in (("reward_mean", [t.reward for t in episodes]),
                                 ("turns_mean", [float(len(t.turns)) for t in episodes]),
                                 ("invalid_actions_mean", [float(t.invalid_actions) for t in episodes])):
                entries.append(Scalar(f"{prefix}/{name}", step, statistics.fmean(values), wall))
        families = sorted({t.task_family for t in episodes})
        if len(families) > 1:
            for family in families:
                entries += self._success_scalars(f"{prefix}/{family}", step,
                                                 [t for t in episodes if t.task_family == family], wall)
        return entries

    @staticmethod
    def _success_scalars(prefix: str, step: int, episodes: Sequence[TrajectoryCompleted],
                         wall: float) -> list[Entry]:
        entries: list[Entry] = [Scalar(f"{prefix}/episodes", step, float(len(episodes)), wall),
                                Scalar(f"{prefix}/success", step, statistics.fmean(t.success for t in episodes), wall)]
        for kind, guided in (("guided", True), ("free", False)):
            rate = _mean(float(t.success) for t in episodes if t.guided == guided)
            if rate is not None:
                entries.append(Scalar(f"{prefix}/success_{kind}", step, rate, wall))
        return entries

    def _samples(self, step: int, record: _Step) -> list[Entry]:
        """The first `samples_per_step` guided and free episodes of the step, as text."""
        chosen, record.samples = record.samples, []
        if not chosen:
            return []
        text = "\n\n---\n\n".join(self._episode_text(t) for t in chosen)
        return [Text("rollout/samples", step, text, max(_wall(t) for t in chosen))]

    def _episode_text(self, episode: TrajectoryCompleted) -> str:
        served = [self._served_text(ref.experience_id, ref.version) for ref in episode.retrieved]
        first = episode.turns[0].observation if episode.turns else ""
        actions = ", ".join(turn.action for turn in episode.turns) or "(none)"
        outcome = "success" if episode.success else "failure"
        return (f"**{episode.group_id} slot {episode.slot}** ({'guided' if episode.guided else 'free'}, "
                f"{episode.env_id} seed {episode.seed}, actor v{episode.policy_version})\n\n"
                f"goal: {episode.goal}\n\n"
                f"served experience: {' | '.join(served) if served else '(none)'}\n\n"
                f"first observation:\n\n```\n{first}\n```\n\n"
                f"actions: {actions}\n\n"
                f"outcome: {outcome}, reward {episode.reward:g}, {len(episode.turns)} turns")

    def _served_text(self, experience_id: str, version: int) -> str:
        experience = self.bank.experiences.get(experience_id)
        if experience is not None:
            for written in experience.history:
                if written.version == version:
                    return f"{experience_id} v{version}: {written.text}"
        return f"{experience_id} v{version}"

    # -- the bank ---------------------------------------------------------------------------------------------------

    def _op(self, op: ExperienceAdded | ExperienceRefined | ExperienceMerged | ExperienceRetired,
            offset: int) -> None:
        if offset < self.ops_read_to:
            return  # read again (a restored log's duplicate): the bank saw it once
        self.ops_read_to = offset + 1
        candidates = [op.experience_id, *([s.experience_id for s in op.sources]
                                          if isinstance(op, ExperienceMerged) else [])]
        before = sum(1 for i in candidates if i in self.bank.experiences and self.bank.experiences[i].active)
        outcome = self.bank.apply(op, offset)
        if isinstance(outcome, Applied):
            after = sum(1 for i in candidates if i in self.bank.experiences and self.bank.experiences[i].active)
            self.active += after - before
            label = _OP_KINDS[type(op)]
            summary = f"{label} {op.experience_id}: {getattr(op, 'text', None) or getattr(op, 'reason', '')}"
        elif isinstance(outcome, Rejected):
            label, summary = "rejected", f"rejected {op.experience_id}: {outcome.reason}"
        else:
            return  # a duplicate op changes nothing
        self.ops.append(_AppliedOp(offset, label, self.active, summary))

    def _bank_entries(self) -> list[Entry]:
        """Bank scalars and texts of the steps whose bank the ops read so far reach, in step order, each once every
        step before it is complete (so the ops "written" since the step before are the same whatever was read
        first)."""
        entries: list[Entry] = []
        for step in sorted(self._bank_cuts):
            cut = self._bank_cuts[step]
            earlier = [self.steps.get(("train", s)) for s in range(step)]
            if cut > self.ops_read_to or not all(record is not None and record.emitted for record in earlier):
                break
            del self._bank_cuts[step]
            record = self.steps[("train", step)]
            applied = [op for op in self.ops if op.offset < cut]
            counts = Counter(op.label for op in applied)
            entries.append(Scalar("bank/size", step, float(applied[-1].active_after if applied else 0), record.wall))
            entries.append(Scalar("bank/offset", step, float(cut), record.wall))
            for label in ("add", "refine", "merge", "retire", "rejected"):
                entries.append(Scalar(f"bank/ops/{label}", step, float(counts[label]), record.wall))
            written = [op.summary for op in applied if op.offset >= self._last_cut]
            self._last_cut = max(self._last_cut, cut)
            if written:
                entries.append(Text("bank/written", step, "\n".join(f"- {line}" for line in written), record.wall))
            entries += self._samples(step, record)
        return entries

    # -- trainers ---------------------------------------------------------------------------------------------------

    def _train_step(self, event: TrainStepCompleted) -> list[Entry]:
        key = (event.role, event.policy_version)
        if key in self.train_steps:
            return []
        self.train_steps.add(key)
        wall, step, role = _wall(event), event.step, event.role
        entries: list[Entry] = [Scalar(f"train/{role}/loss", step, event.loss, wall),
                                Scalar(f"train/{role}/tokens", step, float(event.tokens), wall)]
        for name, value in sorted(event.metrics.items()):
            namespace, _, metric = name.partition("/")
            if namespace in ("train", "extractor"):
                # The extractor trainer's own scalars (its reward, outcomes) count its steps: under train/extractor/,
                # apart from extractor/, whose parse shares count the loop's steps.
                tag = f"train/{role}/{_metric_name(metric)}"
            elif namespace == "rollout" and role == "actor":
                tag = f"train/actor/batch/{metric}"
            else:
                tag = f"train/{role}/{name}"
            entries.append(Scalar(tag, step, float(value), wall))
        for name, values in (("advantages", event.advantages), ("rewards", event.rewards)):
            if values:
                entries.append(Histogram(f"train/{role}/{name}", step, tuple(values), wall))
        return entries

    def _distilled_ids(self, episodes: Sequence[TrajectoryCompleted]) -> frozenset[str]:
        """The event ids of the generations that distil the step's train episodes, as the extractor picks them
        (`extractor.distill`: all, or guided only; never an episode its engine failed); none in the grpo arm."""
        assert self.started is not None and self.run_id is not None
        config = self.started.config
        if config.get("scheduler", {}).get("arm") == "grpo":
            return frozenset()
        guided_only = config.get("extractor", {}).get("distill", "all") == "guided"
        return frozenset(str(generation_event_id(distill_generation_id(self.run_id, t.trajectory_id)))
                         for t in episodes if t.env_error is None and (t.guided or not guided_only))

    def _parse_entries(self) -> list[Entry]:
        """The share of a step's distillations that parsed (`ok` or `no_op`), once every one of them is read (the
        first copy of each: a generation distilled again keeps its id)."""
        entries: list[Entry] = []
        for step in sorted(self._distilled):
            ids = self._distilled[step]
            if not all(i in self.parse for i in ids):
                continue
            del self._distilled[step]
            statuses = [self.parse[i][0] for i in ids]
            wall = max(self.parse[i][1] for i in ids)
            errors = sum(status == "parse_error" for status in statuses) / len(statuses)
            entries += [Scalar("extractor/parse_ok", step, 1.0 - errors, wall),
                        Scalar("extractor/parse_error", step, errors, wall),
                        Scalar("extractor/no_op", step, sum(status == "no_op" for status in statuses) / len(statuses),
                               wall)]
            shown = sorted((self.generations.pop(i) for i in ids), key=lambda generation: generation[0])
            texts = [text for _, text in shown[: 2 * self.samples_per_step]]
            entries.append(Text("extractor/generations", step, "\n\n---\n\n".join(texts), wall))
        return entries

def generation_text(event: ExtractionGenerated) -> str:
    """One extractor generation as a tracker shows it: the id, what it read, a digest of its prompt (the prompt is
    the trajectory's text, shown with the rollout samples), the answer as written, the ops it produced and its
    parse status."""
    digest = hashlib.sha256(json.dumps(list(event.prompt_token_ids)).encode()).hexdigest()[:12]
    status = event.parse_status + (f": {event.parse_error}" if event.parse_error else "")
    read = ", ".join(event.source_trajectory_ids) or "-"
    return (f"**{event.generation_id}** ({event.purpose}, extractor v{event.extractor_version}, {event.task_family})"
            f"\n\nread: {read}; prompt sha256 {digest}, {len(event.prompt_token_ids)} tokens\n\n"
            f"answer ({len(event.response_token_ids)} tokens):\n\n```\n{event.response_text}\n```\n\n"
            f"ops: {', '.join(event.op_ids) or '-'}\n\nparse: {status}")


def fold(events: Iterable[tuple[Event, int]], run_id: str | None = None, samples_per_step: int = 2) -> list[Entry]:
    """Every entry of a sequence of (event, offset)."""
    tracking = RunTracking(run_id, samples_per_step)
    entries: list[Entry] = []
    for event, offset in events:
        entries += tracking.add(event, offset)
    return entries


def as_table(entries: Iterable[Entry]) -> dict[str, Any]:
    """Entries by `entry_key`, the value, text or histogram summary only (what two trackers of one run must agree
    on)."""
    return {entry_key(e): (e.value if isinstance(e, Scalar) else e.text if isinstance(e, Text) else e.summary())
            for e in entries}
