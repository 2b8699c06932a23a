"""The scheduler and rollout workers against a real broker with the tiny model: groups with guided and free slots
are played, every trajectory is genuine (its token ids decode to its text, its log-probs are the sampler's), guided
episodes carry the experiences they were served, each step is played by the actor version the staleness bound
requires, and a scheduler killed mid-run and restarted continues the same schedule."""

from __future__ import annotations

import json
import math
import signal
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from worker_processes import _env, _send, _start, _stop, _wait_for

from infra.kafka import KafkaSettings
from pipeline.models.checkpoints import checkpoint_path, load_checkpoint
from pipeline.runtime.log import read_to_end
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.experiences import ExperienceAdded
from schemas.runs import MergeRequested, RunFinished, RunStarted
from schemas.tasks import EpisodeAssigned
from schemas.topics import CONTROL, POLICY, RUNS, TASKS, TRAIN_STEPS, TRAJECTORIES
from schemas.training import PolicyPublished, TrainStepCompleted
from schemas.trajectories import Timings, TrajectoryCompleted, Turn

pytestmark = pytest.mark.integration

ROOM = "MiniHack-Room-Random-5x5-v0"
SEEDER = Producer(worker="test", instance="test-0")


def _run_env(bootstrap: str, run_dir: Path, **settings: str) -> dict[str, str]:
    env = _env(bootstrap, run_dir)
    env.update({
        "CRL_SCHEDULER__STEPS": "3", "CRL_ENVS__TASKS": json.dumps([{"env_id": ROOM, "max_turns": 5}]),
        "CRL_SCHEDULER__EVAL_EVERY": "2", "CRL_ENVS__EVAL_TASKS_PER_ENV": "2", "CRL_SCHEDULER__MERGE_EVERY": "2",
        "CRL_ENVS__TRAIN_POOL_SIZE": "20", "CRL_ROLLOUT__GENERATION__MAX_NEW_TOKENS": "4",
        "CRL_ROLLOUT__MAX_CONCURRENT_EPISODES": "16", "CRL_ROLLOUT__METRICS_EVERY": "8",
    })
    env.update(settings)
    return env


def _experiences(run_id: str, count: int) -> list[ExperienceAdded]:
    rng = np.random.default_rng(0)
    ops = []
    for i in range(count):
        vector = rng.normal(size=384)
        ops.append(ExperienceAdded(
            run_id=run_id, producer=SEEDER, op_id=f"seed-op-{i}", experience_id=f"seed-exp-{i}",
            task_family="minihack-room", text=f"Lesson {i}: walk diagonally toward the staircase down.",
            key=EmbeddingVector.from_array("all-MiniLM-L6-v2", vector / np.linalg.norm(vector)),
            generation_id=f"seed-gen-{i}", extractor_version=0, source_trajectory_ids=(f"seed-traj-{i}",)))
    return ops


def _finished(kafka: KafkaSettings) -> RunFinished | None:
    return next((e for e in read_to_end(kafka, RUNS) if isinstance(e, RunFinished)), None)


