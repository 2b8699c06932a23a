"""Random play: how often an agent that picks a uniformly random available action each turn solves a task family at
a turn limit. The floor a learnt policy must clear for its success to measure skill rather than luck.

    found = random_play("MiniHack-Room-Random-5x5-v0", EnvSettings(), max_turns=20, seeds=task_pool(...))
    found.successes, found.episodes, found.rate, found.interval()      # Wilson 95% interval
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pipeline.envs.base import TextEnv
from pipeline.envs.registry import env_spec, make_env
from pipeline.envs.settings import EnvSettings
from pipeline.errors import ConfigError


@dataclass(frozen=True)
class RandomPlay:
    env_id: str
    max_turns: int
    episodes: int
    successes: int
    mean_turns: float
    """Turns played per episode (a success ends its episode early)."""

    @property
    def rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    def interval(self, z: float = 1.959964) -> tuple[float, float]:
        """Wilson score interval of the success rate (95% by default)."""
        n = self.episodes
        if n == 0:
            return 0.0, 1.0
        p = self.rate
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return max(0.0, centre - half), min(1.0, centre + half)


Policy = Literal["random", "solver", "memoryless", "rule"]


def random_play(env_id: str, settings: EnvSettings, *, max_turns: int, seeds: Sequence[int],
                rng_seed: int = 0, policy: Policy = "random") -> RandomPlay:
    """Play one episode per task seed, each turn a uniformly random available action (drawn from a stream seeded by
    `rng_seed` and the task seed, so the figure is reproducible). Other policies (a random action wherever they
    have none):
    - `solver`: the scripted solver, which knows the layout (`TextEnv.expert_action`): the warm
      start's teacher;
    - `memoryless`: the solver knowing only what the episode has shown (`TextEnv.uninformed_actions`, one drawn);
    - `rule`: the rule-follower of a family with a rule across tasks (signpost corridors' `rule_action`)."""
    if policy == "rule" and not env_spec(env_id).rule:
        raise ConfigError(f"{env_id} has no rule across tasks to follow; the rule-follower plays signpost corridors")
    env = make_env(env_id, settings, max_turns=max_turns)
    successes = turns = 0
    try:
        for seed in seeds:
            rng = random.Random(f"{rng_seed}/{seed}")
            env.reset(seed)
            actions = env.available_actions()
            while True:
                outcome = env.step(_choose(env, policy, rng, actions))
                turns += 1
                actions = outcome.info.available_actions or actions
                if outcome.done:
                    successes += outcome.info.success
                    break
    finally:
        env.close()
    return RandomPlay(env_id, max_turns, len(seeds), successes, turns / len(seeds) if seeds else 0.0)


def _choose(env: TextEnv, policy: Policy, rng: random.Random, actions: tuple[str, ...]) -> str:
    chosen: str | None = None
    if policy == "solver":
        chosen = env.expert_action()
    elif policy == "memoryless":
        guesses = env.uninformed_actions()
        chosen = rng.choice(guesses) if guesses else None
    elif policy == "rule":
        chosen = env.rule_action()  # type: ignore[attr-defined]  # checked in random_play
    return chosen if chosen is not None else rng.choice(actions)


def corpus_texts(env_ids: Sequence[str], episodes: int, seed: int) -> list[str]:
    """Text for a tokenizer: `episodes` episodes of each environment (default settings, train seeds), half played
    by the scripted solver and half at random, each one string of its goal, observations and actions.
    Deterministic."""
    from pipeline.envs.registry import task_pool

    texts: list[str] = []
    for env_id in env_ids:
        env = make_env(env_id, EnvSettings())
        try:
            for index, task_seed in enumerate(task_pool(env_id, "train", episodes, seed)):
                rng = random.Random(f"corpus/{seed}/{env_id}/{task_seed}")
                goal, observation = env.reset(task_seed)
                lines = [f"Goal: {goal}", observation]
                while True:
                    expert = env.expert_action() if index % 2 == 0 else None
                    action = expert if expert is not None else rng.choice(env.available_actions())
                    outcome = env.step(action)
                    lines += [f"Action: {action}", outcome.observation]
                    if outcome.done:
                        break
                texts.append("\n".join(lines))
        finally:
            env.close()
    return texts
