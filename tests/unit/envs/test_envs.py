"""Environments behind the text protocol: every MiniHack variant resets, steps, renders and detects success from the
real game; Sokoban rooms are solvable and rendered with the paper's symbols; adapters whose data is missing say what
is missing; the registry's pools are fixed and disjoint; action parsing and the invalid-action rules."""

from __future__ import annotations

import random

import pytest

from pipeline.envs.base import parse_action
from pipeline.envs.registry import ENV_SPECS, draw_tasks, make_env, task_pool
from pipeline.envs.settings import EnvSettings, TaskMix
from pipeline.envs.sokoban import ACTIONS, SokobanEnv, generate_room, render_room, solve
from pipeline.errors import ConfigError, EnvUnavailableError

# A random policy seeded like the task solves these (found once by search; NetHack is deterministic under seeding).
SOLVED_BY_RANDOM_PLAY = [
    ("MiniHack-Room-Random-5x5-v0", 1, 10),
    ("MiniHack-Room-5x5-v0", 5, 48),
    ("MiniHack-Room-Ultimate-5x5-v0", 1, 25),
    ("MiniHack-MazeWalk-9x9-v0", 0, 111),
    ("MiniHack-KeyRoom-S5-v0", 0, 183),
    ("MiniHack-KeyRoom-Dark-S5-v0", 0, 183),
    ("MiniHack-River-Narrow-v0", 63, 245),
]
MINIHACK = [env_id for env_id, _, _ in SOLVED_BY_RANDOM_PLAY]


@pytest.mark.parametrize(("env_id", "seed", "actions"), SOLVED_BY_RANDOM_PLAY)
def test_minihack_variant_resets_steps_renders_and_detects_success(env_id, seed, actions):
    env = make_env(env_id, EnvSettings(), max_turns=400)
    try:
        goal, observation = env.reset(seed)
        assert "staircase down" in goal
        assert observation.startswith("Map:\n") and "@" in observation and "Legend:" in observation
        assert observation.splitlines()[-1] == "Actions: " + ", ".join(env.available_actions())
        assert env.render() in observation and "@" in env.render()
        rng = random.Random(seed)
        for played in range(1, actions + 1):
            outcome = env.step(rng.choice(env.available_actions()))
            assert outcome.info.valid
            if played < actions:
                assert not outcome.done and outcome.reward == 0.0 and not outcome.info.success
        assert outcome.done and outcome.info.success and outcome.reward == 1.0 and not outcome.info.truncated
        with pytest.raises(RuntimeError, match="after the episode ended"):
            env.step("north")
    finally:
        env.close()


@pytest.mark.parametrize("env_id", MINIHACK)
def test_minihack_same_seed_same_task_and_episode(env_id):
    env = make_env(env_id, EnvSettings(), max_turns=30)
    try:
        first = env.reset(11)
        trace = [env.step(action).observation for action in ("east", "south", "southeast")]
        assert env.reset(11) == first
        assert [env.step(action).observation for action in ("east", "south", "southeast")] == trace
        assert env.reset(12) != first or env_id == "MiniHack-Room-5x5-v0"  # Room-5x5 is one fixed map
    finally:
        env.close()


def test_minihack_turn_limit_and_environment_step_limit_are_truncations():
    env = make_env("MiniHack-River-Narrow-v0", EnvSettings(), max_turns=3)
    try:
        env.reset(0)
        outcomes = [env.step("west") for _ in range(3)]
        assert [o.done for o in outcomes] == [False, False, True]
        assert outcomes[-1].info.truncated and not outcomes[-1].info.success and outcomes[-1].reward == 0.0
    finally:
        env.close()
    env = make_env("MiniHack-River-Narrow-v0", EnvSettings(), max_turns=400)  # River's own limit is 350 steps
    try:
        env.reset(0)
        rng = random.Random(0)
        steps = 0
        while not (outcome := env.step(rng.choice(env.available_actions()))).done:
            steps += 1
        assert steps + 1 == 350 and outcome.info.truncated and not outcome.info.success
    finally:
        env.close()


def test_keyroom_lists_pickup_and_apply_and_reports_the_inventory():
    env = make_env("MiniHack-KeyRoom-S5-v0", EnvSettings())
    try:
        _, observation = env.reset(0)
        assert env.available_actions()[-2:] == ("pickup", "apply")
        assert "Inventory: nothing" in observation and "key " in observation.split("Where: ")[1]
    finally:
        env.close()