# Its own wait is 420 s. On Apache Kafka, kafka-python has been seen to leave the lone rollout member revoked right
# after each assignment, so the run goes on one `GroupWatch` recreation (30 s) at a time: slow, not lost.
@pytest.mark.timeout(600)
def test_scheduler_and_rollout_play_guided_and_free_groups(kafka_bootstrap, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    env = _run_env(kafka_bootstrap, tmp_path)
    _send(kafka_bootstrap, _experiences(tmp_path.name, 3))
    log = tmp_path / "workers.log"
    # The extractor trainer publishes the extractor's version 0, which the scheduler waits for before step 0.
    workers = [_start(name, env, log) for name in ("actor_trainer", "extractor_trainer", "rollout", "scheduler")]
    try:
        finished = _wait_for("RunFinished", lambda: _finished(kafka), 420, log)
    finally:
        for worker in reversed(workers):
            _stop(worker)
    assert finished.status == "completed" and finished.steps_completed == 3
    assert 0.0 <= finished.metrics["train/all/success"] <= 1.0
    assert "eval/all/success" in finished.metrics and "train/guided/episodes" in finished.metrics

    runs = read_to_end(kafka, RUNS)
    started = [e for e in runs if isinstance(e, RunStarted)]
    assert len(started) == 1 and started[0].config["scheduler"]["steps"] == 3 and started[0].code_version
    tasks = [e for e in read_to_end(kafka, TASKS) if isinstance(e, EpisodeAssigned)]
    train = [t for t in tasks if t.split == "train"]
    evaluation = [t for t in tasks if t.split == "eval"]
    assert len({t.event_id for t in tasks}) == len(tasks)
    assert Counter(t.step for t in train) == {0: 8, 1: 8, 2: 8}  # 2 groups x 4 slots per step
    assert Counter(t.step for t in evaluation) == {0: 4, 2: 4}  # after steps 0 and 2 (the last): 2 tasks x 2
    for t in train:
        assert t.guided == (t.step >= 1 and t.slot < 2)  # warm-up step 0 is all free, then K/2 guided
    for group in {t.group_id for t in train}:
        assert len({t.seed for t in train if t.group_id == group}) == 1
    merges = [e for e in read_to_end(kafka, CONTROL) if isinstance(e, MergeRequested)]
    assert [m.step for m in merges] == [1]  # before step 2

    trajectories = {}
    for event in read_to_end(kafka, TRAJECTORIES):
        assert isinstance(event, TrajectoryCompleted)
        trajectories.setdefault(event.assignment_event_id, event)
    assert set(trajectories) == {str(t.event_id) for t in tasks}
    policies = {e.version: e for e in read_to_end(kafka, POLICY) if isinstance(e, PolicyPublished)
                and e.role == "actor"}
    tokenizers = {v: load_checkpoint(checkpoint_path(p.checkpoint_uri), p.sha256).policy for v, p in policies.items()}
    by_assignment = {str(t.event_id): t for t in tasks}
    guided_served = 0
    for trajectory in trajectories.values():
        assignment = by_assignment[trajectory.assignment_event_id]
        assert (trajectory.step, trajectory.slot, trajectory.guided, trajectory.seed) == (
            assignment.step, assignment.slot, assignment.guided, assignment.seed)
        assert trajectory.policy_version >= assignment.policy_version
        assert 1 <= len(trajectory.turns) <= 5 and trajectory.num_actions == len(trajectory.turns)
        assert trajectory.success == (trajectory.reward == 1.0)
        assert trajectory.invalid_actions == sum(not turn.valid for turn in trajectory.turns)
        # what it ended on and what it revealed: a lit room shows its stairs from the first observation on
        assert trajectory.final_observation and trajectory.final_observation.startswith(("Map:", "Invalid action"))
        assert [fact.split(":")[0] for fact in trajectory.revealed] == ["staircase down"]
        policy = tokenizers[trajectory.policy_version]
        for turn in trajectory.turns:
            assert policy.decode(turn.response_token_ids) == turn.response_text
            assert turn.observation in policy.decode(turn.prompt_token_ids)
            assert all(math.isfinite(x) and x <= 0.0 for x in turn.sampling_logprobs)
            assert "Experience:" not in turn.observation
        if trajectory.guided:
            assert trajectory.retrieved and trajectory.bank_offset == 3
            assert trajectory.retrieved[0].experience_id.startswith("seed-exp-")
            assert "Experience: Lesson" in policy.decode(trajectory.turns[0].prompt_token_ids)
            guided_served += 1
        else:
            assert not trajectory.retrieved
            assert "Experience:" not in policy.decode(trajectory.turns[0].prompt_token_ids)
    assert guided_served == 8 + 4  # guided slots of steps 1 and 2; one guided slot per eval task (steps 0 and 2)
    # Step 2 may only be played after the actor trained step 1 (staleness 0): version 1 or later.
    assert all(t.policy_version >= 1 for t in trajectories.values() if t.step == 2)
    steps = [e for e in read_to_end(kafka, TRAIN_STEPS) if isinstance(e, TrainStepCompleted) and e.role == "actor"]
    assert [s.step for s in steps] == [1, 2]


def _answer(bootstrap: str, kafka: KafkaSettings, answered: set[uuid.UUID]) -> int:
    """Play every new assignment instantly (a stand-in rollout worker) and publish its trajectory."""
    new = [e for e in read_to_end(kafka, TASKS) if isinstance(e, EpisodeAssigned) and e.event_id not in answered]
    turn = Turn(observation="o", prompt_token_ids=(1, 2), response_token_ids=(3,), sampling_logprobs=(-0.5,),
                response_text="east", action="east", valid=True, reward=1.0)
    _send(bootstrap, [TrajectoryCompleted(
        run_id=a.run_id, producer=SEEDER, trajectory_id=f"{a.group_id}-k{a.slot}", assignment_event_id=str(a.event_id),
        step=a.step, split=a.split, env_id=a.env_id, task_family=a.task_family, seed=a.seed, group_id=a.group_id,
        slot=a.slot, guided=a.guided, goal="g", turns=(turn,), reward=1.0, success=True, num_actions=1,
        invalid_actions=0, truncated=False, policy_version=0, timings=Timings(generation_s=0, env_s=0, retrieval_s=0),
    ) for a in new])
    answered |= {a.event_id for a in new}
    return len(new)


def test_scheduler_killed_mid_run_continues_the_same_schedule(kafka_bootstrap, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    # exp_only: the actor is frozen, so only finished episodes gate the next step (max_steps_ahead 0: one at a time).
    env = _run_env(kafka_bootstrap, tmp_path, CRL_SCHEDULER__ARM="exp_only", CRL_SCHEDULER__STEPS="5",
                   CRL_SCHEDULER__MAX_STEPS_AHEAD="0")
    log = tmp_path / "workers.log"
    answered: set[uuid.UUID] = set()
    # Step 0 waits for the extractor's version 0 (the warm-up fills the bank); the scheduler never loads it.
    _send(kafka_bootstrap, [PolicyPublished(run_id=tmp_path.name, producer=Producer(worker="test", instance="test-0"),
                                            role="extractor", version=0, step=0,
                                            checkpoint_uri="file:///nowhere", sha256="0" * 64)])
    scheduler = _start("scheduler", env, log)
    try:
        def two_steps_issued() -> bool:
            _answer(kafka_bootstrap, kafka, answered)
            return len({e.step for e in read_to_end(kafka, TASKS) if isinstance(e, EpisodeAssigned)}) >= 2
        _wait_for("steps 0 and 1", two_steps_issued, 120, log)
        scheduler.send_signal(signal.SIGKILL)
        scheduler.wait(timeout=30)
        issued_before = len(read_to_end(kafka, TASKS))
        scheduler = _start("scheduler", env, log)

        def done() -> RunFinished | None:
            _answer(kafka_bootstrap, kafka, answered)
            return _finished(kafka)
        finished = _wait_for("RunFinished after the restart", done, 180, log)
    finally:
        _stop(scheduler)
    assert finished.status == "completed" and finished.steps_completed == 5
    tasks = [e for e in read_to_end(kafka, TASKS) if isinstance(e, EpisodeAssigned)]
    assert len(tasks) > issued_before
    assert len({t.event_id for t in tasks}) == len(tasks), "an assignment was issued twice"
    assert Counter(t.step for t in tasks if t.split == "train") == dict.fromkeys(range(5), 8)
    assert all(not t.guided or t.slot < 2 for t in tasks)
    assert len([e for e in read_to_end(kafka, RUNS) if isinstance(e, RunStarted)]) == 1
    merges = [e for e in read_to_end(kafka, CONTROL) if isinstance(e, MergeRequested)]
    assert sorted(m.step for m in merges) == [1, 3]
