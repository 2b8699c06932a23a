"""The environment registry: every env id the scheduler may assign, its task family, turn limit and constructor;
fixed, seeded task pools per environment (train and eval, disjoint); and the mixture draw of a step's tasks.

    env = make_env("MiniHack-MazeWalk-9x9-v0", EnvSettings())
    pool = task_pool("MiniHack-MazeWalk-9x9-v0", "eval", size=8, seed=0)     # the same 8 seeds every time
    tasks = draw_tasks(settings.envs, step=3, groups=4)                 # [(env_id, seed), ...]

Task families partition the bank (retrieval searches within the family): the MiniHack Room variants share one
family, every other environment is its own.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from pipeline.envs.base import TaskRule, TextEnv
from pipeline.envs.settings import EnvSettings, TaskMix
from pipeline.errors import ConfigError
from schemas.base import Split


@dataclass(frozen=True)
class EnvSpec:
    env_id: str
    task_family: str
    max_turns: int
    """The paper's turn limit (docs/environments.md)."""
    build: Callable[[EnvSettings, int, Split], TextEnv]
    """(env settings, max turns, split) -> a new environment."""
    runs_here: bool
    """False for environments whose data or services are not on the development machines."""
    task_key: Callable[[int], tuple[Hashable, Hashable]] | None = None
    """Where several seeds can draw one task: seed -> (the task it draws, its kind). A pool then holds distinct
    tasks, each of the `kinds` equally often (give or take one)."""
    kinds: int = 1
    engine: str | None = None
    """The Java engine it runs on (`pipeline.envs.jvm.ENGINES`), where it has one: it needs Java and that package."""
    task_rule: Callable[[], TaskRule] | None = None
    """Where one rule holds across the family's tasks (signpost corridors; its env's `rule_action` follows it): the
    rule and the lessons about it (loaded on first use)."""

    @property
    def rule(self) -> bool:
        """Whether one rule holds across the family's tasks."""
        return self.task_rule is not None


def _minihack(env_id: str, family: str, kind: str) -> Callable[[EnvSettings, int, Split], TextEnv]:
    def build(settings: EnvSettings, max_turns: int, split: Split) -> TextEnv:
        from pipeline.envs.minihack import MiniHackEnv

        return MiniHackEnv(env_id, task_family=family, kind=kind, max_turns=max_turns,
                           invalid_action=settings.invalid_action)
    return build


def _dark_corridor(settings: EnvSettings, max_turns: int, split: Split) -> TextEnv:
    from pipeline.envs.dark_corridor import DarkCorridorEnv

    return DarkCorridorEnv(max_turns=max_turns, invalid_action=settings.invalid_action)


def _corridor_key(seed: int) -> tuple[Hashable, Hashable]:
    from pipeline.envs.dark_corridor import corridor_of

    name, offset = corridor_of(seed)
    return name, offset > 0


def _signpost_corridor(settings: EnvSettings, max_turns: int, split: Split) -> TextEnv:
    from pipeline.envs.signpost_corridor import SignpostCorridorEnv, run_landmark

    return SignpostCorridorEnv(landmark=run_landmark(settings.signpost.landmark, settings.seed),
                               flip_unseen=settings.signpost.flip_unseen, max_turns=max_turns,
                               invalid_action=settings.invalid_action)


def _signpost_key(seed: int) -> tuple[Hashable, Hashable]:
    from pipeline.envs.signpost_corridor import signpost_task

    task = signpost_task(seed, None)
    return task.name, task.offset > 0


def _signpost_rule() -> TaskRule:
    from pipeline.envs.signpost_corridor import SIGNPOST_RULE

    return SIGNPOST_RULE


def _sokoban(settings: EnvSettings, max_turns: int, split: Split) -> TextEnv:
    from pipeline.envs.sokoban import SokobanEnv

    return SokobanEnv(max_turns=max_turns, invalid_action=settings.invalid_action)


