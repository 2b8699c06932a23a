"""MiniHack (NetHack Learning Environment) behind the text protocol.

    env = MiniHackEnv("MiniHack-Room-Random-5x5-v0", max_turns=30)
    goal, observation = env.reset(seed=3)
    print(observation)

An observation is compact text for a small model: the map cropped to its non-blank box, the game message, where the
things that matter lie relative to the agent ("staircase down: 2 south, 3 east"), a legend of the symbols on the
map, and the available actions. Facts this adapter relies on (measured with NLE 1.3.0 and MiniHack 1.0.2):

- `env.reset(seed=...)` does not seed NetHack: the adapter calls `unwrapped.seed(core, disp, reseed=False)` with two
  seeds derived from the task seed, then `reset()`; the same seed then gives the same map and, for the same actions,
  the same episode.
- success is `info["end_status"] == 2`; the environment's own step limit ends an episode with `end_status == -1`,
  recorded as a truncation; death (1) ends it as a loss.
- KeyRoom's APPLY opens an adjacent locked door with the key from the inventory (MiniHack does the menu steps).
"""

from __future__ import annotations

import random

import numpy as np

from pipeline.envs.base import ActResult, InvalidActionRule, TextEnv
from pipeline.errors import EnvUnavailableError

NLE_TASK_SUCCESSFUL = 2
NLE_STEP_LIMIT = -1
NLE_DIED = 1

ACTION_WORDS = {
    "N": "north", "E": "east", "S": "south", "W": "west",
    "NE": "northeast", "SE": "southeast", "SW": "southwest", "NW": "northwest",
    "PICKUP": "pickup", "APPLY": "apply",
}
"""NLE action enum names -> the words the agent writes."""

_SHORT_NAMES = {
    "human rogue called Agent": "you",
    "floor of a room": "floor",
    "staircase down": "staircase down",
    "dark part of a room": "dark floor",
    "doorway": "doorway",
    "open door": "open door",
    "closed door": "locked door",
    "water": "water",
    "a boulder": "boulder",
    "boulder": "boulder",
    "corridor": "corridor",
    "wall": "wall",
    "neutral altar": "altar",
}
_CLOCK_MESSAGES = ("Hello Agent, welcome to NetHack", "You are lucky!  Full moon tonight.",
                   "Be careful!  New moon tonight.")
"""Messages NetHack prints at the start from the date and time, not the task: never shown, so the same seed gives the
same observation on any day."""
_LANDMARKS = ("staircase down", "key", "locked door", "open door", "doorway", "boulder")
"""Things whose position relative to the agent the observation spells out (nearest first, at most 3 each)."""

GOALS = {
    "room": "reach the staircase down (>)",
    "maze": "find the way through the maze to the staircase down (>)",
    "keyroom": "pick up the key ((), open the locked door with it (apply next to the door), then reach the "
               "staircase down (>)",
    "river": "cross the river (}) by pushing boulders (`) into the water, then reach the staircase down (>)",
}


def _short(description: str) -> str:
    if description.startswith("a key") or description.endswith(" key"):
        return "key"
    return _SHORT_NAMES.get(description, description)


def nle_seeds(seed: int) -> tuple[int, int]:
    """The (core, disp) NetHack seeds of a task seed: fixed, distinct, 31-bit."""
    rng = random.Random(seed * 7919 + 17)
    return rng.randrange(1, 2**31), rng.randrange(1, 2**31)


