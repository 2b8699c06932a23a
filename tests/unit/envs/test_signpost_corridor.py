"""Signpost corridors on the real engine: the run's rule holds in every corridor, the observation places the
furnishings but does not name the signpost, an episode reveals the side and what stands on it, the flipped control
turns the rule around on unseen corridors only, and the three reference policies score what the design says."""

from __future__ import annotations

import pytest

from pipeline.envs.random_play import random_play
from pipeline.envs.registry import make_env, task_pool
from pipeline.envs.settings import EnvSettings, SignpostSettings
from pipeline.envs.signpost_corridor import FURNISHINGS, run_landmark, signpost_task
from pipeline.errors import ConfigError

ENV_ID = "MiniHack-SignpostCorridor-v0"


def _settings(landmark: str = "altar", *, flip_unseen: bool = False, seed: int = 0) -> EnvSettings:
    return EnvSettings(seed=seed, signpost=SignpostSettings(landmark=landmark, flip_unseen=flip_unseen))  # type: ignore[arg-type]


def _where(observation: str) -> dict[str, str]:
    """The observation's `By the start:` line as furnishing -> 'west' | 'east'."""
    line = next(line for line in observation.splitlines() if line.startswith("By the start: "))
    placed = dict(reversed(part.split(" ")) for part in line.removeprefix("By the start: ").split(", "))
    assert list(placed) == ["west", "east"], line
    return {name: side for side, name in placed.items()}


def test_the_signpost_stands_on_the_stairs_side_of_every_corridor_and_an_episode_reveals_it():
    env = make_env(ENV_ID, _settings("altar"))
    try:
        seeds = task_pool(ENV_ID, "train", 12, 0) + task_pool(ENV_ID, "eval", 12, 0)
        others = set()
        for seed in seeds:
            task = signpost_task(seed, "altar")
            goal, observation = env.reset(seed)
            assert goal == f"reach the staircase down (>) of the {task.name} corridor"
            placed = _where(observation)
            assert set(placed) == {"altar", task.other} and placed["altar"] != placed[task.other]
            side = "east" if task.offset > 0 else "west"
            assert placed["altar"] == side, "the signpost stands on the stairs' side"
            assert "staircase" not in observation and env.revealed() == ()
            symbol = {"altar": "_", "fountain": "{", "sink": "#", "grave": "|"}
            assert observation.splitlines()[2] == f"{symbol[task.west]}@{symbol[task.east]}", "both on the map"
            others.add(task.other)
            assert env.rule_action() == side
            moves = 0
            while not (outcome := env.step(env.expert_action() or "")).done:
                moves += 1
            assert outcome.info.success and moves + 1 == abs(task.offset)
            assert env.revealed() == (f"staircase down: {abs(task.offset)} {side} of the start",
                                      "on the staircase's side: altar")
            # the wrong way to the far wall: the side is revealed all the same, with what stands on it; the line
            # placing the furnishings reads the same at every turn
            env.reset(seed)
            wrong = "west" if side == "east" else "east"
            while not (outcome := env.step(wrong)).done:
                assert _where(outcome.observation) == placed
            assert outcome.info.truncated and not outcome.info.success
            assert env.revealed() == (f"staircase down: {side} of the start (the other end has none)",
                                      "on the staircase's side: altar")
        assert others == set(FURNISHINGS) - {"altar"}, "the other furnishing varies between corridors"
    finally:
        env.close()


