"""The warm starts' gates (`pipeline.rl.warm_gate`): hand-worked checks, an actor that follows lessons measured by
the gate as it is, and a deliberately broken warm start that the gate reports as missed.

Run: pytest tests/unit/rl/test_warm_gate.py
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence

import pytest

from pipeline.actor.settings import RolloutSettings
from pipeline.envs.base import reversed_directions
from pipeline.envs.settings import EnvSettings, TaskMix
from pipeline.errors import ConfigError
from pipeline.extractor.settings import ExtractorSettings
from pipeline.models.base import Generation, PolicyModel, SamplingParams
from pipeline.models.settings import TinyModelSettings
from pipeline.models.tiny import build_tiny
from pipeline.rl.settings import ActorTrainerSettings, ExtractorTrainerSettings, WarmStartGate, WarmStartSettings
from pipeline.rl.warm_data import play_data_episodes
from pipeline.rl.warm_gate import _checks, actor_gate, describe, gate_line, lesson_tasks
from pipeline.rl.warm_progress import WarmStartReporter
from pipeline.rl.warm_start import warm_start_extractor
from schemas.base import Producer
from schemas.training import WarmStartProgressed

CORRIDOR = [TaskMix(env_id="MiniHack-DarkCorridor-v0", max_turns=9)]
TINY = TinyModelSettings(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                         vocab_size=512, corpus_episodes=4)


def test_a_check_passes_on_its_side_of_the_bound_and_fails_on_no_samples():
    gate = WarmStartGate(min_states_revealed=0.9, min_parse_ok=0.5, min_success_right=0.8, max_success_wrong=0.2)
    extractor = _checks(gate, "extractor", {"min_parse_ok": (1, 2), "min_states_revealed": (9, 10)})
    assert [(c.name, c.value, c.bound, c.samples, c.passed) for c in extractor] == [
        ("min_parse_ok", 0.5, 0.5, 2, True), ("min_states_revealed", 0.9, 0.9, 10, True)]
    actor = _checks(gate, "actor", {"min_success_right": (7, 10), "max_success_wrong": (0, 0)})
    assert [(c.name, c.value, c.passed) for c in actor] == [("min_success_right", 0.7, False),
                                                            ("max_success_wrong", 0.0, False)]  # showed nothing
    assert gate_line("actor", actor) == ("actor warm start gate MISSED: success_right 0.70 >= 0.80 (10) MISSED, "
                                         "success_wrong 0.00 <= 0.20 (0) MISSED")
    assert describe(extractor[1]) == "states_revealed 0.90 >= 0.90 (10)"


def test_a_gate_names_only_its_own_trainers_bounds():
    with pytest.raises(ValueError, match="min_states_revealed checks the other trainer's warm start"):
        ActorTrainerSettings(warm_start={"gate": {"min_states_revealed": 0.9}})
    with pytest.raises(ValueError, match="min_success_right checks the other trainer's warm start"):
        ExtractorTrainerSettings(warm_start={"gate": {"min_success_right": 0.9}})
    with pytest.raises(ValueError, match="omit_facts applies to the extractor"):
        ActorTrainerSettings(warm_start={"omit_facts": 0.5})


def test_a_wrong_lesson_turns_every_direction_around():
    assert reversed_directions("staircase down: 1 north, 2 west of the start") == \
        "staircase down: 1 south, 2 east of the start"
    assert reversed_directions("staircase down: east of the start (the other end has none)") == \
        "staircase down: west of the start (the other end has none)"
    assert reversed_directions("key: 1 northeast of the start") == "key: 1 southwest of the start"
    assert reversed_directions("the coin is in the kitchen") == "the coin is in the kitchen"
    episodes = play_data_episodes(CORRIDOR, EnvSettings(), 8, 1.0, seed=3, plays_per_task=2, split="eval")
    right, wrong = lesson_tasks(episodes, {"MiniHack-DarkCorridor-v0": 9}, 400)
    tasks = {e.task_seed for e in episodes}
    assert len(right) == len(wrong) == len(tasks), "one of each per task: the solver reveals every corridor it plays"
    for good, bad in zip(right, wrong, strict=True):
        assert (good.seed, good.max_turns) == (bad.seed, bad.max_turns)
        assert good.lesson is not None and bad.lesson == reversed_directions(good.lesson) != good.lesson


class FollowsLessons(PolicyModel):
    """An actor that walks the way its lesson says (east when it has none): what a warm start should leave."""

    def __init__(self) -> None:
        self.turns = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)

    @property
    def chat(self) -> bool:
        return False

    def generate(self, prompts, sampling: SamplingParams, seeds, sessions=None) -> list[Generation]:  # type: ignore[no-untyped-def]
        generations = []
        for prompt in prompts:
            text = prompt if isinstance(prompt, str) else self.decode(prompt)
            answer = " west\n" if "west of the start" in text else " east\n"
            generations.append(Generation(tuple(self.encode(text)), tuple(self.encode(answer)), answer,
                                          (0.0,) * len(answer), "stop"))
        return generations

    def token_logprobs(self, prompt_ids, response_ids, temperature=1.0):  # type: ignore[no-untyped-def]
        raise NotImplementedError("the gate only samples")

    def end_sessions(self, sessions) -> None:  # type: ignore[no-untyped-def]
        pass


def test_the_actor_gate_measures_an_actor_that_follows_lessons_as_right_and_wrong():
    warm = WarmStartSettings(plays_per_task=2, gate=WarmStartGate(episodes=16, min_success_right=0.9,
                                                                  max_success_wrong=0.1))
    checks = actor_gate(FollowsLessons(), warm, CORRIDOR, EnvSettings(), RolloutSettings(history_turns=2))
    assert [(c.name, c.value, c.passed) for c in checks] == [("min_success_right", 1.0, True),
                                                             ("max_success_wrong", 0.0, True)]
    assert checks[0].samples == checks[1].samples >= 5, "every held-out task drawn, once with each lesson"


class FollowsRules(FollowsLessons):
    """An actor that walks to the side of the furnishing its lesson names (signpost corridors)."""

    def generate(self, prompts, sampling: SamplingParams, seeds, sessions=None) -> list[Generation]:  # type: ignore[no-untyped-def]
        generations = []
        for prompt in prompts:
            text = prompt if isinstance(prompt, str) else self.decode(prompt)
            named = re.search(r"on the (\w+)'s side", text)
            placed = re.search(r"By the start: (\w+) west, (\w+) east", text)
            answer = " east\n" if named is None or placed is None or placed.group(2) == named.group(1) else " west\n"
            generations.append(Generation(tuple(self.encode(text)), tuple(self.encode(answer)), answer,
                                          (0.0,) * len(answer), "stop"))
        return generations


def test_on_signpost_corridors_the_gate_gives_the_rule_and_for_a_wrong_lesson_the_other_furnishing():
    signposts = [TaskMix(env_id="MiniHack-SignpostCorridor-v0", max_turns=9)]
    episodes = play_data_episodes(signposts, EnvSettings(), 8, 1.0, seed=3, plays_per_task=2, split="eval")
    right, wrong = lesson_tasks(episodes, {"MiniHack-SignpostCorridor-v0": 9}, 400)
    assert len(right) == len(wrong) == len({e.task_seed for e in episodes})
    for good, bad in zip(right, wrong, strict=True):
        named = [re.search(r"on the (\w+)'s side", t.lesson).group(1) for t in (good, bad)]  # type: ignore[arg-type]
        assert named[0] != named[1], (good.lesson, bad.lesson)
    # the run's own signpost (drawn per run) plays no part: the gate replays the data's corridors
    warm = WarmStartSettings(plays_per_task=2, gate=WarmStartGate(episodes=16, min_success_right=0.9,
                                                                  max_success_wrong=0.1))
    for run in (EnvSettings(seed=1), EnvSettings(seed=2, signpost={"landmark": "sink", "flip_unseen": True})):
        checks = actor_gate(FollowsRules(), warm, signposts, run, RolloutSettings(history_turns=2))
        assert [(c.name, c.value) for c in checks] == [("min_success_right", 1.0), ("max_success_wrong", 0.0)]


def test_the_actor_gate_refuses_tasks_whose_facts_have_no_direction_to_turn_around():
    warm = WarmStartSettings(gate=WarmStartGate(episodes=4, max_success_wrong=0.1))
    with pytest.raises(ConfigError, match="max_success_wrong needs"):
        actor_gate(FollowsLessons(), warm, [TaskMix(env_id="Sokoban-6x6-2box", max_turns=4)], EnvSettings(),
                   RolloutSettings())


def test_a_broken_warm_start_misses_its_gate_and_says_so(tmp_path, caplog):
    """Two fine-tuning steps of a model far too small: its answers do not state what the episodes revealed. The gate
    is checked on what the cache loads too, and a missed one is logged as an error and published."""
    warm = WarmStartSettings(steps=2, episodes=16, batch_size=2, plays_per_task=4, cache_dir=tmp_path,
                             gate=WarmStartGate(episodes=16, min_parse_ok=0.0, min_states_revealed=0.9))
    extractor = ExtractorSettings(generation={"max_new_tokens": 16})
    for cached in (False, True):
        published: list[WarmStartProgressed] = []
        reporter = WarmStartReporter("r", "extractor", Producer(worker="test", instance="t-0"), published.append)
        with caplog.at_level(logging.ERROR, logger="pipeline.rl.warm_start"):
            _policy, stats = warm_start_extractor(build_tiny(TINY), warm, CORRIDOR, EnvSettings(), extractor,
                                                  reporter, merges=False)
        assert ("cached" in stats) is cached
        assert stats["gate_passed"] is False
        assert {c["name"]: c["passed"] for c in stats["gate"]} == {"min_parse_ok": True, "min_states_revealed": False}
        done = published[-1]
        assert done.phase == "done" and done.cached is cached and done.gate is not None
        assert [c.passed for c in done.gate] == [True, False]
        assert "extractor warm start gate MISSED" in caplog.text
        caplog.clear()


def test_on_a_family_with_a_rule_a_lesson_of_any_kind_true_of_its_episode_states_what_it_revealed():
    from pipeline.extractor.protocol import TrajectoryDigest
    from pipeline.rl.warm_gate import Distilled

    digest = TrajectoryDigest(env_id="MiniHack-SignpostCorridor-v0", task_family="minihack-signpost-corridor",
                              goal="g", first_observation="By the start: altar west, sink east", actions=("west",),
                              success=True, truncated=False,
                              revealed=("staircase down: 4 west of the start", "on the staircase's side: altar"))

    def states(*lessons: str) -> bool | None:
        return Distilled(digest, (), "", True, lessons).states_fact

    assert states("Solved in 4 actions. the staircase down is on the altar's side.")
    assert states("Solved in 4 actions. staircase down: 4 west of the start.")
    assert states("Solved in 4 actions. the staircase down is always west of the start.")
    assert not states("Solved in 4 actions. the staircase down is on the sink's side.")
    assert not states("Solved in 4 actions. the staircase down is always east of the start.")
    assert not states() and Distilled(dataclasses.replace(digest, revealed=()), (), "", True, ()).states_fact is None