def _twx(game: str) -> Callable[[EnvSettings, int, Split], TextEnv]:
    def build(settings: EnvSettings, max_turns: int, split: Split) -> TextEnv:
        from pipeline.envs.text_worlds import TextWorldExpressEnv

        return TextWorldExpressEnv(game, settings.text_worlds, max_turns=max_turns,
                                   invalid_action=settings.invalid_action)
    return build


def _twx_key(seed: int) -> tuple[Hashable, Hashable]:
    from pipeline.envs.text_worlds import twx_task

    return twx_task(seed), 0


def _scienceworld(settings: EnvSettings, max_turns: int, split: Split) -> TextEnv:
    from pipeline.envs.text_worlds import ScienceWorldEnv

    return ScienceWorldEnv(settings.text_worlds, max_turns=max_turns, invalid_action=settings.invalid_action)


def _alfworld(settings: EnvSettings, max_turns: int, split: Split) -> TextEnv:
    from pipeline.envs.external import AlfWorldEnv

    return AlfWorldEnv(data_dir=settings.alfworld_data, split=split, max_turns=max_turns,
                       invalid_action=settings.invalid_action)


def _webshop(settings: EnvSettings, max_turns: int, split: Split) -> TextEnv:
    from pipeline.envs.external import WebShopEnv

    return WebShopEnv(num_products=settings.webshop_num_products, max_turns=max_turns,
                      invalid_action=settings.invalid_action)


def _swebench(settings: EnvSettings, max_turns: int, split: Split) -> TextEnv:
    from pipeline.envs.external import SweBenchEnv

    return SweBenchEnv(instances_file=settings.swebench_instances, max_turns=max_turns,
                       invalid_action=settings.invalid_action)


_SPECS = [
    EnvSpec("MiniHack-Room-Random-5x5-v0", "minihack-room", 30,
            _minihack("MiniHack-Room-Random-5x5-v0", "minihack-room", "room"), True),
    EnvSpec("MiniHack-Room-5x5-v0", "minihack-room", 30, _minihack("MiniHack-Room-5x5-v0", "minihack-room", "room"),
            True),
    EnvSpec("MiniHack-Room-Ultimate-5x5-v0", "minihack-room", 30,
            _minihack("MiniHack-Room-Ultimate-5x5-v0", "minihack-room", "room"), True),
    EnvSpec("MiniHack-MazeWalk-9x9-v0", "minihack-maze", 30,
            _minihack("MiniHack-MazeWalk-9x9-v0", "minihack-maze", "maze"), True),
    EnvSpec("MiniHack-KeyRoom-S5-v0", "minihack-keyroom", 30,
            _minihack("MiniHack-KeyRoom-S5-v0", "minihack-keyroom", "keyroom"), True),
    EnvSpec("MiniHack-KeyRoom-Dark-S5-v0", "minihack-keyroom", 30,
            _minihack("MiniHack-KeyRoom-Dark-S5-v0", "minihack-keyroom", "keyroom"), True),
    EnvSpec("MiniHack-River-Narrow-v0", "minihack-river", 30,
            _minihack("MiniHack-River-Narrow-v0", "minihack-river", "river"), True),
    EnvSpec("MiniHack-DarkCorridor-v0", "minihack-dark-corridor", 9, _dark_corridor, True, _corridor_key, kinds=2),
    EnvSpec("MiniHack-SignpostCorridor-v0", "minihack-signpost-corridor", 9, _signpost_corridor, True,
            _signpost_key, kinds=2, task_rule=_signpost_rule),
    EnvSpec("Sokoban-6x6-2box", "sokoban", 30, _sokoban, True),
    EnvSpec("TWX-CookingWorld", "twx-cookingworld", 30, _twx("cookingworld"), True, _twx_key,
            engine="textworld-express"),
    EnvSpec("TWX-TWC", "twx-twc", 20, _twx("twc"), True, _twx_key, engine="textworld-express"),
    EnvSpec("TWX-CoinCollector", "twx-coin", 20, _twx("coin"), True, _twx_key, engine="textworld-express"),
    EnvSpec("ScienceWorld", "scienceworld", 40, _scienceworld, True, engine="scienceworld"),
    EnvSpec("ALFWorld", "alfworld", 40, _alfworld, False),
    EnvSpec("WebShop", "webshop", 15, _webshop, False),
    EnvSpec("SWE-Bench-Verified", "swebench", 50, _swebench, False),
]
ENV_SPECS: dict[str, EnvSpec] = {spec.env_id: spec for spec in _SPECS}


