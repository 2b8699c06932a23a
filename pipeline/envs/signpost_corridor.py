"""A task family whose lessons carry over to unseen tasks: signpost corridors, dark corridors with a rule.

    env = SignpostCorridorEnv(landmark="altar", max_turns=9)
    goal, observation = env.reset(seed=5)   # "reach the staircase down (>) of the amber heron corridor"
    # observation: "... Where: altar 1 west; fountain 1 east ..."; the stairs lie west, 3 to 6 squares away

Each task is a dark corridor as in `dark_corridor.py` (17 squares, the agent in the middle, the staircase down 3 to 6
squares to one side), with two furnishings next to the start, one on each side: an altar, a fountain, a sink or a
grave. One of the four kinds, the run's *signpost* (`landmark`), stands in every corridor of the run, always on the
stairs' side; the other furnishing is one of the other three kinds, drawn per corridor. The first observation lists
where each furnishing stands (they are next to the agent, so visible in the dark) but not which kind is the signpost,
and an episode that finds the stairs, or walks one side to its end, reveals the side and so which furnishing stood
on it (`revealed()`: "staircase down: 5 west of the start" and "on the staircase's side: altar").

So there are three kinds of lesson an extractor can write from one episode:
- about the one corridor ("the staircase is 5 west of the start"): right on that corridor, a coin toss on another;
- an over-general rule ("the staircase is always west"): a coin toss everywhere;
- the run's rule ("the staircase is on the altar's side"): right on every corridor of the run, seen or not.
Lessons reach other corridors because retrieval is keyed by the goal and the first observation, and the corridor's
name in the goal tells corridors apart (so a same-instance key is a setting away: a similarity floor of 0.99).

Why this design: the regularity is fixed per run, no observation states it, episodes reveal it, and a policy
without the rule cannot do better than a coin toss (the corridor is dark and the turn limit leaves no time to come
back). Controls fall out of it: `landmark="per-task"` draws a signpost per corridor (no rule holds across
corridors), and `flip_unseen` stands the signpost away from the stairs on unseen corridors (even seeds), so a
lesson stating the rule must then hurt.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pipeline.envs.base import InvalidActionRule, TextEnv
from pipeline.envs.dark_corridor import ADJECTIVES, CREATURES, DISTANCES, HALF_LENGTH, DarkCorridorEnv
from pipeline.errors import ConfigError, EnvUnavailableError

if TYPE_CHECKING:  # gymnasium loads with minihack, on first use
    from gymnasium import Env

FURNISHINGS = ("altar", "fountain", "sink", "grave")
"""The kinds of furnishing a corridor has next to its start; the run's signpost is one of them."""

Landmark = Literal["altar", "fountain", "sink", "grave", "per-run", "per-task"]

LEVELS_KEPT = 16
"""Built levels kept open (least recently used closed first): a run's pools hold a few dozen layouts at most."""


@dataclass(frozen=True)
class SignpostTask:
    """One corridor: its name, where its stairs are, and what stands either side of the start."""

    name: str
    offset: int
    """The staircase's offset from the start (negative: west)."""
    signpost: str
    """The run's signpost kind; stands on the stairs' side (the other side where flipped)."""
    other: str
    """The other furnishing, on the other side."""
    flipped: bool = False

    @property
    def west(self) -> str:
        """The furnishing one square west of the start."""
        return self.signpost if (self.offset < 0) != self.flipped else self.other

    @property
    def east(self) -> str:
        return self.other if self.west == self.signpost else self.signpost

    def on_the_stairs_side(self) -> str:
        return self.west if self.offset < 0 else self.east


def run_landmark(landmark: Landmark, run_seed: int) -> str | None:
    """The signpost kind of a run: the one named, drawn from the run's seed for 'per-run', None for 'per-task'."""
    if landmark == "per-task":
        return None
    if landmark == "per-run":
        return random.Random(f"signpost-corridor/run/{run_seed}").choice(FURNISHINGS)
    if landmark not in FURNISHINGS:
        valid = ", ".join((*FURNISHINGS, "per-run", "per-task"))
        raise ConfigError(f"unknown signpost {landmark!r}; valid values: {valid}")
    return landmark


def signpost_task(seed: int, landmark: str | None, *, flip_unseen: bool = False) -> SignpostTask:
    """The task of `seed` in a run whose signpost is `landmark` (None: each corridor draws its own). The name fixes
    the layout (side, distance and, per task, the other furnishing), so two seeds that draw one name are one task.
    Even seeds (eval pools) and odd seeds (train pools) draw from disjoint halves of the adjectives."""
    rng = random.Random(f"signpost-corridor/{seed}")
    name = f"{rng.choice(ADJECTIVES[seed % 2::2])} {rng.choice(CREATURES)}"
    layout = random.Random(f"signpost-corridor/{name}")
    offset = layout.choice((-1, 1)) * layout.choice(DISTANCES)
    own = layout.choice(FURNISHINGS)
    signpost = landmark if landmark is not None else own
    other = layout.choice([kind for kind in FURNISHINGS if kind != signpost])
    return SignpostTask(name, offset, signpost, other, flipped=flip_unseen and seed % 2 == 0)


