"""The text worlds' engines: environment steps/s per family, what random play and the scripted solver achieve, and
the share of rollout time spent in the engine, with MiniHack Room measured alongside in the same run.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/text_worlds.py            # 2,000 steps and 64 tasks per family
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/text_worlds.py --quick    # 300 steps and 16 tasks per family

For each environment (TextWorldExpress CookingWorld, TextWorld Commonsense and Coin Collector, ScienceWorld, MiniHack
Room), with the default env settings (valid actions listed in the observation) and its registry turn limit:
- `<family>_env_steps_per_s`: `TextEnv.step` calls per second under uniformly random valid actions (a new game of the
  train pool whenever one ends; resets not counted), i.e. the engine plus the adapter's observation text;
- `<family>_reset_s`: mean seconds per `reset` (a new game);
- `<family>_random_success`, `<family>_solver_success`: success on the eval pool's first N tasks of uniformly random
  actions and of the scripted solver the warm start imitates (the engines' gold paths; Coin Collector's depth-first
  search);
- `<family>_engine_share`: the share of a rollout's wall time spent in the environment when the episode player
  plays 32 free episodes of eval tasks in one batch with the tiny preset actor (untrained, tokenizer corpus including
  that family): sum of the episodes' `env_s` over the wall time of playing them. A larger policy spends longer
  generating, so this is an upper bound for the SmolLM2 configs.
Then `benchmark_s`.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pipeline.actor.episodes import EpisodePlayer
from pipeline.actor.settings import RolloutSettings
from pipeline.envs.random_play import Policy, random_play
from pipeline.envs.registry import env_spec, make_env, task_pool
from pipeline.envs.settings import EnvSettings
from pipeline.models.settings import ModelSettings, TinyModelSettings
from pipeline.rl.trainer import initial_policy
from schemas.base import Producer
from schemas.tasks import EpisodeAssigned

ENVS = ("TWX-CookingWorld", "TWX-TWC", "TWX-CoinCollector", "ScienceWorld", "MiniHack-Room-Random-5x5-v0")
WHO = Producer(worker="benchmark", instance="text-worlds")


def steps_per_s(env_id: str, settings: EnvSettings, steps: int) -> tuple[float, float]:
    """(steps/s, seconds per reset) under random valid actions."""
    env = make_env(env_id, settings)
    rng = random.Random(0)
    seeds = task_pool(env_id, "train", 200, 0)
    stepping = resetting = 0.0
    resets = 0
    try:
        started = time.perf_counter()
        env.reset(seeds[0])
        resetting += time.perf_counter() - started
        resets += 1
        for _ in range(steps):
            action = rng.choice(env.available_actions())
            started = time.perf_counter()
            outcome = env.step(action)
            stepping += time.perf_counter() - started
            if outcome.done:
                started = time.perf_counter()
                env.reset(seeds[resets % len(seeds)])
                resetting += time.perf_counter() - started
                resets += 1
    finally:
        env.close()
    return steps / stepping, resetting / resets


def engine_share(env_id: str, settings: EnvSettings, episodes: int) -> float:
    """Sum of the episodes' env time over the wall time of playing them, with the tiny preset actor."""
    spec = env_spec(env_id)
    corpus = () if env_id.startswith("MiniHack") else (env_id,)
    policy = initial_policy(ModelSettings(tiny=TinyModelSettings(corpus_envs=corpus)))
    rollout = RolloutSettings(max_concurrent_episodes=episodes)
    rollout = rollout.model_copy(update={"generation": rollout.generation.model_copy(
        update={"max_new_tokens": 16, "micro_batch": episodes})})
    player = EpisodePlayer(rollout, settings, run_id="benchmark", producer=WHO)
    player.policy, player.version = policy, 0
    assignments = [
        (EpisodeAssigned(run_id="benchmark", producer=WHO, step=0, split="eval", env_id=env_id,
                         task_family=spec.task_family, seed=seed, group_id=f"g{index}", slot=0, group_size=1,
                         guided=False, max_turns=spec.max_turns, policy_version=0), ("benchmark", 0), index)
        for index, seed in enumerate(task_pool(env_id, "eval", episodes, 0))]
    try:
        started = time.perf_counter()
        player.start(assignments)
        finished = player.play_to_end()
        wall = time.perf_counter() - started
    finally:
        player.close()
    return sum(t.timings.env_s for t in finished) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 steps and 16 tasks per family")
    parser.add_argument("--envs", nargs="+", default=list(ENVS), help="env ids to measure")
    args = parser.parse_args()
    steps, tasks = (300, 16) if args.quick else (2000, 64)
    torch.set_num_threads(1)
    started = time.monotonic()
    settings = EnvSettings()
    print(f"steps={steps}")
    print(f"tasks={tasks}")
    for env_id in args.envs:
        spec = env_spec(env_id)
        family = spec.task_family.replace("-", "_")
        rate, reset_s = steps_per_s(env_id, settings, steps)
        print(f"{family}_env_steps_per_s={rate:.0f}")
        print(f"{family}_reset_s={reset_s:.4f}")
        seeds = task_pool(env_id, "eval", tasks, 0)
        policies: tuple[Policy, ...] = ("random", "solver")
        for name in policies:
            found = random_play(env_id, settings, max_turns=spec.max_turns, seeds=seeds, policy=name)
            low, high = found.interval()
            print(f"{family}_{name}_success={found.rate:.3f}  # {found.successes}/{found.episodes} at "
                  f"{spec.max_turns} turns, 95% [{low:.3f}, {high:.3f}]")
        print(f"{family}_engine_share={engine_share(env_id, settings, 32):.3f}", flush=True)
    print(f"benchmark_s={time.monotonic() - started:.0f}")


if __name__ == "__main__":
    main()
