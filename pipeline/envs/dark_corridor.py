"""A task family where memory must help: named dark corridors, a level of our own in MiniHack's level description
language.

    env = DarkCorridorEnv(max_turns=9)
    goal, observation = env.reset(seed=5)   # "reach the staircase down (>) of the amber heron corridor"

Each task is a straight corridor, 17 squares long and unlit, with the agent in the middle and the staircase down
3 to 6 squares to the west or to the east; the task seed draws the corridor's name, which fixes the side and the
distance. In the dark the agent sees only the squares next to it, so the first observation is the same for every
task and says nothing of the side: a policy without memory picks a side and, at the default turn limit, has no time
to come back (it succeeds about half the time at best). An earlier episode of the same task reveals the side
(`revealed()`: "staircase down: 5 west of the start", or, after walking one side to its end, "staircase down: west
of the start (the other end has none)"; nothing when it explored a side only part of the way), and the corridor's
name in the goal lets retrieval find that lesson again. A T-maze in the sense of the memory literature, in NetHack's
engine. Train pools hold as many corridors with the stairs east as west (`EnvSpec.task_key`), so no fixed side does
better than chance.

Why our own level: MiniHack's dark rooms (`MiniHack-Room-Dark-*`) draw a new layout on every reset, so nothing learnt
in one episode holds in the next; its level description language lets a task seed fix the layout.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.envs.base import ActResult, InvalidActionRule, TextEnv
from pipeline.envs.minihack import ACTION_WORDS, NLE_STEP_LIMIT, NLE_TASK_SUCCESSFUL, MiniHackEnv, nle_seeds
from pipeline.errors import EnvUnavailableError

if TYPE_CHECKING:  # gymnasium loads with minihack, on first use
    from gymnasium import Env

HALF_LENGTH = 8
"""Squares on each side of the start."""
DISTANCES = (3, 4, 5, 6)
"""How far the staircase lies from the start."""
ADJECTIVES = ("amber", "silent", "crooked", "hollow", "copper", "frozen", "velvet", "ashen", "gilded", "mossy",
              "narrow", "sunken", "bitter", "pale", "rusted", "whispering")
CREATURES = ("heron", "badger", "viper", "lynx", "raven", "otter", "moth", "stag", "toad", "falcon", "newt", "boar",
             "wren", "jackal", "carp", "marten", "beetle", "crane", "ferret", "gecko", "hare", "ibis", "owl", "weasel",
             "bison", "cobra", "dingo", "eagle", "goose", "hyena", "koala", "llama")


def corridor_of(seed: int) -> tuple[str, int]:
    """The task of `seed`: the corridor's name and the staircase's offset from the start (negative: west). The name
    fixes the layout, so two seeds that draw one name are one task: an experience of the amber heron corridor is
    true of it whichever seed drew it. Even seeds (eval pools) and odd seeds (train pools) draw from disjoint halves
    of the adjectives, 256 corridors each, so an unseen evaluation corridor is never one trained on."""
    rng = random.Random(f"dark-corridor/{seed}")
    name = f"{rng.choice(ADJECTIVES[seed % 2::2])} {rng.choice(CREATURES)}"
    layout = random.Random(f"dark-corridor/{name}")
    return name, layout.choice((-1, 1)) * layout.choice(DISTANCES)


def level_description(offset: int) -> str:
    """The level in MiniHack's description language: one unlit corridor, the start in the middle, stairs at offset."""
    from minihack import LevelGenerator

    width = 2 * HALF_LENGTH + 1
    layout = "\n".join(["-" * (width + 2), "|" + "." * width + "|", "-" * (width + 2)])
    level = LevelGenerator(map=layout, lit=False, flags=("noteleport", "hardfloor"))
    level.set_start_pos((HALF_LENGTH + 1, 1))
    level.add_goal_pos((HALF_LENGTH + 1 + offset, 1))
    return level.get_des()


