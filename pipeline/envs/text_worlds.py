"""TextWorldExpress (CookingWorld, TextWorld Commonsense, Coin Collector) and ScienceWorld behind the text protocol.

    env = TextWorldExpressEnv("twc", settings.text_worlds, max_turns=12)
    goal, observation = env.reset(seed=7)         # odd seeds: the engine's train fold; even: its unseen fold
    outcome = env.step("take dirty teal dress")
    env.expert_action()                           # the next action of the engine's own gold path, while on it

Both engines are Java programs inside their wheels (`pipeline.envs.jvm`: one JVM per engine per worker process). Facts
this module relies on (measured with textworld-express 1.1.0 and scienceworld 1.2.3 on OpenJDK 17):

- TextWorldExpress games are fixed by (game, parameters, seed); each game has a train, dev and test fold of 1,000
  seeds each (0-999, 10000-10999, 20000-20999). A task seed maps to a fold by its parity (the registry's pools give
  train tasks odd seeds and unseen tasks even ones) and to a game of that fold by `seed // 2 % 1000`: the same seed is
  the same game whether it is played for training or evaluation, and unseen tasks never share a game with training.
- ScienceWorld's variations are split by the engine into train, dev and test lists per task type; a seed maps the same
  way, into its fold's list (`TextWorldSettings.scienceworld_variation` pins one).
- Success is the engine's `tasksuccess` (TextWorldExpress) or a score of 1 (ScienceWorld's `getCompleted` with the
  full score); `taskfailure` or a negative ScienceWorld score ends the episode as lost. Each step's engine score
  (0-1) is reported in `StepInfo.score`; the reward stays the outcome reward.
- The gold paths (`generateGoldPath`) solve every game from its start; they begin with `look around`, which the reset
  has already done. `expert_action` follows them while the episode stays on them: an action that is not the next
  gold action leaves the path unless it only looks (`look`, `examine`, `inventory`, `read`) — off the path the
  solver has no action (None). Coin Collector's gold path is a random walk that differs from call to call, so its
  solver is our own (`CoinExplorer`): the reset searches the game once and restarts it, so the expert knows the way
  to the coin, while `uninformed_actions` are the search's guesses from what the episode has seen; a fixed map per
  seed makes Coin Collector a family where memory helps (a lesson can say where the coin is).
- A response naming no listed action is invalid in TextWorldExpress (its parser knows only those); ScienceWorld
  parses free text itself, so such a response goes to the engine and is invalid only if the engine says "No known
  action matches that input."
"""

from __future__ import annotations

import json
import re
from typing import Any

from pipeline.envs.base import ActResult, InvalidActionRule, TextEnv
from pipeline.envs.jvm import JvmEngine, jvm_engine
from pipeline.envs.settings import TextWorldSettings
from pipeline.errors import ConfigError, EngineCrashedError

TWX_GAMES = {
    "cookingworld": ("TWX-CookingWorld", "twx-cookingworld"),
    "twc": ("TWX-TWC", "twx-twc"),
    "coin": ("TWX-CoinCollector", "twx-coin"),
}
"""TextWorldExpress game name -> (env id, task family)."""
TWX_FOLD_BASE = {"train": 0, "dev": 10000, "test": 20000}
TWX_FOLD_SIZE = 1000
_LOOKING = ("look", "examine", "inventory", "read")
"""TextWorldExpress commands that change nothing: the gold path survives them."""
SCIENCEWORLD_REJECTED = "No known action matches that input."


def task_fold(seed: int, eval_fold: str) -> str:
    """The engine fold of a task seed: odd seeds (the registry's train pools) play the train fold, even seeds
    (unseen tasks) `eval_fold`."""
    return "train" if seed % 2 else eval_fold


def twx_task(seed: int) -> tuple[str, int]:
    """(train or unseen, index of the game in its fold) of a task seed: the registry's task key, so a pool never
    holds two seeds of one game."""
    return ("train" if seed % 2 else "unseen"), seed // 2 % TWX_FOLD_SIZE


_EXIT = re.compile(r"To the (North|South|East|West) you see the ([^.]+)\.")
_ROOM = re.compile(r"You are in the ([^.]+)\.")
_BACK = {"north": "south", "south": "north", "east": "west", "west": "east"}


