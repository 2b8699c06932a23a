"""Does it learn? GRPO that improves on MiniHack Room, experiences that help on the dark corridors, with 95% intervals.

    python benchmarks/learning.py                  # every experiment, 5 seeds per arm, thresholds checked
    python benchmarks/learning.py --quick          # one seed, few steps, small pools; no thresholds
    python benchmarks/learning.py --experiments memory --seeds 3 --steps 8

Every run is a real `crl run CONFIG --arm ARM` (embedded broker, every worker a process), its seed set through
`CRL_ENVS__SEED` and the sampling seeds; runs go one after another (2 cores), and a run directory that already holds
an archive is read instead of run again. Two experiments:

- **room** (`configs/tiny-minihack-room.yaml`): can GRPO alone improve the actor? Arms `grpo` and `control` (the
  same run with every step a warm-up step: the actor never trains). Evaluated before training (step 0) and after the
  last step on one fixed pool of unseen rooms (`--eval-seed`, the same for every seed; `--eval-tasks` rooms, one
  free episode each). Prints `grpo_delta=` (eval success after minus before, grpo, paired per room) with
  `grpo_delta_ci_low=` / `_ci_high=`, and `control_delta=`.
- **memory** (`configs/tiny-dark-corridor.yaml`): do experiences help where only memory can? Arms `complementary`,
  `grpo`, `static_extractor` and `shuffled` (complementary with `retrieval.serve: other-task`: every guided
  episode is served another task's lesson). Evaluated on the run's recurring train-pool corridors (each played
  `--eval-repeats` times guided and as often free) and, beside, on unseen ones. Prints `guided_minus_free=` (the
  complementary arm's last evaluation, paired per corridor) with `_ci_low=`, `complementary_vs_grpo=` (train success
  ratio at equal environment steps, paired per step and group: both arms play the same task draws) with
  `_ci_low=`, `shuffled_experience_gap=` (the shuffled arm's guided minus free) and
  `complementary_vs_static_extractor=`.

Intervals: a two-level bootstrap (seeds, then tasks within each seed; `pipeline.audit.stats`), 95% percentile,
2,000 resamples. "At equal environment steps": each arm's train episodes after the warm-up, in steps that started
before the smallest total of actions any run of the experiment reached. Random play's success at each family's turn
limit is printed first (`random_success_<family>=`), and every threshold below was fixed before any run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from pipeline.audit.stats import Estimate

GOALS = {  # fixed before the runs (docs/benchmarks.md#learning)
    "grpo_delta": ">= 0.10 with its interval above 0",
    "control_delta": "|x| < 0.05",
    "guided_minus_free": "interval low >= 0.15",
    "complementary_vs_grpo": ">= 1.3 with its interval above 1",
    "shuffled_experience_gap": "near 0 (the shuffled control removes the guided gain)",
    "complementary_vs_static_extractor": "> 1",
}


@dataclass(frozen=True)
class Arm:
    name: str
    arm: str
    """The `--arm` of crl run."""
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Experiment:
    name: str
    config: Path
    env_id: str
    arms: tuple[Arm, ...]


EXPERIMENTS = {
    "room": Experiment("room", ROOT / "configs" / "tiny-minihack-room.yaml", "MiniHack-Room-Random-5x5-v0", (
        Arm("grpo", "grpo"), Arm("control", "grpo", {"CRL_ACTOR_TRAINER__WARMUP_STEPS": "{steps}"}))),
    "memory": Experiment("memory", ROOT / "configs" / "tiny-dark-corridor.yaml", "MiniHack-DarkCorridor-v0", (
        Arm("complementary", "complementary"), Arm("grpo", "grpo"), Arm("static_extractor", "static_extractor"),
        Arm("shuffled", "complementary", {"CRL_RETRIEVAL__SERVE": "other-task"}))),
}


def run(experiment: Experiment, arm: Arm, seed: int, args: argparse.Namespace, run_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({
        "HF_HUB_OFFLINE": "1", "CRL_ENVS__SEED": str(seed), "CRL_ROLLOUT__GENERATION__SEED": str(seed),
        "CRL_EXTRACTOR__GENERATION__SEED": str(seed), "CRL_ENVS__EVAL_SEED": str(args.eval_seed),
        "CRL_SCHEDULER__EVAL_EVERY": str(args.steps),  # before training (step 0) and after the last step
    })
    if experiment.name == "room":
        env["CRL_ENVS__EVAL_TASKS_PER_ENV"] = str(args.eval_tasks)
    else:
        env.update({"CRL_ENVS__EVAL_REPEATS": str(args.eval_repeats),
                    "CRL_ENVS__EVAL_TASKS_PER_ENV": str(args.unseen_tasks)})
    env.update({key: value.format(steps=args.steps) for key, value in arm.env.items()})
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(experiment.config), "--arm", arm.arm,
                             "--steps", str(args.steps), "--run-dir", str(run_dir), "--no-report"],
                            env=env, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{experiment.name}/{arm.name} seed {seed} failed ({result.returncode}):\n"
                         f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(f"# {experiment.name}/{arm.name} seed {seed}: {time.monotonic() - started:.0f}s ({run_dir})", flush=True)


@dataclass
class RunData:
    """What one run's archive says, per task."""

    evals: dict[tuple[int, str, str], dict[bool, list[bool]]]
    """(eval step, pool 't' unseen | 'r' recurring, task seed) -> guided? -> outcomes."""
    train: list[tuple[int, int, int, int, int]]
    """Per train step and group: (step, group, successes, episodes, actions)."""
    warmup: int