class DarkCorridorEnv(MiniHackEnv):
    """Named dark corridors (`MiniHack-DarkCorridor-v0`, task family `minihack-dark-corridor`)."""

    def __init__(self, *, max_turns: int = 9, invalid_action: InvalidActionRule = "skip",
                 env_id: str = "MiniHack-DarkCorridor-v0", task_family: str = "minihack-dark-corridor") -> None:
        TextEnv.__init__(self, max_turns=max_turns, invalid_action=invalid_action)
        try:
            import minihack  # noqa: F401  (registers MiniHack-Navigation-Custom-v0)
        except ImportError as exc:
            raise EnvUnavailableError(
                f"{env_id} needs minihack and nle: pip install 'nle==1.3.0' 'minihack==1.0.2' "
                f"'setuptools<81' ({exc})") from exc
        self.env_id = env_id
        self.task_family = task_family
        self.kind = "corridor"
        self._levels: dict[int, Env[Any, Any]] = {}
        """Offset -> its gymnasium env (eight layouts in all, each built once)."""
        self._actions = tuple(ACTION_WORDS[name] for name in ("N", "E", "S", "W", "NE", "SE", "SW", "NW"))
        self._index = {word: i for i, word in enumerate(self._actions)}
        self._last: dict[str, np.ndarray] = {}
        self._start = (0, 0)
        self._seen: dict[str, tuple[int, int]] = {}
        self._offset = 0
        self._explored = {-1: 0, 1: 0}
        """Side -> farthest square from the start the agent stood on."""

    def _level(self, offset: int) -> Env[Any, Any]:
        if offset not in self._levels:
            import gymnasium as gym

            self._levels[offset] = gym.make(
                "MiniHack-Navigation-Custom-v0", des_file=level_description(offset),
                observation_keys=("chars", "message", "screen_descriptions", "blstats", "glyphs"),
                max_episode_steps=10 * (2 * HALF_LENGTH + 1))
        return self._levels[offset]

    def _reset(self, seed: int) -> tuple[str, str]:
        name, offset = corridor_of(seed)
        return self._start_corridor(seed, name, offset, self._level(offset))

    def _start_corridor(self, seed: int, name: str, offset: int, level: Env[Any, Any]) -> tuple[str, str]:
        """Start the episode of `seed` in `level`, a corridor called `name` with its stairs at `offset`."""
        self._offset = offset
        self._env = level
        core, disp = nle_seeds(seed)
        self._env.unwrapped.seed(core, disp, reseed=False)  # type: ignore[attr-defined]  # NLE's own seed
        self._last, _ = self._env.reset()
        self._start = (int(self._last["blstats"][0]), int(self._last["blstats"][1]))
        self._seen, self._explored = {}, {-1: 0, 1: 0}
        self._note_landmarks()
        return f"reach the staircase down (>) of the {name} corridor", self._describe(self._last)

    def _act(self, action: str) -> ActResult:
        self._last, _reward, terminated, truncated, info = self._env.step(self._index[action])
        end_status = int(info.get("end_status", 0))
        solved = bool(terminated) and end_status == NLE_TASK_SUCCESSFUL
        if not solved:  # a solved episode's last observation is blank: NetHack has left the level
            self._note_landmarks()
            dx = int(self._last["blstats"][0]) - self._start[0]
            if dx:
                side = 1 if dx > 0 else -1
                self._explored[side] = max(self._explored[side], abs(dx))
        else:
            self._seen["staircase down"] = (self._start[0] + self._offset, self._start[1])
        ended = bool(terminated or truncated)
        env_truncated = ended and not solved and (bool(truncated) or end_status == NLE_STEP_LIMIT)
        return ActResult(self._describe(self._last) if not solved else "You reach the staircase down.",
                         solved=solved, lost=ended and not solved, env_truncated=env_truncated)

    def revealed(self) -> tuple[str, ...]:
        """Where the staircase lies relative to the start once seen; else, when one side was walked to its end
        without finding it, that it lies the other way (a corridor has two sides); else nothing: a side explored
        part of the way leaves both open (the stairs may lie further on)."""
        found = super().revealed()
        if found:
            return found
        side = self._known_side()
        if side is None:
            return ()
        return (f"staircase down: {'east' if side > 0 else 'west'} of the start (the other end has none)",)

    def _known_side(self) -> int | None:
        """The side of the stairs this episode has learnt by walking the other side to its end wall."""
        for side, distance in self._explored.items():
            if distance >= HALF_LENGTH:
                return -side
        return None

    def uninformed_actions(self) -> tuple[str, ...]:
        """Without the corridor's layout: keep going the way the agent has gone from the start (a side explored to
        its end means the other), and at the start either way."""
        if not self._last:
            return ()
        side = self._known_side()
        if side is None:
            dx = int(self._last["blstats"][0]) - self._start[0]
            side = (dx > 0) - (dx < 0)
        return ("east",) if side > 0 else ("west",) if side < 0 else ("east", "west")

    def expert_action(self) -> str | None:
        """Straight toward the staircase: the solver knows the layout (the behaviour-cloning warm start's labels)."""
        if not self._last:
            return None
        dx = self._start[0] + self._offset - int(self._last["blstats"][0])
        return "east" if dx > 0 else "west" if dx < 0 else None

    def close(self) -> None:
        for env in self._levels.values():
            env.close()
        self._levels.clear()
