"""The rollout worker through the harness: it follows the actor's published version, plays the assignments it is
handed (guided ones served from the bank replica it follows), and publishes one trajectory per assignment."""

from __future__ import annotations

import time

import numpy as np
from harness_setup import RUN, publish_policy, settings_for

from pipeline.bank.embeddings import load_sentence_encoder
from pipeline.bank.retrieval import query_text
from pipeline.envs.registry import make_env
from pipeline.runtime.harness import build_worker, run_worker
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.experiences import ExperienceAdded
from schemas.tasks import EpisodeAssigned
from schemas.trajectories import TrajectoryCompleted
from workers.rollout import Rollout

ROOM = "MiniHack-Room-Random-5x5-v0"
WHO = Producer(worker="scheduler", instance="scheduler-0")


def _assignment(slot: int, guided: bool, seed: int = 11) -> EpisodeAssigned:
    return EpisodeAssigned(run_id=RUN, producer=WHO, step=0, env_id=ROOM, task_family="minihack-room", seed=seed,
                           max_turns=3, group_id="s000000-g000", slot=slot, group_size=2, guided=guided,
                           policy_version=0, split="train")


def test_the_rollout_worker_plays_free_and_guided_episodes_from_what_it_follows(tmp_path):
    settings = settings_for(tmp_path)
    goal, observation = make_env(ROOM, settings.envs).reset(11)
    vector = load_sentence_encoder(settings.embedding.model).encode([query_text(goal, observation)])[0]
    lesson = ExperienceAdded(
        run_id=RUN, producer=Producer(worker="extractor", instance="x-0"), op_id="o1", experience_id="e1",
        task_family="minihack-room", text="Walk diagonally toward the >.", generation_id="g1", extractor_version=0,
        key=EmbeddingVector.from_array(settings.embedding.model, np.asarray(vector)), source_trajectory_ids=("t0",))
    worker, context = build_worker(Rollout, settings, log=[publish_policy(tmp_path, "actor"), lesson])
    result = run_worker(worker, [_assignment(0, guided=True), _assignment(1, guided=False)], context=context)
    trajectories = [e for e in result.outputs if isinstance(e, TrajectoryCompleted)]
    assert sorted(t.slot for t in trajectories) == [0, 1] and result.dead_letters == []
    guided = next(t for t in trajectories if t.guided)
    free = next(t for t in trajectories if not t.guided)
    assert [ref.experience_id for ref in guided.retrieved] == ["e1"] and guided.bank_offset == 1
    assert free.retrieved == ()
    assert all(t.policy_version == 0 and 1 <= len(t.turns) <= 3 for t in trajectories)
    assert result.committed == {("crl.tasks", 0): 2}  # both finished: nothing held back


class SlowEncoder:
    """The real encoder, `delay_s` slower per call: retrieval that takes a while."""

    def __init__(self, encoder: object, delay_s: float) -> None:
        self.encoder, self.delay_s = encoder, delay_s

    def encode(self, sentences, /, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(self.delay_s)
        return self.encoder.encode(sentences, **kwargs)  # type: ignore[attr-defined]


def _slow_retrieval(monkeypatch, settings, delay_s: float) -> ExperienceAdded:  # type: ignore[no-untyped-def]
    """The worker's encoder made `delay_s` slower per call, and the lesson for seed 11's room."""
    from pipeline.bank import embeddings

    encoder = load_sentence_encoder(settings.embedding.model)
    monkeypatch.setattr(embeddings, "load_sentence_encoder", lambda name, device="cpu": SlowEncoder(encoder, delay_s))
    goal, observation = make_env(ROOM, settings.envs).reset(11)
    vector = encoder.encode([query_text(goal, observation)])[0]
    return ExperienceAdded(
        run_id=RUN, producer=Producer(worker="extractor", instance="x-0"), op_id="o1", experience_id="e1",
        task_family="minihack-room", text="Walk diagonally toward the >.", generation_id="g1", extractor_version=0,
        key=EmbeddingVector.from_array(settings.embedding.model, np.asarray(vector)), source_trajectory_ids=("t0",))


def test_free_episodes_finish_while_a_slow_retrieval_runs_and_the_guided_one_is_served_after(tmp_path, monkeypatch):
    settings = settings_for(tmp_path)
    lesson = _slow_retrieval(monkeypatch, settings, delay_s=3.0)
    worker, context = build_worker(Rollout, settings, log=[publish_policy(tmp_path, "actor"), lesson])
    result = run_worker(worker, [_assignment(0, guided=True), _assignment(1, guided=False)], context=context)
    trajectories = [e for e in result.outputs if isinstance(e, TrajectoryCompleted)]
    assert [t.guided for t in trajectories] == [False, True]  # the free episode played out while the encoder ran
    guided = trajectories[1]
    assert [ref.experience_id for ref in guided.retrieved] == ["e1"] and guided.bank_offset == 1
    assert guided.timings.retrieval_s >= 3.0
    assert worker.player.stats.late_starts == 1 and worker.player.stats.timeouts == 0
    assert result.committed == {("crl.tasks", 0): 2} and result.dead_letters == []


def test_a_guided_episode_whose_retrieval_outlasts_the_wait_is_played_with_nothing(tmp_path, monkeypatch):
    settings = settings_for(tmp_path, rollout={"retrieval_wait_s": 0.2})
    lesson = _slow_retrieval(monkeypatch, settings, delay_s=5.0)
    worker, context = build_worker(Rollout, settings, log=[publish_policy(tmp_path, "actor"), lesson])
    result = run_worker(worker, [_assignment(0, guided=True), _assignment(1, guided=False)], context=context)
    guided = next(e for e in result.outputs if isinstance(e, TrajectoryCompleted) and e.guided)
    assert guided.retrieved == () and guided.bank_offset is None and guided.turns
    assert worker.player.stats.timeouts == 1 and worker.player.stats.blocked_s < 0.2 + 3.0
    assert result.committed == {("crl.tasks", 0): 2} and result.dead_letters == []