def test_naming_a_furnishing_by_the_start_walks_its_way():
    env = make_env(ENV_ID, _settings("fountain"))
    try:
        for seed in task_pool(ENV_ID, "eval", 6, 0):
            task = signpost_task(seed, "fountain")
            _, observation = env.reset(seed)
            assert observation.splitlines()[-1].endswith(f", northwest, {task.west}, {task.east}")
            assert env.available_actions()[-2:] == (task.west, task.east)
            moves = 0
            while not (outcome := env.step(" fountain\n")).done:  # the rule, followed by naming the signpost
                assert outcome.info.action == "fountain" and _where(outcome.observation)["fountain"] == \
                    ("east" if task.offset > 0 else "west")
                moves += 1
            assert outcome.info.success and moves + 1 == abs(task.offset)
            env.reset(seed)
            while not (outcome := env.step(task.other)).done:  # the other one: the far wall, a failure
                pass
            assert outcome.info.truncated and not outcome.info.success
            env.reset(seed)
            absent = next(kind for kind in FURNISHINGS if kind not in (task.west, task.east))
            assert not env.step(absent).info.valid, "a furnishing not by the start is no action"
    finally:
        env.close()


def test_the_flipped_control_turns_the_rule_around_on_unseen_corridors_only():
    env = make_env(ENV_ID, _settings("sink", flip_unseen=True))
    try:
        for split in ("train", "eval"):
            for seed in task_pool(ENV_ID, split, 8, 0):
                task = signpost_task(seed, "sink", flip_unseen=True)
                _goal, observation = env.reset(seed)
                side = "east" if task.offset > 0 else "west"
                on_sink_side = _where(observation)["sink"] == side
                assert on_sink_side == (split == "train"), f"{split} seed {seed}"
                assert task.flipped == (split == "eval")
                while not env.step(env.expert_action() or "").done:
                    pass
                assert env.revealed()[1] == f"on the staircase's side: {'sink' if split == 'train' else task.other}"
    finally:
        env.close()


def test_a_name_fixes_its_corridor_pools_are_balanced_and_disjoint_and_the_signpost_is_per_run_or_per_task():
    layouts: dict[str, tuple[int, str]] = {}
    for seed in range(3000):
        task = signpost_task(seed, "grave")
        assert layouts.setdefault(task.name, (task.offset, task.other)) == (task.offset, task.other)
        assert task.other != "grave"
    train = [signpost_task(seed, "grave") for seed in task_pool(ENV_ID, "train", 32, 0)]
    unseen = [signpost_task(seed, "grave") for seed in task_pool(ENV_ID, "eval", 32, 0)]
    assert sum(task.offset > 0 for task in train) == 16, "as many with the stairs east as west"
    assert not {task.name for task in train} & {task.name for task in unseen}
    # per run: drawn from the run's seed, so the benchmark's seeds meet different signposts
    assert {run_landmark("per-run", seed) for seed in range(20)} == set(FURNISHINGS)
    assert run_landmark("per-run", 3) == run_landmark("per-run", 3) and run_landmark("fountain", 3) == "fountain"
    # per task (a control): no one kind marks the side across corridors
    per_task = [signpost_task(seed, run_landmark("per-task", 0)) for seed in task_pool(ENV_ID, "train", 32, 0)]
    assert len({task.signpost for task in per_task}) == 4
    with pytest.raises(ConfigError, match="unknown signpost 'throne'"):
        run_landmark("throne", 0)  # type: ignore[arg-type]


def test_random_play_a_memoryless_policy_and_the_rule_follower():
    seeds = task_pool(ENV_ID, "eval", 32, 0)
    rates = {policy: random_play(ENV_ID, _settings("fountain"), max_turns=9, seeds=seeds, policy=policy).rate
             for policy in ("random", "memoryless", "rule")}
    assert rates["rule"] == 1.0, "the rule-follower walks straight to the stairs"
    assert 0.2 <= rates["memoryless"] <= 0.8, "without the rule: a coin toss"
    assert rates["random"] <= 0.2
    flipped = random_play(ENV_ID, _settings("fountain", flip_unseen=True), max_turns=9, seeds=seeds, policy="rule")
    assert flipped.rate == 0.0, "on flipped corridors the rule leads to the far wall"
    with pytest.raises(ConfigError, match="no rule across tasks"):
        random_play("MiniHack-DarkCorridor-v0", EnvSettings(), max_turns=9, seeds=seeds[:1], policy="rule")
