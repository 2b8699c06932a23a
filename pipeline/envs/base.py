"""The one text protocol every environment speaks, and what is shared by all adapters: turn limits, action parsing
and the rule for invalid actions.

    env = make_env("MiniHack-Room-Random-5x5-v0", EnvSettings())
    goal, observation = env.reset(seed=7)
    outcome = env.step("Action: east")      # StepOutcome(observation, reward, done, info)
    outcome.info.valid, outcome.info.available_actions, outcome.info.success
    print(env.render())

Rewards are outcome rewards as in the paper: `success_reward` (1) on the turn that solves the task, `failure_reward`
(0; ALFWorld -1) on the turn that ends an episode unsolved, 0 on every other turn. An episode ends when the task is
solved or lost, when the environment's own step limit ends it (a truncation), or after `max_turns` turns (a
truncation). Each adapter implements `_reset`, `_act`, `render` and its action list; this base class does the rest.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Protocol

from pipeline.errors import ConfigError, InvalidArgumentError, InvalidStateError

InvalidActionRule = Literal["skip", "end"]
"""What happens when a response names no available action: `skip` — the turn is used up, the environment is not
stepped, and the next observation says the action was invalid; `end` — the episode ends as a failure."""


@dataclass(frozen=True)
class StepInfo:
    """What `step` reports besides observation, reward and done."""

    valid: bool
    """Whether the response named an available action (only valid actions reach the environment)."""
    action: str
    """The action taken, in its canonical spelling ('' when invalid)."""
    available_actions: tuple[str, ...]
    """Actions the agent may take next."""
    success: bool
    """True once the task is solved (read from the environment)."""
    truncated: bool
    """True when a step or turn limit ended the episode unsolved."""
    score: float | None = None
    """The environment's own progress score after this step (0-1; ScienceWorld's can fall below 0 on a failure),
    where it keeps one (the text worlds); None elsewhere. The reward stays the outcome reward."""


@dataclass(frozen=True)
class StepOutcome:
    observation: str
    reward: float
    done: bool
    info: StepInfo


@dataclass(frozen=True)
class ActResult:
    """What an adapter's `_act` reports for one valid action."""

    observation: str
    solved: bool
    lost: bool = False
    """The episode ended unsolved by the environment's own rule (death, its own step limit)."""
    env_truncated: bool = False
    """The environment's own step limit ended it (recorded as a truncation)."""
    rejected: bool = False
    """The engine did not understand an unlisted action (`TextEnv.accepts_unlisted`): the turn counts as invalid."""
    score: float | None = None
    """The environment's own progress score after the action, where it keeps one."""


class TaskRule(Protocol):
    """A rule that holds across a family's tasks, and the lessons that can be written about it (signpost corridors:
    `pipeline.envs.signpost_corridor.SIGNPOST_RULE`)."""

    kinds: tuple[str, ...]
    """The kinds of lesson: 'rule' (the rule itself), 'instance' (one task's fact), 'over-general' (a wrong rule)."""
    sides: tuple[str, ...]
    """Where a task's goal can lie; each is also the action that heads that way."""
    distances: tuple[int, ...]
    """How far from the start it can lie."""

    def statement(self, revealed: tuple[str, ...], kind: str) -> str | None:
        """What a lesson of `kind` states from what an episode revealed; None when it revealed nothing."""

    def revealed_for(self, first_observation: str, side: str, distance: int) -> tuple[str, ...]:
        """What an episode that started with `first_observation` would reveal had its goal lain `distance` to
        `side` (a lesson of any kind can then be written pointing either way)."""

    def turned_around(self, revealed: tuple[str, ...], first_observation: str) -> tuple[str, ...]:
        """What the episode would have revealed had its goal lain the other way (a wrong lesson, for the gate)."""

    def kind_of(self, text: str, task_rule: str | None) -> str | None:
        """The kind of lesson `text` is where the rule names `task_rule` ('wrong rule' naming another), or None."""

    def rule_in(self, revealed: tuple[str, ...]) -> str | None:
        """What the rule names in what an episode revealed (signpost corridors: the furnishing on the stairs'
        side), or None when it revealed nothing of it."""

    def action_for(self, revealed: tuple[str, ...], kind: str) -> str:
        """The action a lesson of `kind` written from `revealed` says to take at the start: a side for one task's
        fact or an over-general one; for the rule, the action that names what the rule names (signpost corridors:
        the furnishing, which walks its way), so following the rule is reading the lesson, not looking it up."""