def read(run_dir: Path) -> RunData:
    from pipeline.audit.views import Audit

    with Audit(run_dir) as audit:
        evals: dict[tuple[int, str, str], dict[bool, list[bool]]] = {}
        rows = audit.query("SELECT step, group_id, seed, guided, success FROM trajectories WHERE split = 'eval'")[1]
        for step, group_id, seed, guided, success in rows:
            pool = group_id.rsplit("-", 1)[1][0]
            evals.setdefault((int(step), pool, str(seed)), {True: [], False: []})[bool(guided)].append(bool(success))
        train = [tuple(int(x) for x in row) for row in audit.query(
            "SELECT step, CAST(regexp_extract(group_id, 'g(\\d+)$', 1) AS INT), sum(success::INT), count(*), "
            "sum(num_actions) FROM trajectories WHERE split = 'train' GROUP BY ALL ORDER BY 1, 2")[1]]
        config = audit.query("SELECT config FROM run_started")[1][0][0]
    import json

    return RunData(evals, train, int(json.loads(config)["actor_trainer"]["warmup_steps"]))  # type: ignore[arg-type]


def eval_units(data: RunData, pool: str, first: bool) -> dict[str, dict[bool, list[bool]]]:
    steps = sorted({step for step, p, _ in data.evals if p == pool})
    if not steps:
        return {}
    step = steps[0] if first else steps[-1]
    return {seed: outcomes for (s, p, seed), outcomes in data.evals.items() if s == step and p == pool}