class CoinExplorer:
    """What an agent can know of a Coin Collector map from what it has seen: the rooms visited, the exits of the room
    it is in, and the way back (a depth-first search's trail). `guesses` are the moves of a solver that knows only
    that: take the coin once it is in sight, else go to a neighbour not visited yet (any of them: equally good
    guesses, listed north, east, south, west), else go back the way it came. Deterministic for a game, unlike the
    engine's gold path (a random walk that differs between calls). Assumes `includeDoors=0` (rooms open into each
    other, as in the default parameters)."""

    ORDER = ("north", "east", "south", "west")

    def __init__(self) -> None:
        self.visited: list[str] = []
        self.trail: list[tuple[str, str]] = []
        """(room, the direction that leads back to it) of every room the search went forward from."""
        self.room = ""
        self.exits: dict[str, str] = {}

    def see(self, look: str) -> None:
        room = _ROOM.search(look)
        self.room = room.group(1) if room else self.room
        if self.room not in self.visited:
            self.visited.append(self.room)
        self.exits = {direction.lower(): name for direction, name in _EXIT.findall(look)}

    def moved(self, action: str) -> None:
        """Record a move the episode made (whoever chose it), before `see` of the room it led to."""
        direction = action.removeprefix("move ")
        if direction not in _BACK:
            return
        if self.trail and self.trail[-1][1] == direction and self.exits.get(direction) == self.trail[-1][0]:
            self.trail.pop()  # went back
        else:
            self.trail.append((self.room, _BACK[direction]))

    def guesses(self, valid: tuple[str, ...]) -> tuple[str, ...]:
        if "take coin" in valid:
            return ("take coin",)
        unvisited = tuple(f"move {d}" for d in self.ORDER
                          if self.exits.get(d) not in (None, *self.visited) and f"move {d}" in valid)
        if unvisited:
            return unvisited
        if self.trail and f"move {self.trail[-1][1]}" in valid:
            return (f"move {self.trail[-1][1]}",)
        return ()

    def route(self) -> list[str]:
        """The moves from the start to the room the agent is in, without the detours (back along the trail)."""
        return [f"move {_BACK[back]}" for _, back in self.trail]


class _EngineEnv(TextEnv):
    """An environment whose game state lives in a JVM engine: the interface object is opened lazily and replaced
    after a crash."""

    engine_name: str
    single_word_actions = False

    def __init__(self, *, max_turns: int, invalid_action: InvalidActionRule) -> None:
        super().__init__(max_turns=max_turns, invalid_action=invalid_action)
        self.engine: JvmEngine = jvm_engine(self.engine_name)
        self._game: Any = None
        self._gold: list[str] = []
        self._gold_at: int | None = None
        self._taken: list[str] = []
        self._last = ""

    def _interface(self) -> Any:
        if self._game is None:
            self._game = self.engine.open()
        return self._game

    def _call(self, name: str, *args: Any) -> Any:
        game = self._interface()
        try:
            return self.engine.call(game, name, *args)
        except EngineCrashedError:
            self._drop()
            raise

    def _drop(self) -> None:
        """Forget the interface object (after a crash or at close); the next reset opens a fresh one."""
        if self._game is not None:
            self._game = None
            self.engine.release()

    def _start_gold(self, gold: list[str]) -> None:
        self._gold = gold[1:] if gold and gold[0] == "look around" else gold
        self._gold_at = 0
        self._taken = []

    def _follow_gold(self, action: str) -> None:
        self._taken.append(action)
        if self._gold_at is None:
            return
        if self._gold_at < len(self._gold) and action == self._gold[self._gold_at]:
            self._gold_at += 1
        elif not action.startswith(_LOOKING):
            self._gold_at = None

    def expert_action(self) -> str | None:
        if self.done or self._gold_at is None or self._gold_at >= len(self._gold):
            return None
        return self._gold[self._gold_at]

    def gold_path(self) -> tuple[str, ...]:
        """The engine's gold actions for this episode's game, from its start (the reset's `look around` left out);
        () for Coin Collector, whose solver is the search."""
        return tuple(self._gold)

    def revealed(self) -> tuple[str, ...]:
        if not self.done:
            return ()
        acted = [a for a in self._taken if not a.startswith(_LOOKING)]
        if not acted:
            return ()
        text = ", ".join(acted)
        return (f"the actions taken were: {text[:300]}",)

    def render(self) -> str:
        return self._last

    def close(self) -> None:
        self._drop()