INVALID_NOTE_ACTIONS = 40
"""An invalid action's note lists the valid actions up to this many (ScienceWorld offers over a hundred)."""

_WORD = re.compile(r"[a-z]+")
_OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east", "northeast": "southwest",
             "southwest": "northeast", "northwest": "southeast", "southeast": "northwest"}
_DIRECTION = re.compile(r"\b(" + "|".join(sorted(_OPPOSITE, key=len, reverse=True)) + r")\b")


def reversed_directions(fact: str) -> str:
    """A revealed fact with every compass direction turned around ("staircase down: 5 west of the start" ->
    "... 5 east of the start"): a fact that is wrong wherever the original is right, for checking that an actor
    follows what a lesson says (`pipeline.rl.warm_gate`). A fact with no direction comes back unchanged."""
    return _DIRECTION.sub(lambda match: _OPPOSITE[match.group(1)], fact)


def parse_action(response: str, actions: tuple[str, ...], *, words: bool = True) -> str | None:
    """The available action named in the first non-empty line of `response` (case-insensitive; an optional leading
    'Action:' is ignored), or None: the line itself, else the longest action the line starts with (whole words),
    else (with `words`) the first single-word action among its words. Multi-word actions must appear as written.
    Text worlds turn `words` off: 'move the egg in inventory to the box' names no listed action, not 'inventory'."""
    line = next((part.strip() for part in response.splitlines() if part.strip()), "")
    line = re.sub(r"^\s*action\s*:\s*", "", line, flags=re.IGNORECASE).strip().lower()
    if not line:
        return None
    by_lower = {action.lower(): action for action in actions}
    if line in by_lower:
        return by_lower[line]
    # Text actions (text-world commands, WebShop clicks): the longest one the line starts with.
    for candidate in sorted(by_lower, key=len, reverse=True):
        rest = line[len(candidate):]
        if line.startswith(candidate) and (candidate.endswith("[") or not rest or not rest[0].isalnum()):
            return by_lower[candidate]
    if not words:
        return None
    single = {a for a in by_lower if " " not in a and "[" not in a}
    for word in _WORD.findall(line):
        if word in single:
            return by_lower[word]
    return None