def level_description(task: SignpostTask) -> str:
    """The corridor in MiniHack's description language: unlit, the start in the middle, the stairs at the task's
    offset, one furnishing on each square next to the start."""
    from minihack import LevelGenerator

    width = 2 * HALF_LENGTH + 1
    layout = "\n".join(["-" * (width + 2), "|" + "." * width + "|", "-" * (width + 2)])
    level = LevelGenerator(map=layout, lit=False, flags=("noteleport", "hardfloor"))
    start = HALF_LENGTH + 1
    level.set_start_pos((start, 1))
    level.add_goal_pos((start + task.offset, 1))
    for kind, x in ((task.west, start - 1), (task.east, start + 1)):
        if kind == "altar":
            level.add_altar(place=(x, 1), align="neutral", type="altar")
        elif kind == "fountain":
            level.add_fountain(place=(x, 1))
        elif kind == "sink":
            level.add_sink(place=(x, 1))
        else:
            level.add_line(f"GRAVE:({x},1)")
    return level.get_des()


class SignpostCorridorEnv(DarkCorridorEnv):
    """Signpost corridors (`MiniHack-SignpostCorridor-v0`, task family `minihack-signpost-corridor`)."""

    landmarks = DarkCorridorEnv.landmarks + FURNISHINGS

    def __init__(self, *, landmark: str | None, flip_unseen: bool = False, max_turns: int = 9,
                 invalid_action: InvalidActionRule = "skip") -> None:
        TextEnv.__init__(self, max_turns=max_turns, invalid_action=invalid_action)
        try:
            import minihack  # noqa: F401  (registers MiniHack-Navigation-Custom-v0)
        except ImportError as exc:
            raise EnvUnavailableError(
                f"MiniHack-SignpostCorridor-v0 needs minihack and nle: pip install 'nle==1.3.0' 'minihack==1.0.2' "
                f"'setuptools<81' ({exc})") from exc
        if landmark is not None and landmark not in FURNISHINGS:
            raise ConfigError(f"unknown signpost {landmark!r}; valid values: {FURNISHINGS} or None (per task)")
        self.env_id = "MiniHack-SignpostCorridor-v0"
        self.task_family = "minihack-signpost-corridor"
        self.kind = "corridor"
        self.landmark = landmark
        self.flip_unseen = flip_unseen
        self.task = SignpostTask("", 0, FURNISHINGS[0], FURNISHINGS[1])
        self._levels: dict[int, Env[Any, Any]] = {}  # a dark corridor's levels by offset: none here
        self._signposted: OrderedDict[SignpostTask, Env[Any, Any]] = OrderedDict()
        """A layout (the task less its name) -> its gymnasium env, least recently used first."""
        self._init_play_state()

    def _level_of(self, task: SignpostTask) -> Env[Any, Any]:
        key = SignpostTask("", task.offset, task.west, task.east)  # the layout, whatever the name
        if key in self._signposted:
            self._signposted.move_to_end(key)
            return self._signposted[key]
        import gymnasium as gym

        env = gym.make("MiniHack-Navigation-Custom-v0", des_file=level_description(task),
                       observation_keys=("chars", "message", "screen_descriptions", "blstats", "glyphs"),
                       max_episode_steps=10 * (2 * HALF_LENGTH + 1))
        self._signposted[key] = env
        if len(self._signposted) > LEVELS_KEPT:
            _, oldest = self._signposted.popitem(last=False)
            oldest.close()
        return env

    def _reset(self, seed: int) -> tuple[str, str]:
        self.task = signpost_task(seed, self.landmark, flip_unseen=self.flip_unseen)
        return self._start_corridor(seed, self.task.name, self.task.offset, self._level_of(self.task))

    def revealed(self) -> tuple[str, ...]:
        """As in a dark corridor (where the stairs lie once found, or that they lie the other way once one side was
        walked to its end), and with it the furnishing that stands on the stairs' side."""
        found = super().revealed()
        if not found:
            return ()
        return (*found, f"on the staircase's side: {self.task.on_the_stairs_side()}")

    def rule_action(self) -> str:
        """Toward the run's signpost: what a lesson stating the run's rule says to do (wrong on a flipped corridor;
        with a signpost per task, toward this corridor's own)."""
        return "west" if self.task.west == self.task.signpost else "east"

    def close(self) -> None:
        for env in self._signposted.values():
            env.close()
        self._signposted.clear()
        super().close()