def env_spec(env_id: str) -> EnvSpec:
    try:
        return ENV_SPECS[env_id]
    except KeyError:
        raise ConfigError(f"unknown env id {env_id!r}; valid values: {sorted(ENV_SPECS)}") from None


def make_env(env_id: str, settings: EnvSettings, *, max_turns: int | None = None, split: Split = "train") -> TextEnv:
    """A new environment; raises `EnvUnavailableError` (a `ConfigError`) when its package or data is missing."""
    spec = env_spec(env_id)
    return spec.build(settings, max_turns or spec.max_turns, split)


def _seed_stream(*parts: object) -> random.Random:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def task_pool(env_id: str, split: Split, size: int, seed: int) -> tuple[int, ...]:
    """`size` distinct task seeds of `env_id` for `split`, fixed by (`env_id`, `split`, `seed`). Train and eval pools
    of the same `seed` never share a task: eval seeds are even, train seeds odd. Where seeds can draw one task
    (`EnvSpec.task_key`, the dark corridors), the pool holds distinct tasks, its kinds in equal shares."""
    spec = env_spec(env_id)
    if size <= 0:
        raise ConfigError(f"a task pool needs a positive size, got {size}")
    rng = _seed_stream("pool", env_id, seed)
    parity = 0 if split == "eval" else 1
    seeds: list[int] = []
    seen: set[int] = set()
    tasks: set[Hashable] = set()
    kinds: dict[Hashable, int] = {}
    share = -(-size // spec.kinds)
    for _ in range(1000 * size):
        if len(seeds) == size:
            return tuple(seeds)
        candidate = rng.randrange(2**30) * 2 + parity
        if candidate in seen:
            continue
        seen.add(candidate)
        if spec.task_key is not None:
            task, kind = spec.task_key(candidate)
            if task in tasks or kinds.get(kind, 0) >= share:
                continue
            tasks.add(task)
            kinds[kind] = kinds.get(kind, 0) + 1
        seeds.append(candidate)
    raise ConfigError(f"{env_id} has fewer than {size} distinct {split} tasks for a pool of that size")


def draw_tasks(settings: EnvSettings, step: int, groups: int) -> list[tuple[TaskMix, int]]:
    """The (mixture entry, task seed) of each of a step's `groups` groups: entries in proportion to their weights
    (largest remainder, so a 2-env mixture with 4 groups gets exactly 2 each), seeds drawn from each entry's train
    pool. A pure function of (settings, step): a restarted scheduler draws the same tasks."""
    weights = [task.weight for task in settings.tasks]
    total = sum(weights)
    exact = [groups * w / total for w in weights]
    counts = [int(x) for x in exact]
    rng = _seed_stream("step", settings.seed, step)
    # Leftover groups go to the largest remainders; among equal remainders the step's draw rotates the choice, so
    # every environment of an even mixture gets its turn.
    leftovers = groups - sum(counts)
    ties = sorted(range(len(exact)), key=lambda i: (-(round(exact[i] - counts[i], 9)), rng.random()))
    for i in ties[:leftovers]:
        counts[i] += 1
    tasks = []
    for entry, count in zip(settings.tasks, counts, strict=True):
        pool = task_pool(entry.env_id, "train", settings.train_pool_size, settings.seed)
        tasks += [(entry, rng.choice(pool)) for _ in range(count)]
    return tasks