class TextEnv(ABC):
    """One environment behind the text protocol. Not thread-safe: one episode at a time per instance."""

    env_id: str
    task_family: str
    single_word_actions: bool = True
    """Whether a single-word action found anywhere in the response's line counts (`parse_action`'s `words`): yes for
    direction words (MiniHack, Sokoban); no for text worlds, whose commands contain such words."""
    accepts_unlisted: bool = False
    """True where the engine parses free text itself (ScienceWorld): a response naming no listed action is sent to
    the engine as written, and counts as invalid only if the engine does not understand it."""

    def __init__(self, *, max_turns: int, invalid_action: InvalidActionRule = "skip",
                 success_reward: float = 1.0, failure_reward: float = 0.0) -> None:
        if max_turns <= 0:
            raise ConfigError(f"max_turns must be positive, got {max_turns}")
        if invalid_action not in ("skip", "end"):
            raise ConfigError(f"unknown invalid-action rule {invalid_action!r}; valid values: skip, end")
        self.max_turns = max_turns
        self.invalid_action = invalid_action
        self.success_reward = success_reward
        self.failure_reward = failure_reward
        self.turns = 0
        self.done = True
        self.goal = ""
        self.observation = ""

    # -- what an adapter implements ---------------------------------------------------------------------------------

    @abstractmethod
    def _reset(self, seed: int) -> tuple[str, str]:
        """Start the task of `seed` (same seed, same task); return (goal, first observation)."""

    @abstractmethod
    def _act(self, action: str) -> ActResult:
        """Apply one available action."""

    @abstractmethod
    def available_actions(self) -> tuple[str, ...]:
        """Actions the agent may take now, in their canonical spelling."""

    @abstractmethod
    def render(self) -> str:
        """The current state for a person to read."""

    def close(self) -> None:
        """Release the underlying environment."""

    def expert_action(self) -> str | None:
        """What a scripted solver would do now, or None where this environment has none (the actor's behaviour
        cloning warm start plays with it)."""
        return None

    def uninformed_actions(self) -> tuple[str, ...]:
        """What a scripted solver would do now knowing only what this episode has shown, not the task's hidden
        layout: any one of these actions (several: equally good guesses). A task whose observation shows what the
        solver needs has the solver's own action; () where there is no solver. The warm start labels the turns of
        prompts that carry no informative experience with these, so the actor guesses where memory is missing and
        follows an experience where it states the answer."""
        action = self.expert_action()
        return (action,) if action is not None else ()

    def revealed(self) -> tuple[str, ...]:
        """Facts the episode so far has uncovered that its first observation did not state plainly, in words the
        extractor can turn into a lesson (for example where the goal lies relative to the start). Recorded in the
        trajectory when the episode ends; () where the environment states none."""
        return ()

    # -- the protocol -----------------------------------------------------------------------------------------------

    def reset(self, seed: int) -> tuple[str, str]:
        if seed < 0:
            raise InvalidArgumentError(f"seeds are non-negative, got {seed}")
        self.goal, self.observation = self._reset(seed)
        self.turns = 0
        self.done = False
        return self.goal, self.observation

    def step(self, action_text: str) -> StepOutcome:
        if self.done:
            raise InvalidStateError(f"{self.env_id}: step() after the episode ended; call reset() first")
        self.turns += 1
        out_of_turns = self.turns >= self.max_turns
        action = parse_action(action_text, self.available_actions(), words=self.single_word_actions)
        result: ActResult | None = None
        if action is None and self.accepts_unlisted:
            unlisted = re.sub(r"^\s*action\s*:\s*", "", action_text.strip().split("\n", 1)[0],
                              flags=re.IGNORECASE).strip()
            if unlisted:
                result = self._act(unlisted)
                action = None if result.rejected else unlisted
        if action is None:
            lost = self.invalid_action == "end"
            self.done = lost or out_of_turns
            shown = action_text.strip().splitlines()[0][:60] if action_text.strip() else ""
            self.observation = f"Invalid action {shown!r}. {self._valid_note()}\n" + \
                self._strip_invalid_note(self.observation)
            return StepOutcome(self.observation, self.failure_reward if self.done else 0.0, self.done,
                               StepInfo(False, "", self.available_actions(), False, self.done and not lost,
                                        result.score if result is not None else None))
        result = result or self._act(action)
        self.observation = result.observation
        solved = result.solved
        self.done = solved or result.lost or out_of_turns
        reward = self.success_reward if solved else self.failure_reward if self.done else 0.0
        truncated = self.done and not solved and (result.env_truncated or (out_of_turns and not result.lost))
        return StepOutcome(self.observation, reward, self.done,
                           StepInfo(True, action, self.available_actions(), solved, truncated, result.score))

    def _valid_note(self) -> str:
        actions = self.available_actions()
        if len(actions) > INVALID_NOTE_ACTIONS:
            return f"{len(actions)} actions are valid here."
        return f"Valid actions: {', '.join(actions)}."

    @staticmethod
    def _strip_invalid_note(observation: str) -> str:
        return observation.split("\n", 1)[1] if observation.startswith("Invalid action ") else observation
