"""A task family whose lessons carry over to unseen tasks: signpost corridors, dark corridors with a rule.

    env = SignpostCorridorEnv(landmark="altar", max_turns=9)
    goal, observation = env.reset(seed=5)   # "reach the staircase down (>) of the amber heron corridor"
    # observation: "... By the start: altar west, fountain east ..."; the stairs lie west, 3 to 6 squares away

Each task is a dark corridor as in `dark_corridor.py` (17 squares, the agent in the middle, the staircase down 3 to 6
squares to one side), with two furnishings next to the start, one on each side: an altar, a fountain, a sink or a
grave. One of the four kinds, the run's *signpost* (`landmark`), stands in every corridor of the run, always on the
stairs' side; the other furnishing is one of the other three kinds, drawn per corridor. Every observation says which
stands on which side of the start (`By the start: altar west, fountain east`: they are next to the agent at the
start, so visible in the dark, and the line stays the same as the agent moves) but not which kind is the signpost.
Besides the compass directions the actions include both furnishings' names, and naming one walks a square its way:
a lesson naming a furnishing is then followed by saying what it says, as one naming a side is (a tiny model that
copies a side from a lesson did not learn to look a furnishing's side up in the observation). An episode that
finds the stairs, or walks one side to its end, reveals the side and so which furnishing stood
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
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from pipeline.envs.base import ActResult, InvalidActionRule
from pipeline.envs.dark_corridor import ADJECTIVES, CREATURES, DISTANCES, HALF_LENGTH, DarkCorridorEnv
from pipeline.errors import ConfigError, InvalidArgumentError

if TYPE_CHECKING:  # gymnasium loads with minihack, on first use
    from gymnasium import Env

FURNISHINGS = ("altar", "fountain", "sink", "grave")
"""The kinds of furnishing a corridor has next to its start; the run's signpost is one of them."""

Landmark = Literal["altar", "fountain", "sink", "grave", "per-run", "per-task"]

LessonKind = Literal["rule", "instance", "over-general"]
"""What a lesson about a signpost corridor states: the run's rule, the one corridor's fact, or a side for all."""
LESSON_KINDS: tuple[LessonKind, ...] = ("rule", "instance", "over-general")

_SIDE_FACT = re.compile(r"staircase down: (?:(\d+) )?(east|west) of the start")
_SIGNPOST_FACT = re.compile(r"on the staircase's side: (\w+)")
_RULE = re.compile(r"staircase down is on the (\w+)'s side")
_OVER_GENERAL = re.compile(r"staircase down is always (east|west)")

BY_THE_START = "By the start: "
"""The observation line that places the furnishings (`By the start: altar west, fountain east`)."""

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


def lesson_statement(revealed: tuple[str, ...], kind: LessonKind) -> str | None:
    """What a lesson of `kind` says, from what an episode revealed (`SignpostCorridorEnv.revealed`), or None when it
    revealed nothing: the corridor's own fact as revealed ('instance'), 'the staircase down is always west' ('over-
    general'), or 'the staircase down is on the altar's side' ('rule')."""
    side = next((m for m in map(_SIDE_FACT.search, revealed) if m), None)
    signpost = next((m for m in map(_SIGNPOST_FACT.search, revealed) if m), None)
    if side is None or signpost is None:
        return None
    if kind == "instance":
        return side.group(0)
    if kind == "over-general":
        return f"the staircase down is always {side.group(2)} of the start"
    return f"the staircase down is on the {signpost.group(1)}'s side"


def lesson_kind(text: str, signpost: str | None) -> Literal["rule", "wrong rule", "instance", "over-general"] | None:
    """What a lesson states about signpost corridors whose signpost is `signpost`: the rule (naming the signpost),
    a wrong rule (naming another furnishing, or any with no signpost across corridors), a side for all corridors, a
    side for one (a distance or an end), or nothing of these (None). A lesson stating several counts as its rule."""
    rule = _RULE.search(text)
    if rule is not None:
        return "rule" if signpost is not None and rule.group(1) == signpost else "wrong rule"
    if _OVER_GENERAL.search(text):
        return "over-general"
    if _SIDE_FACT.search(text):
        return "instance"
    return None


