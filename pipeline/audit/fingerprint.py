"""A run's fingerprint: per step, hashes of what it played, the bank it served from and the weights it trained, read
from its archive, so two runs of one config and seed can be compared part by part (`crl audit fingerprint`).

    fingerprint = run_fingerprint(Path("runs/a"))
    differences = fingerprint.differences(run_fingerprint(Path("runs/b")))   # [] when the runs agree

What each hash covers (ids are compared without the run id they begin with, since a run id is a run directory's
name):
- `trajectories[(step, split, kind)]`: every episode of the step, split and slot kind (`guided` / `free`), in
  trajectory-id order: its id, task seed, actor version, success, reward, and per turn the prompt and response token
  ids and the action. Sampling log-probs are hashed apart (`logprobs`), since a batched forward pass may round them
  differently while drawing the same tokens (docs/determinism.md).
- `bank[step]`: the bank's content (`BankState.state_hash`) as guided episodes of the step were served it: in
  deterministic mode the op log up to the extractor's `StepSettled` of the step before; otherwise up to the newest
  `bank_offset` the step's guided trajectories recorded (the asynchronous bank has no one state per step).
- `weights[(role, step)]`: each trainer step's weight hash after the update (`TrainStepCompleted`).
The first copy of anything archived twice counts, as every reader of the log counts it.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.audit.track import archived_events
from pipeline.bank.state import BankState
from pipeline.errors import ConfigError
from schemas.experiences import ExperienceAdded, ExperienceMerged, ExperienceRefined, ExperienceRetired
from schemas.runs import RunStarted, StepSettled
from schemas.training import TrainStepCompleted
from schemas.trajectories import TrajectoryCompleted

EpisodeKey = tuple[int, str, str]
"""(step, split, "guided" | "free")."""


@dataclass
class RunFingerprint:
    run_id: str
    deterministic: bool
    trajectories: dict[EpisodeKey, str] = field(default_factory=dict)
    logprobs: dict[EpisodeKey, str] = field(default_factory=dict)
    episodes: dict[EpisodeKey, int] = field(default_factory=dict)
    bank: dict[int, str] = field(default_factory=dict)
    weights: dict[tuple[str, int], str] = field(default_factory=dict)

    def parts(self) -> dict[str, str]:
        """Every hash by a printable name: `trajectories/<step>/<split>/<kind>`, `logprobs/...`, `bank/<step>`,
        `weights/<role>/<step>`."""
        named = {f"trajectories/{s}/{split}/{kind}": h for (s, split, kind), h in self.trajectories.items()}
        named |= {f"logprobs/{s}/{split}/{kind}": h for (s, split, kind), h in self.logprobs.items()}
        named |= {f"bank/{step}": h for step, h in self.bank.items()}
        named |= {f"weights/{role}/{step}": h for (role, step), h in self.weights.items()}
        return dict(sorted(named.items(), key=lambda item: _natural(item[0])))

    def differences(self, other: RunFingerprint) -> list[str]:
        """The names whose hashes differ, or that one run has and the other has not."""
        mine, theirs = self.parts(), other.parts()
        return sorted((name for name in mine.keys() | theirs.keys() if mine.get(name) != theirs.get(name)),
                      key=_natural)


def _natural(name: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in name.split("/")]


def run_fingerprint(run_dir: Path) -> RunFingerprint:
    started: RunStarted | None = None
    trajectories: dict[str, TrajectoryCompleted] = {}
    ops: dict[int, ExperienceAdded | ExperienceRefined | ExperienceMerged | ExperienceRetired] = {}
    settled: dict[int, StepSettled] = {}
    steps: dict[tuple[str, int], TrainStepCompleted] = {}
    for event, offset in archived_events(run_dir):
        if isinstance(event, RunStarted) and started is None:
            started = event
        elif isinstance(event, TrajectoryCompleted):
            trajectories.setdefault(event.trajectory_id, event)
        elif isinstance(event, ExperienceAdded | ExperienceRefined | ExperienceMerged | ExperienceRetired):
            ops.setdefault(offset, event)
        elif isinstance(event, StepSettled) and event.role == "extractor":
            settled.setdefault(event.step, event)
        elif isinstance(event, TrainStepCompleted):
            steps.setdefault((event.role, event.step), event)
    if started is None:
        raise ConfigError(f"the archive of {run_dir} has no RunStarted: it is not a run's archive, or the run never "
                          "started")
    run_id = started.run_id
    fingerprint = RunFingerprint(run_id, bool(started.config.get("scheduler", {}).get("deterministic", False)))
    by_key: dict[EpisodeKey, list[TrajectoryCompleted]] = defaultdict(list)
    for trajectory in trajectories.values():
        if trajectory.run_id == run_id:
            by_key[(trajectory.step, trajectory.split, "guided" if trajectory.guided else "free")].append(trajectory)
    for key, group in by_key.items():
        group.sort(key=lambda t: t.trajectory_id)
        fingerprint.trajectories[key] = _digest([_played(t) for t in group])
        fingerprint.logprobs[key] = _digest([[list(turn.sampling_logprobs) for turn in t.turns] for t in group])
        fingerprint.episodes[key] = len(group)
    positions: dict[int, int] = {}
    for step in sorted({s for s, _, _ in by_key}):
        if fingerprint.deterministic:
            before = settled.get(step - 1)
            positions[step] = before.bank_offset or 0 if before is not None else 0
        else:
            served = [t.bank_offset for (s, _, kind), group in by_key.items() if s == step and kind == "guided"
                      for t in group if t.bank_offset is not None]
            if served:
                positions[step] = max(served)
    state, applied = BankState(run_id), sorted(ops.items())
    index = 0
    for step, position in sorted(positions.items(), key=lambda item: (item[1], item[0])):
        while index < len(applied) and applied[index][0] < position:
            state.apply(applied[index][1], applied[index][0])
            index += 1
        fingerprint.bank[step] = state.state_hash(run_id)
    fingerprint.weights = {key: step.weight_hash_after for key, step in steps.items() if step.run_id == run_id}
    return fingerprint


def _played(trajectory: TrajectoryCompleted) -> list[object]:
    return [trajectory.trajectory_id, trajectory.seed, trajectory.policy_version, trajectory.success,
            trajectory.reward, [[list(turn.prompt_token_ids), list(turn.response_token_ids), turn.action]
                                for turn in trajectory.turns]]


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()[:16]