class MiniHackEnv(TextEnv):
    """One MiniHack task family (`kind`: room | maze | keyroom | river) behind the text protocol."""

    def __init__(self, env_id: str, *, task_family: str, kind: str, max_turns: int = 30,
                 invalid_action: InvalidActionRule = "skip") -> None:
        super().__init__(max_turns=max_turns, invalid_action=invalid_action)
        try:
            import gymnasium as gym
            import minihack  # noqa: F401  (registers the MiniHack-* ids)
        except ImportError as exc:
            raise EnvUnavailableError(
                f"{env_id} needs minihack and nle: pip install 'nle==1.3.0' 'minihack==1.0.2' 'setuptools<81' "
                f"({exc})") from exc
        self.env_id = env_id
        self.task_family = task_family
        self.kind = kind
        self._env = gym.make(env_id, observation_keys=(
            "chars", "message", "screen_descriptions", "blstats", "inv_strs", "inv_letters", "glyphs"))
        # NLE's own env class (`actions`, a three-argument `seed`) hides behind gymnasium's generic `Env`.
        self._actions = tuple(
            ACTION_WORDS[action.name] for action in self._env.unwrapped.actions)  # type: ignore[attr-defined]
        self._index = {word: i for i, word in enumerate(self._actions)}
        self._last: dict[str, np.ndarray] = {}
        self._start: tuple[int, int] = (0, 0)
        """(x, y) of the agent when the episode began."""
        self._seen: dict[str, tuple[int, int]] = {}
        """Landmark name -> (x, y) where the agent first saw it this episode."""

    def available_actions(self) -> tuple[str, ...]:
        return self._actions

    def _reset(self, seed: int) -> tuple[str, str]:
        core, disp = nle_seeds(seed)
        self._env.unwrapped.seed(core, disp, reseed=False)  # type: ignore[attr-defined]  # NLE's, as above
        self._last, _ = self._env.reset()
        self._start = (int(self._last["blstats"][0]), int(self._last["blstats"][1]))
        self._seen = {}
        self._note_landmarks()
        return GOALS[self.kind], self._describe(self._last)

    def _act(self, action: str) -> ActResult:
        self._last, _reward, terminated, truncated, info = self._env.step(self._index[action])
        self._note_landmarks()
        end_status = int(info.get("end_status", 0))
        solved = bool(terminated) and end_status == NLE_TASK_SUCCESSFUL
        ended = bool(terminated or truncated)
        env_truncated = ended and not solved and (bool(truncated) or end_status == NLE_STEP_LIMIT)
        return ActResult(self._describe(self._last), solved=solved, lost=ended and not solved,
                         env_truncated=env_truncated)

    def render(self) -> str:
        return self._crop(self._last)[0] if self._last else ""

    def expert_action(self) -> str | None:
        """Room tasks only: step straight toward the staircase (diagonals first). Empty rooms need nothing more;
        mazes, keys and rivers have no scripted solver here."""
        if self.kind != "room" or not self._last:
            return None
        stairs = np.argwhere(self._last["chars"] == ord(">"))
        if stairs.size == 0:
            return None
        x, y = int(self._last["blstats"][0]), int(self._last["blstats"][1])
        dy, dx = int(stairs[0][0]) - y, int(stairs[0][1]) - x
        vertical = "south" if dy > 0 else "north" if dy < 0 else ""
        horizontal = "east" if dx > 0 else "west" if dx < 0 else ""
        return (vertical + horizontal) or None

    def revealed(self) -> tuple[str, ...]:
        """Where each landmark the agent saw lies relative to where it started ("staircase down: 2 south, 3 east
        of the start"): in a dark room, what only exploring shows."""
        start_x, start_y = self._start
        return tuple(f"{name}: {_relative(y - start_y, x - start_x)} of the start"
                     for name, (x, y) in sorted(self._seen.items(), key=lambda item: _LANDMARKS.index(item[0])))

    def _note_landmarks(self) -> None:
        """Remember where each landmark was first seen (its nearest instance to the start, for several)."""
        chars, descriptions = self._last["chars"], self._last["screen_descriptions"]
        start_x, start_y = self._start
        for symbol in (">", "(", "+"):
            for y, x in np.argwhere(chars == ord(symbol)):
                name = _short(bytes(descriptions[y, x]).rstrip(b"\0").decode("latin-1"))
                if name not in _LANDMARKS:
                    continue
                known = self._seen.get(name)
                distance = abs(int(x) - start_x) + abs(int(y) - start_y)
                if known is None or distance < abs(known[0] - start_x) + abs(known[1] - start_y):
                    self._seen[name] = (int(x), int(y))

    def close(self) -> None:
        self._env.close()

    # -- text -------------------------------------------------------------------------------------------------------

    @staticmethod
    def _crop(observation: dict[str, np.ndarray]) -> tuple[str, int, int, np.ndarray]:
        chars = observation["chars"]
        rows, cols = np.nonzero(chars != ord(" "))
        if rows.size == 0:
            return "", 0, 0, chars[:0, :0]
        top, left = int(rows.min()), int(cols.min())
        box = chars[top : rows.max() + 1, left : cols.max() + 1]
        text = "\n".join(bytes(row).decode("latin-1").rstrip() for row in box)
        return text, top, left, box

    def _describe(self, observation: dict[str, np.ndarray]) -> str:
        text, top, left, box = self._crop(observation)
        descriptions = observation["screen_descriptions"]
        agent_x, agent_y = int(observation["blstats"][0]), int(observation["blstats"][1])
        legend: dict[str, str] = {}
        landmarks: dict[str, list[tuple[int, int]]] = {}
        for r in range(box.shape[0]):
            for c in range(box.shape[1]):
                symbol = chr(box[r, c])
                if symbol == " ":
                    continue
                name = _short(bytes(descriptions[top + r, left + c]).rstrip(b"\0").decode("latin-1"))
                if not name:
                    continue
                legend.setdefault(symbol, name)
                if name in _LANDMARKS:
                    landmarks.setdefault(name, []).append((top + r - agent_y, left + c - agent_x))
        lines = ["Map:", text]
        message = bytes(observation["message"]).rstrip(b"\0").decode("latin-1").strip()
        if message and not message.startswith(_CLOCK_MESSAGES):
            lines.append(f"Message: {message}")
        where = []
        for name in _LANDMARKS:
            for dy, dx in sorted(landmarks.get(name, []), key=lambda d: (abs(d[0]) + abs(d[1]), d))[:3]:
                where.append(f"{name} {_relative(dy, dx)}")
        if where:
            lines.append("Where: " + "; ".join(where))
        if self.kind == "keyroom":
            has_key = any(bytes(s).rstrip(b"\0").decode("latin-1").find("key") >= 0 for s in observation["inv_strs"])
            lines.append("Inventory: " + ("key" if has_key else "nothing"))
        lines.append("Legend: " + ", ".join(f"{symbol} {name}" for symbol, name in legend.items()))
        lines.append("Actions: " + ", ".join(self._actions))
        return "\n".join(lines)


def _relative(dy: int, dx: int) -> str:
    parts = []
    if dy:
        parts.append(f"{abs(dy)} {'south' if dy > 0 else 'north'}")
    if dx:
        parts.append(f"{abs(dx)} {'east' if dx > 0 else 'west'}")
    return ", ".join(parts) if parts else "here"
