"""The text worlds against their real engines (TextWorldExpress 1.1.0 and ScienceWorld 1.2.3, jars run by Java 17):
the same seed gives the same game, the scripted solvers built on the engines' gold paths succeed, bad actions are
handled, and a JVM killed mid-episode fails that episode only, with the next one on a fresh engine."""

from __future__ import annotations

import json
import os

import pytest

from pipeline.actor.episodes import EpisodePlayer
from pipeline.actor.settings import RolloutSettings
from pipeline.envs.jvm import engine_requirements, jvm_engine
from pipeline.envs.registry import make_env, task_pool
from pipeline.envs.settings import EnvSettings, TextWorldSettings
from pipeline.envs.text_worlds import TWX_FOLD_BASE, task_fold, twx_task
from pipeline.errors import ConfigError, EngineCrashedError
from pipeline.models.settings import TinyModelSettings
from pipeline.models.tiny import build_tiny
from schemas.base import Producer
from schemas.tasks import EpisodeAssigned

pytestmark = pytest.mark.integration

TWX = ("TWX-CookingWorld", "TWX-TWC", "TWX-CoinCollector")
ALL = (*TWX, "ScienceWorld")


@pytest.fixture(autouse=True, scope="module")
def _engines_here() -> None:
    for name in ("textworld-express", "scienceworld"):
        if (missing := engine_requirements(name)) is not None:
            if os.environ.get("CI") == "true":
                pytest.fail(f"{name}: {missing}")
            pytest.skip(f"{name}: {missing}")


def _play(env_id: str, seed: int, actions: list[str] | None = None, settings: EnvSettings | None = None
          ) -> list[tuple[str, bool, float, bool]]:
    """(observation, valid, reward, done) after the reset and every action (the solver's when `actions` is None)."""
    env = make_env(env_id, settings or EnvSettings())
    try:
        goal, observation = env.reset(seed)
        seen = [(goal + "\n" + observation, True, 0.0, False)]
        for index in range(env.max_turns):
            action = env.expert_action() if actions is None else actions[index] if index < len(actions) else None
            if action is None:
                break
            outcome = env.step(action)
            seen.append((outcome.observation, outcome.info.valid, outcome.reward, outcome.done))
            if outcome.done:
                break
        return seen
    finally:
        env.close()


@pytest.mark.parametrize("env_id", ALL)
def test_the_same_seed_is_the_same_game_and_the_same_episode(env_id):
    first, again, other = _play(env_id, 7), _play(env_id, 7), _play(env_id, 9)
    assert first == again
    assert first[0] != other[0]


@pytest.mark.parametrize("env_id", ALL)
def test_the_scripted_solver_solves_train_and_unseen_games(env_id):
    for seed in [*task_pool(env_id, "train", 3, 0), *task_pool(env_id, "eval", 3, 0)]:
        played = _play(env_id, seed)
        observation, _valid, reward, done = played[-1]
        assert done and reward == 1.0, f"{env_id} seed {seed}: {observation[:300]}"
        assert all(v for _, v, _, _ in played)


def test_seeds_map_to_folds_by_parity_and_pools_hold_distinct_games():
    assert task_fold(7, "test") == "train" and task_fold(8, "test") == "test" and task_fold(8, "dev") == "dev"
    assert twx_task(7) == ("train", 3) and twx_task(2 * 1000 + 8) == ("unseen", 4)
    pool = task_pool("TWX-TWC", "train", 200, 0)
    assert len({twx_task(seed) for seed in pool}) == 200
    assert not {twx_task(s) for s in pool} & {twx_task(s) for s in task_pool("TWX-TWC", "eval", 200, 0)}
    # a train seed's game is the train fold's whatever split plays it (recurring evaluation tasks); an even seed's
    # is the unseen fold's
    env = make_env("TWX-TWC", EnvSettings(), split="eval")
    try:
        env.reset(7)
        assert json.loads(env._call("getGenerationPropertiesJSON"))["seed"] == TWX_FOLD_BASE["train"] + 3
        env.reset(8)
        assert json.loads(env._call("getGenerationPropertiesJSON"))["seed"] == TWX_FOLD_BASE["test"] + 4
    finally:
        env.close()


@pytest.mark.parametrize("env_id", TWX)
def test_a_bad_action_uses_the_turn_and_says_what_is_valid(env_id):
    env = make_env(env_id, EnvSettings(), max_turns=2)
    try:
        _goal, observation = env.reset(7)
        outcome = env.step("fly to the moon")
        assert not outcome.info.valid and not outcome.done and outcome.reward == 0.0
        assert outcome.observation.startswith("Invalid action 'fly to the moon'. Valid actions: ")
        assert outcome.observation.endswith(observation)  # the engine was not stepped
        # 'inventory' is a listed action, but a text world does not read it out of a longer command
        assert not env.step("put the shirt in inventory").info.valid
        assert env.done and env.turns == 2
    finally:
        env.close()


def test_scienceworld_sends_unlisted_text_to_its_parser_and_scores_progress():
    env = make_env("ScienceWorld", EnvSettings(), max_turns=10)
    try:
        env.reset(7)
        rejected = env.step("fly to the moon")
        assert not rejected.info.valid and "actions are valid here" in rejected.observation
        gold = env.gold_path()
        first = env.step(gold[0])
        assert first.info.valid and 0.0 < (first.info.score or 0.0) < 1.0
    finally:
        env.close()