class TextWorldExpressEnv(_EngineEnv):
    """One TextWorldExpress game family (`cookingworld`, `twc`, `coin`) with its parameters from the settings."""

    engine_name = "textworld-express"

    def __init__(self, game: str, settings: TextWorldSettings, *, max_turns: int,
                 invalid_action: InvalidActionRule = "skip") -> None:
        if game not in TWX_GAMES:
            raise ConfigError(f"unknown TextWorldExpress game {game!r}; valid values: {sorted(TWX_GAMES)}")
        self.env_id, self.task_family = TWX_GAMES[game]
        super().__init__(max_turns=max_turns, invalid_action=invalid_action)
        self.game = game
        self.params: str = getattr(settings, game)
        self.settings = settings
        self._loaded = False
        self._valid: tuple[str, ...] = ()
        self._explorer: CoinExplorer | None = None
        self._route: tuple[str, ...] = ()
        self._route_at: int | None = None

    def available_actions(self) -> tuple[str, ...]:
        return self._valid

    def expert_action(self) -> str | None:
        """The gold path's next action; in Coin Collector, the way to the coin (found by a search of the same game
        before the episode), or the uninformed search once the episode has left it."""
        if self._explorer is None:
            return super().expert_action()
        if self.done:
            return None
        if self._route_at is not None and self._route_at < len(self._route):
            return self._route[self._route_at]
        guesses = self._explorer.guesses(self._valid)
        return guesses[0] if guesses else None

    def uninformed_actions(self) -> tuple[str, ...]:
        if self._explorer is None:
            return super().uninformed_actions()
        return () if self.done else self._explorer.guesses(self._valid)

    def revealed(self) -> tuple[str, ...]:
        if self._explorer is None or not self.done:
            return super().revealed()
        if self._taken and self._taken[-1] == "take coin":
            return (f"the coin is reached from the start by: {', '.join(self._explorer.route()) or 'no move'}",)
        return (f"no coin in: {', '.join(self._explorer.visited)}",)

    def _reset(self, seed: int) -> tuple[str, str]:
        if not self._loaded or self._game is None:
            message = self._call("load", self.game, self.params)
            if message:
                raise ConfigError(f"{self.env_id}: the engine refused the game parameters {self.params!r}: {message}")
            self._loaded = True
        fold = task_fold(seed, self.settings.eval_fold)
        engine_seed = TWX_FOLD_BASE[fold] + twx_task(seed)[1]
        coin = self.game == "coin"  # its gold path is a random walk: not generated, the search below replaces it
        info = self._new_game(engine_seed, fold, gold=not coin)
        self._start_gold([] if coin else list(self._call("getGoldActionSequence")))
        goal = str(self._call("getTaskDescription")).strip()
        self._explorer = None
        if coin:
            self._route, self._route_at = self._search(info), 0
            info = self._new_game(engine_seed, fold, gold=False)  # the same game again, from its start
            self._explorer = CoinExplorer()
        return goal, self._observe(info, first=True)

    def _new_game(self, engine_seed: int, fold: str, *, gold: bool) -> dict[str, Any]:
        info: dict[str, Any] = json.loads(self._call("generateNewGameJSON", engine_seed, fold, gold))
        if str(info["observation"]).startswith("ERROR:"):
            self._loaded = False
            raise ConfigError(f"{self.env_id}: the engine made no game of the parameters {self.params!r}: "
                              f"{info['observation']}")
        return info

    def _search(self, info: dict[str, Any]) -> tuple[str, ...]:
        """Coin Collector: search the game as the uninformed solver would (its first guess each turn) and return the
        way to the coin without detours, ending with `take coin` (() if the search fails)."""
        explorer = CoinExplorer()
        explorer.see(str(info["look"]))
        valid = tuple(info["validActions"])
        for _ in range(4 * self.settings.step_limit):
            guesses = explorer.guesses(valid)
            if not guesses:
                return ()
            step = json.loads(self._call("stepJSON", guesses[0]))
            if guesses[0] == "take coin":
                return (*explorer.route(), "take coin") if step["tasksuccess"] else ()
            explorer.moved(guesses[0])
            explorer.see(str(step["look"]))
            valid = tuple(step["validActions"])
        return ()

    def _drop(self) -> None:
        self._loaded = False
        super()._drop()

    def _act(self, action: str) -> ActResult:
        info = json.loads(self._call("stepJSON", action))
        self._follow_gold(action)
        if self._explorer is not None:
            self._explorer.moved(action)
            at = self._route_at
            if at is not None and at < len(self._route) and self._route[at] == action:
                self._route_at = at + 1
            elif not action.startswith(_LOOKING):
                self._route_at = None
        solved = bool(info["tasksuccess"])
        lost = bool(info["taskfailure"]) and not solved
        env_truncated = not solved and not lost and len(self._taken) > self.settings.step_limit
        observation = self._observe(info, first=False)
        return ActResult(observation, solved=solved, lost=lost or env_truncated, env_truncated=env_truncated,
                         score=float(info["score"]))

    def _observe(self, info: dict[str, Any], *, first: bool) -> str:
        self._valid = tuple(sorted(info["validActions"]))
        feedback, look = str(info["observation"]).strip(), str(info["look"]).strip()
        if self._explorer is not None:
            self._explorer.see(look)
        lines = [] if first or feedback == look else [feedback]
        lines.append(look)
        lines.append(str(info["inventory"]).strip())
        if self.settings.show_valid_actions:
            lines.append("Valid actions: " + ", ".join(self._valid))
        self._last = "\n".join(line for line in lines if line)
        return self._last