def test_invalid_action_rules():
    skip = make_env("MiniHack-Room-5x5-v0", EnvSettings(invalid_action="skip"), max_turns=2)
    try:
        _, first = skip.reset(0)
        outcome = skip.step("dance wildly")
        assert not outcome.info.valid and outcome.info.action == "" and not outcome.done and outcome.reward == 0.0
        assert outcome.observation.startswith("Invalid action 'dance wildly'. Valid actions: north, east")
        assert outcome.observation.endswith(first)  # the environment was not stepped
        again = skip.step("???")
        assert again.done and again.info.truncated and again.observation.count("Invalid action") == 1
    finally:
        skip.close()
    end = make_env("MiniHack-Room-5x5-v0", EnvSettings(invalid_action="end"), max_turns=30)
    try:
        end.reset(0)
        outcome = end.step("dance")
        assert outcome.done and not outcome.info.success and not outcome.info.truncated and outcome.reward == 0.0
    finally:
        end.close()


@pytest.mark.parametrize(("response", "expected"), [
    ("east", "east"), ("Action: NorthEast\nmore", "northeast"), ("  \n go south now", "south"),
    ("northeastern", None), ("", None), ("pick up", None), ("apply the key", "apply"), ("north east", "north"),
    # What a chat model writes: the first action word of its first non-empty line counts; anything else is invalid.
    ("south", "south"), ("I move south.", "south"), ("Action: south", "south"), ("**South**", "south"),
    ("Sure! Let me think.\nsouth", None), ("I cannot decide.", None),
])
def test_parse_action(response, expected):
    actions = ("north", "east", "south", "west", "northeast", "southeast", "southwest", "northwest", "pickup", "apply")
    assert parse_action(response, actions) == expected


def test_parse_text_actions():
    actions = ("go to cabinet 1", "go to cabinet 10", "open drawer 2", "search[", "click[Buy Now]")
    assert parse_action("go to cabinet 10", actions) == "go to cabinet 10"
    assert parse_action("Action: open drawer 2 please", actions) == "open drawer 2"
    assert parse_action("search[red shoes]", actions) == "search["
    assert parse_action("click[buy now]", actions) == "click[Buy Now]"
    # a longer command is matched before a single-word action found among its words; text worlds do without those
    commands = ("inventory", "move egg to box", "look around")
    assert parse_action("move egg to box", commands) == "move egg to box"
    assert parse_action("move the egg in inventory to box", commands) == "inventory"
    assert parse_action("move the egg in inventory to box", commands, words=False) is None
    assert parse_action("inventory", commands, words=False) == "inventory"


# -- Sokoban ---------------------------------------------------------------------------------------------------------


def test_sokoban_rooms_are_solvable_deterministic_and_use_the_paper_symbols():
    for seed in range(60):
        room = generate_room(seed)
        assert room == generate_room(seed)
        assert len(room.boxes) == len(room.targets) == 2 and room.boxes != room.targets
        solution = solve(room.walls, room.targets, room.boxes, room.player)
        assert solution is not None and len(solution) == len(room.solution) >= 4  # BFS: optimal
        text = render_room(room.walls, room.targets, room.boxes, room.player)
        rows = text.splitlines()
        assert len(rows) == 6 and all(len(row) == 6 for row in rows)
        assert set(text) <= set("W.GBCA@\n") and rows[0] == "WWWWWW" and rows[-1] == "WWWWWW"
        assert text.count("A") + text.count("@") == 1
        assert text.count("B") + text.count("C") == 2 and text.count("G") + text.count("C") + text.count("@") >= 2


def test_sokoban_playing_the_solution_succeeds_and_pushes_work_as_in_sokoban():
    env = SokobanEnv(max_turns=30)
    goal, observation = env.reset(3)
    assert "B" in goal and "Actions: up, down, left, right" in observation
    assert env.render() == "WWWWWW\nW@...W\nWB...W\nW....W\nW.C..W\nWWWWWW"
    assert env.step("up").observation == observation  # a wall: valid, no effect
    outcome = env.step("right")
    assert env.render() == "WWWWWW\nWGA..W\nWB...W\nW....W\nW.C..W\nWWWWWW"
    env.reset(3)
    for move in env.room.solution:
        outcome = env.step(move)
    assert outcome.done and outcome.info.success and outcome.reward == 1.0 and "Boxes on targets: 2 of 2" in \
        outcome.observation
    assert ACTIONS == ("up", "down", "left", "right")