def revealed_for(first_observation: str, side: str, distance: int) -> tuple[str, ...]:
    """What an episode of the corridor that starts with `first_observation` would reveal had its stairs lain
    `distance` squares to `side`: the side, and the furnishing its `By the start:` line places there."""
    where = next((line for line in first_observation.splitlines() if line.startswith(BY_THE_START)), "")
    on_side = [part.split(" ", 1)[0] for part in where.removeprefix(BY_THE_START).split(", ")
               if part.endswith(f" {side}") and part.split(" ", 1)[0] in FURNISHINGS]
    if side not in ("east", "west") or len(on_side) != 1:
        raise InvalidArgumentError(f"no one furnishing stands {side} of the start in {where!r}")
    return (f"staircase down: {distance} {side} of the start", f"on the staircase's side: {on_side[0]}")


class SignpostRule:
    """Signpost corridors' rule (`pipeline.envs.base.TaskRule`): the stairs are on the signpost's side."""

    kinds: tuple[str, ...] = LESSON_KINDS
    sides: tuple[str, ...] = ("west", "east")
    distances: tuple[int, ...] = DISTANCES

    def statement(self, revealed: tuple[str, ...], kind: str) -> str | None:
        if kind not in LESSON_KINDS:
            raise InvalidArgumentError(f"unknown lesson kind {kind!r}; valid values: {', '.join(LESSON_KINDS)}")
        return lesson_statement(revealed, kind)

    def revealed_for(self, first_observation: str, side: str, distance: int) -> tuple[str, ...]:
        return revealed_for(first_observation, side, distance)

    def turned_around(self, revealed: tuple[str, ...], first_observation: str) -> tuple[str, ...]:
        side = next((m for m in map(_SIDE_FACT.search, revealed) if m), None)
        if side is None:
            return revealed
        other = "east" if side.group(2) == "west" else "west"
        turned = revealed_for(first_observation, other, int(side.group(1) or 0))
        return turned if side.group(1) else (f"staircase down: {other} of the start (the other end has none)",
                                               turned[1])

    def kind_of(self, text: str, task_rule: str | None) -> str | None:
        return lesson_kind(text, task_rule)

    def rule_in(self, revealed: tuple[str, ...]) -> str | None:
        signpost = next((m for m in map(_SIGNPOST_FACT.search, revealed) if m), None)
        return signpost.group(1) if signpost is not None else None

    def action_for(self, revealed: tuple[str, ...], kind: str) -> str:
        if kind == "rule" and (signpost := self.rule_in(revealed)) is not None:
            return signpost
        side = next((m for m in map(_SIDE_FACT.search, revealed) if m), None)
        if side is None:
            raise InvalidArgumentError(f"no side of the start in {revealed!r}")
        return side.group(2)


SIGNPOST_RULE = SignpostRule()


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


    def __init__(self, *, landmark: str | None, flip_unseen: bool = False, max_turns: int = 9,
                 invalid_action: InvalidActionRule = "skip") -> None:
        if landmark is not None and landmark not in FURNISHINGS:
            raise ConfigError(f"unknown signpost {landmark!r}; valid values: {FURNISHINGS} or None (per task)")
        super().__init__(max_turns=max_turns, invalid_action=invalid_action, env_id="MiniHack-SignpostCorridor-v0",
                         task_family="minihack-signpost-corridor")
        self.landmark = landmark
        self.flip_unseen = flip_unseen
        self.task = SignpostTask("", 0, FURNISHINGS[0], FURNISHINGS[1])
        self._signposted: OrderedDict[SignpostTask, Env[Any, Any]] = OrderedDict()
        """A layout (the task less its name) -> its gymnasium env, least recently used first."""

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

    def available_actions(self) -> tuple[str, ...]:
        """The compass directions, and the two furnishings by the start: naming one walks a square its way."""
        return (*super().available_actions(), self.task.west, self.task.east)

    def _act(self, action: str) -> ActResult:
        if action in FURNISHINGS:
            action = "west" if action == self.task.west else "east"
        return super()._act(action)

    def _describe(self, observation: dict[str, np.ndarray]) -> str:
        """A dark corridor's observation with the furnishings by the start placed, the same line at every turn, and
        the actions with both furnishings' names."""
        lines = super()._describe(observation).split("\n")
        at = next(i for i, line in enumerate(lines) if line.startswith("Legend: "))
        lines.insert(at, f"{BY_THE_START}{self.task.west} west, {self.task.east} east")
        actions = next(i for i, line in enumerate(lines) if line.startswith("Actions: "))
        lines[actions] = "Actions: " + ", ".join(self.available_actions())
        return "\n".join(lines)

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