def test_valid_actions_in_the_prompt_are_a_setting():
    shown = make_env("TWX-TWC", EnvSettings())
    hidden = make_env("TWX-TWC", EnvSettings(text_worlds=TextWorldSettings(show_valid_actions=False)))
    try:
        assert "Valid actions: " in shown.reset(7)[1]
        assert "Valid actions: " not in hidden.reset(7)[1]
        assert hidden.available_actions() == shown.available_actions()
    finally:
        shown.close()
        hidden.close()


def test_bad_game_parameters_and_tasks_are_config_errors():
    for params, says in [("bogus=1", "refused the game parameters 'bogus=1': Unrecognized property name"),
                         ("numLocations=banana", "made no game of the parameters 'numLocations=banana'")]:
        bad = make_env("TWX-TWC", EnvSettings(text_worlds=TextWorldSettings(twc=params)))
        try:
            with pytest.raises(ConfigError, match=says):
                bad.reset(1)
        finally:
            bad.close()
    for pinned in (None, 3):
        unknown = make_env("ScienceWorld", EnvSettings(text_worlds=TextWorldSettings(
            scienceworld_task="fly", scienceworld_variation=pinned)))
        try:
            with pytest.raises(ConfigError, match=r"unknown ScienceWorld task 'fly'; valid values: .*'boil'"):
                unknown.reset(1)
        finally:
            unknown.close()


def test_a_killed_jvm_fails_the_step_and_the_next_reset_starts_a_fresh_one():
    engine = jvm_engine("textworld-express")
    env = make_env("TWX-TWC", EnvSettings())
    try:
        env.reset(7)
        starts = engine.starts
        engine.process.kill()
        engine.process.wait(timeout=10)
        with pytest.raises(EngineCrashedError, match="textworld-express: stepJSON failed"):
            env.step(env.expert_action() or "look around")
        assert env.reset(7)[1] == _play("TWX-TWC", 7)[0][0].split("\n", 1)[1]
        assert engine.starts == starts + 1
        assert env.step(env.expert_action() or "").info.valid
    finally:
        env.close()
    assert engine.users == 0 and engine.process is None, "the last environment's close stops the JVM"


def _assignment(env_id: str, slot: int, seed: int) -> EpisodeAssigned:
    family = {"TWX-TWC": "twx-twc", "ScienceWorld": "scienceworld"}[env_id]
    return EpisodeAssigned(
        run_id="r", producer=Producer(worker="test", instance="t"), step=0, split="train", env_id=env_id,
        task_family=family, seed=seed, group_id=f"g-{seed}", slot=slot, group_size=8, guided=False, max_turns=8,
        policy_version=0)


def test_a_crash_fails_the_episodes_it_hits_and_the_worker_plays_on():
    """ScienceWorld sends whatever the (untrained) policy writes to its engine, so every turn reaches the JVM."""
    player = EpisodePlayer(RolloutSettings(), EnvSettings(), run_id="r", producer=Producer(worker="t", instance="t"))
    player.policy, player.version = build_tiny(TinyModelSettings()), 0
    engine = jvm_engine("scienceworld")
    try:
        player.start([(_assignment("ScienceWorld", 0, 7), ("crl.tasks", 0), 0),
                      (_assignment("ScienceWorld", 1, 9), ("crl.tasks", 0), 1)])
        assert player.play_turn() == [] and len(player.active) == 2
        engine.process.kill()
        finished = player.play_turn()
        assert len(finished) == 2 and not player.active
        for trajectory in finished:
            assert trajectory.env_error is not None and "scienceworld: step failed" in trajectory.env_error
            assert not trajectory.success and trajectory.reward == 0.0 and len(trajectory.turns) == 2
            assert not trajectory.turns[-1].valid and trajectory.revealed == ()
        # the next episode gets a fresh engine and plays to its end
        starts = engine.starts
        player.start([(_assignment("ScienceWorld", 2, 7), ("crl.tasks", 0), 2)])
        finished = player.play_to_end()
        assert finished[0].env_error is None and len(finished[0].turns) == 8 and engine.starts == starts + 1
        # the worker stops with an episode in flight: its engine stops with it
        player.start([(_assignment("ScienceWorld", 3, 9), ("crl.tasks", 0), 3)])
        process = engine.process
        player.close()
        assert engine.process is None and process.wait(timeout=10) is not None
    finally:
        player.close()


def test_a_crash_at_the_reset_fails_that_episode_before_its_first_turn():
    player = EpisodePlayer(RolloutSettings(), EnvSettings(), run_id="r", producer=Producer(worker="t", instance="t"))
    player.policy, player.version = build_tiny(TinyModelSettings()), 0
    engine = jvm_engine("textworld-express")
    try:
        # an idle environment of the worker's pool holds a game object in the running JVM...
        idle = player.envs.get(_assignment("TWX-TWC", 0, 7))
        idle.reset(7)
        player.envs.put(_assignment("TWX-TWC", 0, 7), idle)
        starts = engine.starts
        engine.process.kill()
        engine.process.wait(timeout=10)
        # ...so the next episode's reset reaches the dead JVM: that episode fails before its first turn
        player.start([(_assignment("TWX-TWC", 1, 9), ("crl.tasks", 0), 1)])
        failed = player.take_failed()
        assert len(failed) == 1 and failed[0].turns == () and not failed[0].success
        assert "textworld-express: generateNewGameJSON failed" in (failed[0].env_error or "")
        # and the one after it, on the same environment, opens a fresh JVM and plays
        player.start([(_assignment("TWX-TWC", 2, 11), ("crl.tasks", 0), 2)])
        assert player.take_failed() == [] and len(player.active) == 1 and engine.starts == starts + 1
        finished = player.play_to_end()
        assert finished[0].env_error is None and finished[0].turns
    finally:
        player.close()