def test_sokoban_solver_knows_unsolvable_rooms():
    walls = frozenset((r, c) for r in range(6) for c in range(6) if r in (0, 5) or c in (0, 5))
    # A box in a corner can never move.
    assert solve(walls, frozenset({(2, 2)}), frozenset({(1, 1)}), (3, 3)) is None
    assert solve(walls, frozenset({(1, 2)}), frozenset({(1, 3)}), (1, 4)) == ("left",)


# -- adapters without their data, the registry ------------------------------------------------------------------------


@pytest.mark.parametrize(("env_id", "missing"), [
    ("ALFWorld", "alfworld"), ("WebShop", "WebShop"), ("SWE-Bench-Verified", "swebench")])
def test_adapters_without_their_package_or_data_raise_one_clear_error(env_id, missing):
    with pytest.raises(EnvUnavailableError, match=rf"{env_id} cannot run here: .*{missing}.*To get it: "):
        make_env(env_id, EnvSettings())
    assert issubclass(EnvUnavailableError, ConfigError)  # a worker stops at start, it does not dead-letter tasks


def test_registry_lists_every_environment_with_the_paper_turn_limits():
    assert {spec.env_id: spec.max_turns for spec in ENV_SPECS.values() if not spec.runs_here} == {
        "ALFWorld": 40, "WebShop": 15, "SWE-Bench-Verified": 50}
    assert {spec.task_family for spec in ENV_SPECS.values() if spec.env_id.startswith("MiniHack-Room")} == {
        "minihack-room"}
    with pytest.raises(ConfigError, match="unknown env id 'Pong'; valid values: "):
        make_env("Pong", EnvSettings())


def test_task_pools_are_fixed_and_train_and_eval_never_share_a_task():
    train = task_pool("Sokoban-6x6-2box", "train", 500, seed=0)
    evaluation = task_pool("Sokoban-6x6-2box", "eval", 50, seed=0)
    assert train == task_pool("Sokoban-6x6-2box", "train", 500, seed=0)
    assert len(set(train)) == 500 and len(set(evaluation)) == 50 and not set(train) & set(evaluation)
    assert task_pool("Sokoban-6x6-2box", "train", 10, seed=0) == train[:10]
    assert task_pool("Sokoban-6x6-2box", "train", 10, seed=1) != train[:10]
    assert task_pool("MiniHack-MazeWalk-9x9-v0", "train", 10, seed=0) != train[:10]


def test_mixture_draw_follows_the_weights_and_is_a_function_of_the_step():
    mixture = EnvSettings(tasks=(TaskMix(env_id="MiniHack-Room-Random-5x5-v0", weight=3.0),
                                       TaskMix(env_id="Sokoban-6x6-2box", weight=1.0)), train_pool_size=50)
    for step in range(5):
        drawn = draw_tasks(mixture, step, groups=8)
        assert drawn == draw_tasks(mixture, step, groups=8)
        assert [entry.env_id for entry, _ in drawn] == ["MiniHack-Room-Random-5x5-v0"] * 6 + ["Sokoban-6x6-2box"] * 2
        pool = set(task_pool("Sokoban-6x6-2box", "train", 50, 0))
        assert all(seed in pool for entry, seed in drawn if entry.env_id == "Sokoban-6x6-2box")
    assert draw_tasks(mixture, 0, 8) != draw_tasks(mixture, 1, 8)
    even = EnvSettings(tasks=(TaskMix(env_id="MiniHack-Room-Random-5x5-v0"), TaskMix(env_id="Sokoban-6x6-2box"),
                                    TaskMix(env_id="MiniHack-MazeWalk-9x9-v0")))
    counts = [len(draw_tasks(even, step, groups=4)) for step in range(6)]
    assert counts == [4] * 6
    extra = {entry.env_id for step in range(12) for entry, _ in draw_tasks(even, step, 4)
             if sum(e.env_id == entry.env_id for e, _ in draw_tasks(even, step, 4)) == 2}
    assert len(extra) >= 2  # the leftover group rotates between environments


def test_minihack_reveals_landmarks_relative_to_the_start():
    env = make_env("MiniHack-KeyRoom-S5-v0", EnvSettings(), max_turns=20)
    _goal, observation = env.reset(3)
    # lit: what the first observation shows relative to the agent is where it lies relative to the start
    assert "Where: key 1 south, 3 west; locked door 2 north, 2 west" in observation
    assert env.revealed() == ("key: 1 south, 3 west of the start", "locked door: 2 north, 2 west of the start")
    # the agent moves: the observation's offsets change, the start-relative facts do not
    assert "Where: key 1 south, 2 west" in env.step("west").observation
    assert env.revealed() == ("key: 1 south, 3 west of the start", "locked door: 2 north, 2 west of the start")
    env.close()


