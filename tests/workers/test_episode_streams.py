"""Per-episode random streams through the rollout worker: an episode draws the same tokens and gets the same rewards
whether it is played alone, in a batch of 8, or by one of two worker instances that split the assignments (each
taking them one poll at a time, so episodes join the batch at different generate calls). Guided and free slots, on
four task seeds; every assignment keeps the random event id `EpisodeAssigned` gets outside the scheduler."""

from __future__ import annotations

import numpy as np
import torch
from harness_setup import RUN, publish_policy, settings_for

from pipeline.bank.embeddings import load_sentence_encoder
from pipeline.bank.retrieval import query_text
from pipeline.envs.registry import make_env
from pipeline.runtime.harness import build_worker, run_worker
from schemas.arrays import EmbeddingVector
from schemas.base import Event, Producer
from schemas.experiences import ExperienceAdded
from schemas.tasks import EpisodeAssigned
from schemas.trajectories import TrajectoryCompleted
from workers.rollout import Rollout

ROOM = "MiniHack-Room-Random-5x5-v0"
WHO = Producer(worker="scheduler", instance="scheduler-0")
TASK_SEEDS = (11, 12, 13, 14)


def _assignments() -> list[EpisodeAssigned]:
    """4 groups of 2 (one task seed each), slot 0 guided."""
    return [EpisodeAssigned(run_id=RUN, producer=WHO, step=0, env_id=ROOM, task_family="minihack-room", seed=seed,
                            max_turns=4, group_id=f"s000000-g{g:03d}", slot=slot, group_size=2, guided=slot == 0,
                            policy_version=0, split="train")
            for g, seed in enumerate(TASK_SEEDS) for slot in range(2)]


def _played(tmp_path, log: list[Event], assignments: list[EpisodeAssigned], *, instance: str,
            batch_size: int) -> dict[str, TrajectoryCompleted]:
    settings = settings_for(tmp_path / instance, rollout={"generation": {"max_new_tokens": 6, "micro_batch": 8},
                                                          "max_concurrent_episodes": 8})
    worker, context = build_worker(Rollout, settings, log=log, instance=instance)
    result = run_worker(worker, assignments, context=context, batch_size=batch_size)
    assert result.dead_letters == []
    trajectories = [e for e in result.outputs if isinstance(e, TrajectoryCompleted)]
    assert len(trajectories) == len(assignments)
    return {t.trajectory_id: t for t in trajectories}


def _turns(trajectory: TrajectoryCompleted) -> list[tuple[tuple[int, ...], tuple[int, ...], str, bool, float]]:
    return [(turn.prompt_token_ids, turn.response_token_ids, turn.action, turn.valid, turn.reward)
            for turn in trajectory.turns]


def test_an_episode_plays_the_same_alone_in_a_batch_and_on_either_of_two_workers(tmp_path):
    settings = settings_for(tmp_path)
    encoder = load_sentence_encoder(settings.embedding.model)
    goal, observation = make_env(ROOM, settings.envs).reset(TASK_SEEDS[0])
    lesson = ExperienceAdded(
        run_id=RUN, producer=Producer(worker="extractor", instance="x-0"), op_id="o1", experience_id="e1",
        task_family="minihack-room", text="Walk diagonally toward the >.", generation_id="g1", extractor_version=0,
        key=EmbeddingVector.from_array(settings.embedding.model,
                                       np.asarray(encoder.encode([query_text(goal, observation)])[0])),
        source_trajectory_ids=("t0",))
    log: list[Event] = [publish_policy(tmp_path, "actor"), lesson]
    assignments = _assignments()

    batched = _played(tmp_path, log, assignments, instance="rollout-batch", batch_size=100)  # one batch of 8
    split = _played(tmp_path, log, assignments[:4], instance="rollout-0", batch_size=1)
    split |= _played(tmp_path, log, assignments[4:], instance="rollout-1", batch_size=1)
    assert batched.keys() == split.keys() == {f"s000000-g{g:03d}-k{k}" for g in range(4) for k in range(2)}
    alone = {a: _played(tmp_path, log, [assignment], instance=f"rollout-alone-{a}", batch_size=1)
             for a, assignment in enumerate(assignments) if a in (0, 3, 6)}  # guided and free, three groups

    for trajectory_id, trajectory in batched.items():
        other = split[trajectory_id]
        assert _turns(other) == _turns(trajectory), trajectory_id
        assert (other.reward, other.success, other.num_actions, other.invalid_actions, other.final_observation) == \
            (trajectory.reward, trajectory.success, trajectory.num_actions, trajectory.invalid_actions,
             trajectory.final_observation)
        assert other.retrieved == trajectory.retrieved
    for played in alone.values():
        (trajectory,) = played.values()
        assert _turns(trajectory) == _turns(batched[trajectory.trajectory_id])
        assert trajectory.reward == batched[trajectory.trajectory_id].reward
        for mine, theirs in zip(trajectory.turns, batched[trajectory.trajectory_id].turns, strict=True):
            # Not bitwise: the batched forward pass rounds differently with other row counts (see test_models.py).
            torch.testing.assert_close(torch.tensor(mine.sampling_logprobs), torch.tensor(theirs.sampling_logprobs),
                                       atol=1e-5, rtol=0)
    # The guided slots were served the lesson (or nothing, if it is not similar enough) the same way in every run,
    # and the episodes really sampled: different slots of a group drew different responses.
    assert any(t.retrieved for t in batched.values())
    first_responses = {t.turns[0].response_token_ids for t in batched.values()}
    assert len(first_responses) > 1
