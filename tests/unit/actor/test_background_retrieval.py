"""Retrieval off the playing loop (`EpisodePlayer`): a real `Retriever` over a real bank, with the real sentence
encoder held back by a gate. Free episodes keep playing while a guided one waits for its experience; a guided
episode joins once its experience is there, with the served refs and bank offset recorded; past
`retrieval_wait_s` it joins with nothing and is recorded so; the loop waits on retrieval only when every episode in
flight is waiting, and no longer than the wait."""

from __future__ import annotations

import threading
import time
from functools import cache
from typing import Any

import numpy as np
import pytest
from tiny_models import TINY

from pipeline.actor.episodes import EpisodePlayer
from pipeline.actor.settings import RolloutSettings
from pipeline.bank.embeddings import load_sentence_encoder
from pipeline.bank.replica import LocalBank
from pipeline.bank.retrieval import Retriever, query_text
from pipeline.bank.settings import RetrievalSettings
from pipeline.envs.registry import make_env
from pipeline.envs.settings import EnvSettings
from pipeline.models import build_tiny
from pipeline.models.base import PolicyModel
from pipeline.models.settings import GenerationSettings
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.experiences import ExperienceAdded
from schemas.tasks import EpisodeAssigned

ROOM = "MiniHack-Room-Random-5x5-v0"
MODEL = "all-MiniLM-L6-v2"
RUN = "retrieval-test"
LESSON = "Walk diagonally toward the >."
WHO = Producer(worker="test", instance="test-0")


@cache
def _encoder() -> Any:
    return load_sentence_encoder(MODEL)


@cache
def _policy() -> PolicyModel:
    return build_tiny(TINY)


class GatedEncoder:
    """The real encoder, held until `gate` is set (at most `hold_s`); counts its calls."""

    def __init__(self, hold_s: float = 5.0) -> None:
        self.gate = threading.Event()
        self.hold_s = hold_s
        self.calls = 0

    def encode(self, sentences: list[str], /, **kwargs: Any) -> Any:
        self.gate.wait(self.hold_s)
        self.calls += 1
        return _encoder().encode(sentences, **kwargs)


def _assignment(slot: int, guided: bool, max_turns: int = 3, seed: int = 11) -> tuple[EpisodeAssigned, Any, int]:
    assignment = EpisodeAssigned(
        run_id=RUN, producer=WHO, step=1, env_id=ROOM, task_family="minihack-room", seed=seed, max_turns=max_turns,
        group_id="s000001-g000", slot=slot, group_size=4, guided=guided, policy_version=0, split="train")
    return assignment, ("crl.tasks", 0), slot


def _bank(seed: int = 11) -> LocalBank:
    """A bank holding one lesson keyed by the query of the room with `seed` (so that room is served it)."""
    goal, observation = make_env(ROOM, EnvSettings()).reset(seed)
    vector = np.asarray(_encoder().encode([query_text(goal, observation)], convert_to_numpy=True,
                                          normalize_embeddings=True)[0])
    bank = LocalBank()
    bank.apply(ExperienceAdded(
        run_id=RUN, producer=WHO, op_id="o1", experience_id="e1", task_family="minihack-room", text=LESSON,
        generation_id="g1", extractor_version=0, key=EmbeddingVector.from_array(MODEL, vector),
        source_trajectory_ids=("t0",)), 0)
    return bank


def _player(encoder: GatedEncoder, retrieval_wait_s: float = 10.0) -> EpisodePlayer:
    settings = RolloutSettings(generation=GenerationSettings(max_new_tokens=4, micro_batch=8),
                               retrieval_wait_s=retrieval_wait_s)
    player = EpisodePlayer(settings, EnvSettings(), run_id=RUN, producer=Producer(worker="rollout", instance="r-0"),
                           retriever=Retriever(_bank(), encoder))
    player.policy, player.version = _policy(), 0
    return player