def test_random_play_is_reproducible_and_its_interval_is_wilsons():
    from pipeline.envs.random_play import RandomPlay, random_play

    seeds = task_pool("MiniHack-Room-Random-5x5-v0", "eval", 12, 0)
    first = random_play("MiniHack-Room-Random-5x5-v0", EnvSettings(), max_turns=8, seeds=seeds, rng_seed=1)
    assert first == random_play("MiniHack-Room-Random-5x5-v0", EnvSettings(), max_turns=8, seeds=seeds, rng_seed=1)
    assert first.episodes == 12 and 0 <= first.successes <= 12 and 1 <= first.mean_turns <= 8
    # Wilson 95%: 0 of 10 -> (0, z^2 / (n + z^2)) = (0, 0.2775); 5 of 10 -> 0.5 -+ 0.2633 = (0.2366, 0.7634)
    low, high = RandomPlay("x", 8, 10, 0, 8.0).interval()
    assert low == 0.0 and high == pytest.approx(0.27753, abs=1e-4)
    low, high = RandomPlay("x", 8, 10, 5, 8.0).interval()
    assert (low, high) == (pytest.approx(0.23659, abs=1e-4), pytest.approx(0.76341, abs=1e-4))


def test_dark_corridors_hide_the_side_until_explored_and_reveal_it_after():
    from pipeline.envs.dark_corridor import DISTANCES, corridor_of

    env = make_env("MiniHack-DarkCorridor-v0", EnvSettings())
    try:
        seeds = task_pool("MiniHack-DarkCorridor-v0", "train", 12, 0)
        tasks = [corridor_of(seed) for seed in seeds]
        assert {offset > 0 for _name, offset in tasks} == {True, False}
        assert all(abs(offset) in DISTANCES for _name, offset in tasks)
        assert len({name for name, _offset in tasks}) >= 10, "the name tells tasks apart"
        firsts = set()
        for seed, (name, offset) in zip(seeds, tasks, strict=True):
            goal, observation = env.reset(seed)
            assert goal == f"reach the staircase down (>) of the {name} corridor"
            assert "moon" not in observation, "nothing that depends on the date"
            firsts.add(observation)
            assert env.revealed() == ()
            moves = 0
            while not (outcome := env.step(env.expert_action() or "")).done:  # the solver walks straight there
                moves += 1
            assert outcome.info.success and moves + 1 == abs(offset)
            side = "east" if offset > 0 else "west"
            assert env.revealed() == (f"staircase down: {abs(offset)} {side} of the start",)
            # the same task again, the wrong way: the turn limit (9) ends it at the far wall, unsolved
            assert env.reset(seed) == (goal, observation)
            wrong = "west" if offset > 0 else "east"
            while not (outcome := env.step(wrong)).done:
                pass
            assert outcome.info.truncated and not outcome.info.success
            # the far wall of the wrong side reached: the stairs are the other way, named as a way to go
            assert env.revealed() == (f"staircase down: {side} of the start (the other end has none)",)
            # part of the way: both sides still open, nothing revealed; the solver without the layout keeps going
            env.reset(seed)
            assert env.uninformed_actions() == ("east", "west"), "at the start either way"
            env.step(wrong)
            env.step(wrong)
            assert env.revealed() == ()
            assert env.uninformed_actions() == (wrong,) and env.expert_action() == side
        assert len(firsts) == 1, "in the dark every corridor starts alike: only memory tells the side"
    finally:
        env.close()


def test_a_corridor_name_fixes_its_layout_and_pools_are_balanced_and_disjoint():
    from pipeline.envs.dark_corridor import corridor_of

    layouts: dict[str, int] = {}
    for seed in range(4000):  # 256 names per parity: every name is drawn many times
        name, offset = corridor_of(seed)
        assert layouts.setdefault(name, offset) == offset, "two seeds that draw one name are one corridor"
    train = {corridor_of(seed) for seed in task_pool("MiniHack-DarkCorridor-v0", "train", 64, 0)}
    unseen = {corridor_of(seed) for seed in task_pool("MiniHack-DarkCorridor-v0", "eval", 64, 0)}
    assert len(train) == len(unseen) == 64, "a pool holds distinct corridors"
    assert sum(offset > 0 for _name, offset in train) == 32, "as many with the stairs east as west"
    assert not {name for name, _ in train} & {name for name, _ in unseen}, "an unseen corridor is never a train one"
    with pytest.raises(ConfigError, match="fewer than 300 distinct train tasks"):
        task_pool("MiniHack-DarkCorridor-v0", "train", 300, 0)