class ScienceWorldEnv(_EngineEnv):
    """One ScienceWorld task type (`TextWorldSettings.scienceworld_task`), a variation per seed from its split."""

    env_id = "ScienceWorld"
    task_family = "scienceworld"
    engine_name = "scienceworld"
    accepts_unlisted = True

    def __init__(self, settings: TextWorldSettings, *, max_turns: int,
                 invalid_action: InvalidActionRule = "skip") -> None:
        super().__init__(max_turns=max_turns, invalid_action=invalid_action)
        self.settings = settings
        self.task = settings.scienceworld_task
        self._variations: dict[str, list[int]] = {}
        self._valid: tuple[str, ...] = ()
        self._task_checked = False
        self.variation = -1

    def available_actions(self) -> tuple[str, ...]:
        return self._valid

    def variations(self, fold: str) -> list[int]:
        """The engine's variation indices of this task for `fold` (train, dev or test)."""
        if fold not in self._variations:
            if not self._variations:
                self._check_task()
                # the variation lists are those of the loaded task
                self._call("load", self.task, 0, self.settings.scienceworld_simplifications, False)
            method = {"train": "getVariationsTrain", "dev": "getVariationsDev", "test": "getVariationsTest"}[fold]
            self._variations[fold] = sorted(int(v) for v in self._call(method))
        return self._variations[fold]

    def _check_task(self) -> None:
        if not self._task_checked:
            names = list(self._call("getTaskNames"))
            if self.task not in names:
                raise ConfigError(f"unknown ScienceWorld task {self.task!r}; valid values: {sorted(names)}")
            self._task_checked = True

    def _reset(self, seed: int) -> tuple[str, str]:
        fold = task_fold(seed, self.settings.eval_fold)
        if self.settings.scienceworld_variation is not None:
            self._check_task()
            self.variation = self.settings.scienceworld_variation
        else:
            variations = self.variations(fold)
            self.variation = variations[seed // 2 % len(variations)]
        self._call("load", self.task, self.variation, self.settings.scienceworld_simplifications, True)
        self._call("reset")
        self._start_gold(list(self._call("getGoldActionSequence")))
        first = str(self._call("step", "look around"))
        goal = str(self._call("getTaskDescription")).strip()
        return goal, self._observe(first)

    def _drop(self) -> None:
        self._variations = {}
        super()._drop()

    def _act(self, action: str) -> ActResult:
        feedback = str(self._call("step", action))
        if feedback.strip().startswith(SCIENCEWORLD_REJECTED):
            return ActResult(self._last, solved=False, rejected=True, score=float(self._call("getScore")))
        self._follow_gold(action)
        score = float(self._call("getScore"))
        completed = bool(self._call("getCompleted"))
        solved = completed and score >= 1.0
        lost = not solved and (completed or score < 0)
        moves = int(self._call("getNumMoves"))
        env_truncated = not solved and not lost and moves > self.settings.step_limit
        return ActResult(self._observe(feedback), solved=solved, lost=lost or env_truncated,
                         env_truncated=env_truncated, score=score)

    def _observe(self, feedback: str) -> str:
        self._valid = tuple(sorted(str(a) for a in self._call("getValidActionObjectCombinations")))
        lines = [feedback.strip()]
        inventory = str(self._call("freeActionInventory")).strip()
        if inventory:
            lines.append(inventory)
        if self.settings.show_valid_actions:
            lines.append("Valid actions: " + ", ".join(self._valid))
        self._last = "\n".join(lines)
        return self._last