def test_free_episodes_play_while_a_guided_one_waits_then_it_joins_with_its_experience():
    encoder = GatedEncoder()
    player = _player(encoder)
    try:
        started = time.monotonic()
        player.start([_assignment(0, guided=True), _assignment(1, guided=False), _assignment(2, guided=False)])
        assert time.monotonic() - started < 2.0, "start waited for the retrieval"
        guided, *free = player.active
        player.play_turn()
        # The encoder is still held: the free episodes played, the guided one sits out (and is still in flight).
        assert [len(e.turns) for e in free] == [1, 1] and not guided.turns
        assert player.waiting == [guided] and guided in player.active
        assert player.stats.blocked_s == 0.0  # the loop never waited: it had free episodes to play
        encoder.gate.set()
        trajectories = player.play_to_end()
        played = next(t for t in trajectories if t.guided)
        assert [ref.experience_id for ref in played.retrieved] == ["e1"] and played.bank_offset == 1
        assert f"Experience: {LESSON}" in _policy().decode(played.turns[0].prompt_token_ids)
        assert not any("Experience:" in _policy().decode(t.turns[0].prompt_token_ids)
                       for t in trajectories if not t.guided)
        assert player.stats.late_starts == 1 and player.stats.calls_late >= 1 and player.stats.timeouts == 0
        assert played.timings.retrieval_s > 0
        assert encoder.calls == 1 and player.background.batches == 1  # one encode, one search for the batch
    finally:
        encoder.gate.set()
        player.close()


def test_a_guided_episode_past_the_wait_joins_with_nothing_and_is_recorded_so():
    encoder = GatedEncoder(hold_s=10.0)
    player = _player(encoder, retrieval_wait_s=0.3)
    try:
        player.start([_assignment(0, guided=True), _assignment(1, guided=False, max_turns=1)])
        trajectories = player.play_to_end()
        played = next(t for t in trajectories if t.guided)
        assert played.guided and played.retrieved == () and played.bank_offset is None
        assert played.turns and "Experience:" not in _policy().decode(played.turns[0].prompt_token_ids)
        assert played.timings.retrieval_s >= 0.3
        assert player.stats.timeouts == 1
        # Once the free episode had finished, the loop waited for the guided one, bounded by the wait.
        assert player.stats.blocked_s < 0.3 + 1.0
    finally:
        encoder.gate.set()
        player.close()


@pytest.mark.parametrize("hold_s", [0.2, 30.0])
def test_the_loop_waits_only_when_every_episode_waits_and_no_longer_than_the_wait(hold_s):
    """Every episode guided: the first turn waits for the retrieval (served when it comes in time), never past
    `retrieval_wait_s` (1 s here)."""
    encoder = GatedEncoder(hold_s=hold_s)
    player = _player(encoder, retrieval_wait_s=1.0)
    try:
        player.start([_assignment(0, guided=True), _assignment(1, guided=True)])
        started = time.monotonic()
        player.play_turn()
        waited = time.monotonic() - started
        assert all(len(e.turns) == 1 for e in player.active) or not player.active
        assert 0.1 <= player.stats.blocked_s <= waited < 15.0  # held 30 s: bounded by the 1 s wait (+ a slow machine)
        served = [bool(e.retrieved) for e in player.active]
        if hold_s < 1.0:
            assert served == [True, True] and player.stats.timeouts == 0
        else:
            assert served == [False, False] and player.stats.timeouts == 2
            assert all(e.retrieval_timed_out and e.bank_offset is None for e in player.active)
    finally:
        encoder.gate.set()
        player.close()


class RecordingEncoder:
    """The real encoder; keeps every sentence it was asked to encode."""

    def __init__(self) -> None:
        self.sentences: list[str] = []

    def encode(self, sentences: list[str], /, **kwargs: Any) -> Any:
        self.sentences += sentences
        return _encoder().encode(sentences, **kwargs)


@pytest.mark.parametrize("key", ["goal-and-first-observation", "goal", "first-observation"])
def test_a_start_query_is_keyed_as_the_retrieval_key_setting_says(key):
    goal, observation = make_env(ROOM, EnvSettings()).reset(11)
    encoder = RecordingEncoder()
    player = EpisodePlayer(RolloutSettings(generation=GenerationSettings(max_new_tokens=4, micro_batch=8)),
                           EnvSettings(), run_id=RUN, producer=Producer(worker="rollout", instance="r-0"),
                           retriever=Retriever(_bank(), encoder, RetrievalSettings(key=key)))
    player.policy, player.version = _policy(), 0
    try:
        player.start([_assignment(0, guided=True)])
        while player.active:
            player.play_turn()
    finally:
        player.close()
    assert encoder.sentences == [query_text(goal, observation, key)]
    assert encoder.sentences[0].startswith("Goal: " if key != "first-observation" else "Observation: ")
    assert ("Observation: " in encoder.sentences[0]) == (key != "goal")
