"""What the warm starts leave before any RL: the actor's success on a config's eval pool, by the experience in its
prompt, and the extractor's answers on held-out episodes.

    python benchmarks/warm_starts.py                                   # configs/tiny-dark-corridor.yaml
    python benchmarks/warm_starts.py --config configs/tiny-minihack-room.yaml
    python benchmarks/warm_starts.py --extractor-steps 400 800 1200    # the extractor's warm start at other lengths
    python benchmarks/warm_starts.py --quick                           # 20 tasks, 32 held-out episodes

Each warm start is the one `crl run CONFIG` computes (the config's settings, its trainers' thread counts, the same
cache: a cached one loads in a second). The actor plays `--tasks` tasks of the config's eval pool (`envs.eval_seed`,
else `envs.seed`) with the rollout worker's own player, once per kind of experience in its prompt, and prints
`actor_success_<kind>=`: `none`; on the dark corridors also `right` (a lesson stating the corridor's side, as a
success writes it), `wall` (as a failure that walked the other side to its end writes it), `wrong` (the other side)
and `silent` (a lesson that states nothing). The extractor distils `--held-out` data episodes of unseen tasks
of the config's (the eval split, as its gate does: `pipeline.rl.warm_gate`; half shown the lesson of another play
of the same task, as in training), and prints `extractor_parse_ok=` and `extractor_states_revealed=` (of the parsed
lessons of episodes that revealed something, the share that state it word for word) for each number of steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.envs.dark_corridor import corridor_of
from pipeline.envs.registry import env_spec, task_pool
from pipeline.rl.trainer import initial_policy
from pipeline.rl.warm_gate import Task, play_with_lessons
from pipeline.settings import Settings

CORRIDOR = "MiniHack-DarkCorridor-v0"


def lesson(kind: str, seed: int) -> str | None:
    """A corridor lesson of `kind` for the task of `seed`, worded as the rule-based summariser words them."""
    if kind == "none":
        return None
    _name, offset = corridor_of(seed)
    side, other = ("east", "west") if offset > 0 else ("west", "east")
    return {"right": f"Solved in {abs(offset)} actions. staircase down: {abs(offset)} {side} of the start.",
            "wall": f"Failed after 9 actions (0 invalid). staircase down: {side} of the start (the other end has "
                    "none).",
            "wrong": f"Solved in {abs(offset)} actions. staircase down: {abs(offset)} {other} of the start.",
            "silent": "Failed after 9 actions (1 invalid). Do not repeat north; use listed actions and head for the "
                      "goal."}[kind]


def actor_success(settings: Settings, policy, seeds: Sequence[int], kind: str) -> float:  # type: ignore[no-untyped-def]
    """Success of the warm-started actor on `seeds`, every episode guided by the `kind` lesson (or free)."""
    task = settings.envs.tasks[0]
    max_turns = task.max_turns or env_spec(task.env_id).max_turns
    tasks = [Task(task.env_id, seed, max_turns, lesson(kind, seed)) for seed in seeds]
    outcomes = play_with_lessons(policy, tasks, settings.rollout, settings.envs)
    return sum(outcomes) / len(outcomes)


def extractor_scores(settings: Settings, steps: int, held_out: int) -> tuple[float, float, float]:
    """(parse ok, states revealed, seconds) of the extractor warm-started for `steps` steps, on `held_out` data
    episodes of unseen tasks (the gate's, `pipeline.rl.warm_gate`)."""
    from pipeline.rl.policy_step import deterministic_torch
    from pipeline.rl.warm_gate import distil_held_out, held_out_episodes
    from pipeline.rl.warm_start import warm_start_extractor

    trainer = settings.extractor_trainer
    warm = trainer.warm_start.model_copy(update={"steps": steps})
    deterministic_torch(trainer.threads)  # as the trainer runs it, so the cache entry is the run's
    started = time.perf_counter()
    policy, _stats = warm_start_extractor(initial_policy(trainer.model), warm, settings.envs.tasks, settings.envs,
                                          settings.extractor, merges=settings.scheduler.merge_every > 0,
                                          precision=trainer.model.precision)
    seconds = time.perf_counter() - started
    distilled = distil_held_out(policy, held_out_episodes(settings.envs.tasks, settings.envs, warm, held_out),
                                settings.extractor)
    stating = [d.states_fact for d in distilled if d.states_fact is not None]
    parse_ok = sum(d.parsed for d in distilled) / len(distilled)
    return parse_ok, sum(stating) / len(stating) if stating else float("nan"), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/tiny-dark-corridor.yaml"))
    parser.add_argument("--tasks", type=int, default=100, help="Eval-pool tasks the actor plays per kind of lesson.")
    parser.add_argument("--held-out", type=int, default=96, help="Held-out data episodes the extractor distils.")
    parser.add_argument("--extractor-steps", type=int, nargs="*", default=None,
                        help="Warm-start lengths of the extractor to measure (default: the config's).")
    parser.add_argument("--quick", action="store_true", help="20 tasks, 32 held-out episodes.")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.held_out = 20, 32
    from pipeline.rl.policy_step import deterministic_torch
    from pipeline.rl.warm_start import warm_start_actor

    settings = Settings(config=args.config)
    if len(settings.envs.tasks) != 1:
        sys.exit(f"{args.config} mixes {len(settings.envs.tasks)} tasks; this benchmark measures one-task configs")
    task = settings.envs.tasks[0]
    print(f"config={args.config}")
    trainer = settings.actor_trainer
    deterministic_torch(trainer.threads)
    started = time.perf_counter()
    actor, _stats = warm_start_actor(initial_policy(trainer.model), trainer.warm_start, settings.envs.tasks,
                                     settings.envs, settings.rollout, precision=trainer.model.precision)
    print(f"actor_warm_start_s={time.perf_counter() - started:.1f}")
    eval_seed = settings.envs.seed if settings.envs.eval_seed is None else settings.envs.eval_seed
    seeds = task_pool(task.env_id, "eval", args.tasks, eval_seed)
    kinds = ("none", "right", "wall", "wrong", "silent") if task.env_id == CORRIDOR else ("none",)
    for kind in kinds:
        print(f"actor_success_{kind}={actor_success(settings, actor, seeds, kind):.3f}  # {args.tasks} tasks")
    for steps in args.extractor_steps or [settings.extractor_trainer.warm_start.steps]:
        parse_ok, stated, seconds = extractor_scores(settings, steps, args.held_out)
        print(f"extractor_parse_ok={parse_ok:.3f}  # {steps} steps ({seconds:.0f}s)")
        print(f"extractor_states_revealed={stated:.3f}  # {steps} steps")


if __name__ == "__main__":
    main()