def mean(values: list[bool] | list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def window(runs: dict[str, list[RunData]]) -> int:
    """The smallest total of train actions any run reached."""
    return min(sum(row[4] for row in data.train) for datas in runs.values() for data in datas)


def trained_groups(data: RunData, budget: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(step, group) -> (successes, episodes) of train groups after the warm-up in steps begun within `budget`."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    spent = 0
    by_step: dict[int, list[tuple[int, int, int, int]]] = {}
    for step, group, successes, episodes, actions in data.train:
        by_step.setdefault(step, []).append((group, successes, episodes, actions))
    for step in sorted(by_step):
        if step >= data.warmup and spent < budget:
            for group, successes, episodes, _ in by_step[step]:
                out[(step, group)] = (successes, episodes)
        spent += sum(actions for *_, actions in by_step[step])
    return out


def ratio_units(a: list[RunData], b: list[RunData], budget: int) -> dict[int, list[tuple[int, int, int, int]]]:
    """Per seed, per (step, group) both arms trained: (successes A, episodes A, successes B, episodes B)."""
    units = {}
    for seed, (run_a, run_b) in enumerate(zip(a, b, strict=True)):
        ga, gb = trained_groups(run_a, budget), trained_groups(run_b, budget)
        units[seed] = [(*ga[key], *gb[key]) for key in sorted(ga.keys() & gb.keys())]
    return units


def ratio(units: list[tuple[int, int, int, int]]) -> float:
    rate_a = sum(u[0] for u in units) / sum(u[1] for u in units)
    rate_b = sum(u[2] for u in units) / sum(u[3] for u in units)
    return rate_a / rate_b


def by_seed(datas: list[RunData], pool: str, first: bool, guided: bool) -> dict[int, list[list[bool]]]:
    """Per seed, each task's outcomes of one slot kind at the first or the last evaluation."""
    return {seed: [o[guided] for o in eval_units(data, pool, first).values() if o[guided]]
            for seed, data in enumerate(datas)}


def delta_units(datas: list[RunData], pool: str, guided: bool) -> dict[int, list[tuple[float, float]]]:
    """Per seed, each task's (success before, success after) training."""
    units = {}
    for seed, data in enumerate(datas):
        before, after = eval_units(data, pool, True), eval_units(data, pool, False)
        units[seed] = [(mean(before[t][guided]), mean(after[t][guided])) for t in sorted(before.keys() & after.keys())
                       if before[t][guided] and after[t][guided]]
    return units


def gap_units(datas: list[RunData]) -> dict[int, list[tuple[float, float]]]:
    """Per seed, each recurring task's (guided success, free success) at the last evaluation."""
    return {seed: [(mean(o[True]), mean(o[False])) for o in eval_units(data, "r", False).values()
                   if o[True] and o[False]] for seed, data in enumerate(datas)}


def paired_difference(units: list[tuple[float, float]]) -> float:
    """Mean of first minus second over paired units: (after, before) gives a delta, (guided, free) a gap."""
    return mean([a - b for a, b in units])


def report(name: str, estimate: Estimate, goal: Callable[[Estimate], bool] | None, check: bool) -> None:
    print(f"{name}={estimate.value:.4f}")
    print(f"{name}_ci_low={estimate.low:.4f}")
    print(f"{name}_ci_high={estimate.high:.4f}")
    if check and goal is not None:
        print(f"{name}_goal={'met' if goal(estimate) else 'missed'} ({GOALS[name]})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiments", nargs="+", default=list(EXPERIMENTS), choices=list(EXPERIMENTS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-seed", type=int, default=0, help="Seeds the fixed pool of unseen eval tasks.")
    parser.add_argument("--eval-tasks", type=int, default=200, help="Room: unseen rooms per evaluation.")
    parser.add_argument("--eval-repeats", type=int, default=13,
                        help="Memory: plays of each recurring corridor per evaluation, guided and as many free.")
    parser.add_argument("--unseen-tasks", type=int, default=8, help="Memory: unseen corridors reported beside.")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None, help="Directory for the runs (default runs/learning-*).")
    parser.add_argument("--quick", action="store_true", help="One seed, 3 steps, small eval pools, no thresholds.")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps, args.eval_tasks, args.eval_repeats, args.unseen_tasks = 1, 3, 16, 2, 2
    check = not args.quick and args.seeds >= 5
    out = args.out or ROOT / "runs" / f"learning-{time.strftime('%Y%m%d-%H%M%S')}"
    from pipeline.audit.stats import bootstrap, success_rate
    from pipeline.envs.random_play import random_play
    from pipeline.envs.registry import task_pool
    from pipeline.settings import Settings

    print(f"seeds={args.seeds}")
    print(f"steps={args.steps}")
    print(f"eval_seed={args.eval_seed}")
    started = time.monotonic()
    for name in args.experiments:
        experiment = EXPERIMENTS[name]
        settings = Settings(config=experiment.config)
        turns = settings.envs.tasks[0].max_turns or 30
        floor = random_play(experiment.env_id, settings.envs, max_turns=turns, rng_seed=args.eval_seed,
                            seeds=task_pool(experiment.env_id, "eval", 200, args.eval_seed))
        print(f"random_success_{name}={floor.rate:.4f}  # {floor.episodes} episodes at {turns} turns, 95% "
              f"{floor.interval()[0]:.3f}-{floor.interval()[1]:.3f}")
        runs: dict[str, list[RunData]] = {}
        for arm in experiment.arms:
            runs[arm.name] = []
            for seed in range(args.seeds):
                run_dir = out / name / f"{arm.name}-s{seed}"
                if not (run_dir / "archive").exists():
                    run(experiment, arm, seed, args, run_dir)
                runs[arm.name].append(read(run_dir))

        if name == "room":
            for arm_name in ("grpo", "control"):
                datas = runs[arm_name]
                start = bootstrap(by_seed(datas, "t", True, False), success_rate, resamples=args.resamples)
                end = bootstrap(by_seed(datas, "t", False, False), success_rate, resamples=args.resamples)
                print(f"eval_before_{arm_name}={start}")
                print(f"eval_after_{arm_name}={end}")
            deltas = {arm: {seed: [(after, before) for before, after in units] for seed, units in
                            delta_units(runs[arm], "t", False).items()} for arm in ("grpo", "control")}
            report("grpo_delta", bootstrap(deltas["grpo"], paired_difference, resamples=args.resamples),
                   lambda e: e.value >= 0.10 and e.low > 0, check)
            control = bootstrap(deltas["control"], paired_difference, resamples=args.resamples)
            report("control_delta", control, lambda e: abs(e.value) < 0.05, check)
        else:
            for arm_name, datas in runs.items():
                for pool, label in (("r", "recurring"), ("t", "unseen")):
                    for guided in (True, False):
                        if arm_name == "grpo" and guided:
                            continue
                        kind = "guided" if guided else "free"
                        for first, when in ((True, "before"), (False, "after")):
                            units = by_seed(datas, pool, first, guided)
                            if any(units.values()):
                                print(f"eval_{when}_{label}_{kind}_{arm_name}="
                                      f"{bootstrap(units, success_rate, resamples=args.resamples)}")

            report("guided_minus_free", bootstrap(gap_units(runs["complementary"]), paired_difference,
                                                  resamples=args.resamples),
                   lambda e: e.low >= 0.15, check)
            report("shuffled_experience_gap", bootstrap(gap_units(runs["shuffled"]), paired_difference,
                                                        resamples=args.resamples),
                   None, check)
            budget = window(runs)
            print(f"env_step_budget={budget}")
            for other, goal in (("grpo", lambda e: e.value >= 1.3 and e.low > 1),
                                ("static_extractor", lambda e: e.value > 1)):
                estimate = bootstrap(ratio_units(runs["complementary"], runs[other], budget), ratio,
                                     resamples=args.resamples)
                report(f"complementary_vs_{other}", estimate, goal, check)
    print(f"benchmark_s={time.monotonic() - started:.0f}")
    print(f"# runs in {out}")


if __name__ == "__main__":
    main()
