"""Does it learn? GRPO that improves on MiniHack Room, experiences that help on the dark corridors, with 95% intervals.

    python benchmarks/learning.py                  # both experiments, 5 seeds per arm, goals checked
    python benchmarks/learning.py --quick          # one seed, 3 steps, small pools; no goals
    python benchmarks/learning.py --experiments memory --seeds 3
    python benchmarks/learning.py --experiments room --set CRL_ACTOR_TRAINER__AGGREGATION=seq-mean-token-mean

Every run is a real `crl run CONFIG --arm ARM` (embedded broker, every worker a process), its seed set through
`CRL_ENVS__SEED` and the sampling seeds; runs go one after another (2 cores), and a run directory that already holds
an archive is read instead of run again. Two experiments:

- **room** (`configs/tiny-minihack-room.yaml`): can GRPO alone improve the actor? Arms `grpo` and `control` (the
  same run with every step a warm-up step: the actor never trains). Evaluated before training (step 0) and at the
  last step on one fixed pool of unseen rooms (`--eval-seed`, the same for every seed, disjoint from the train
  pool; `--eval-tasks` rooms, one free episode each). Prints `grpo_delta=` (eval success after minus before, paired
  per room) with `grpo_delta_ci_low=` / `_ci_high=`, and `control_delta=`.
- **memory** (`configs/tiny-dark-corridor.yaml`, the dark corridors): do experiences help where only memory can?
  Arms `complementary`, `grpo`, `static_extractor` and `shuffled` (complementary with `retrieval.serve: other-task`:
  every guided episode is served another task's lesson). Evaluated on the run's recurring train-pool corridors (each
  played `--eval-repeats` times guided and as often free) and, reported beside, on unseen ones. Prints
  `guided_minus_free=` (the complementary arm's last evaluation, paired per corridor) with `_ci_low=`,
  `shuffled_experience_gap=` (the shuffled arm's guided minus free), and `complementary_vs_grpo=` and
  `complementary_vs_static_extractor=` (train success ratios at equal environment steps, paired per step and
  group: both arms of a seed play the same task draws) with `_ci_low=`.

Common random numbers: every arm of a seed plays the same task draws, and every episode samples from a stream keyed
by the seed and the episode's identity (`pipeline.actor.episodes.turn_seed`), so the same slot of the same group
draws the same random numbers in every arm; the arms differ only by what they are. The arms are compared on paired
differences: `grpo_minus_control_<before|after>` (eval success of `grpo` minus `control` on each unseen room, at the
first and the last evaluation) and `complementary_minus_grpo_free_after` (free slots, recurring corridors), with
`complementary_vs_grpo` paired per group. Each comparison also prints `_unpaired_ci_low=` / `_unpaired_ci_high=`
(each arm resampled on its own, as if the arms shared nothing) and `_ci_narrowing=`, the unpaired interval's width
over the paired one's. `--independent-draws` gives each arm its own sampling seeds (the same tasks, other draws),
which measures what sharing the draws adds to sharing the tasks. `--deterministic` runs every run in deterministic
mode (`scheduler.deterministic`: lock step, docs/determinism.md), so a rerun gives the same figures.

Intervals: a two-level bootstrap (seeds, then tasks or groups within each seed; `pipeline.audit.stats`), 95%
percentile, 2,000 resamples. "At equal environment steps": the train groups after the warm-up in steps that began
before the smallest total of actions any run of the two arms reached (`pipeline.audit.learning`). Random play's
success at each family's turn limit on the eval pool is printed first (`random_success_<experiment>=`). The goals
below were fixed before the runs that produced the figures in docs/benchmarks.md.
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
    from pipeline.audit.learning import RunOutcomes
    from pipeline.audit.stats import Estimate

GOALS = {  # fixed before the runs (docs/benchmarks.md#learning-benchmark)
    "grpo_delta": ">= 0.10 with its interval above 0",
    "control_delta": "|x| < 0.05",
    "guided_minus_free": "interval low >= 0.15",
    "complementary_vs_grpo": ">= 1.3 with its interval above 1",
    "shuffled_experience_gap": "interval covers 0 or lies below it (the shuffled control removes the guided gain)",
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
        Arm("grpo", "grpo"),
        Arm("control", "grpo", {"CRL_ACTOR_TRAINER__WARMUP_STEPS": "{steps}", "CRL_SCHEDULER__VARIANT": "control"}))),
    "memory": Experiment("memory", ROOT / "configs" / "tiny-dark-corridor.yaml", "MiniHack-DarkCorridor-v0", (
        Arm("complementary", "complementary"), Arm("grpo", "grpo"), Arm("static_extractor", "static_extractor"),
        Arm("shuffled", "complementary",
            {"CRL_RETRIEVAL__SERVE": "other-task", "CRL_SCHEDULER__VARIANT": "shuffled"}))),
}


def run(experiment: Experiment, arm: Arm, seed: int, args: argparse.Namespace, run_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    # common random numbers: one sampling seed for every arm; --independent-draws gives each arm its own
    draws = seed + 1000 * (1 + experiment.arms.index(arm)) if args.independent_draws else seed
    env.update({
        "HF_HUB_OFFLINE": "1", "CRL_ENVS__SEED": str(seed), "CRL_ROLLOUT__GENERATION__SEED": str(draws),
        "CRL_EXTRACTOR__GENERATION__SEED": str(draws), "CRL_ENVS__EVAL_SEED": str(args.eval_seed),
        "CRL_SCHEDULER__EVAL_EVERY": str(args.steps),  # before training (step 0) and at the last step
    })
    if args.deterministic:
        env.update({"CRL_SCHEDULER__DETERMINISTIC": "true", "CRL_SCHEDULER__MAX_STEPS_AHEAD": "0"})
    if experiment.name == "room":
        env["CRL_ENVS__EVAL_TASKS_PER_ENV"] = str(args.eval_tasks)
    else:
        env.update({"CRL_ENVS__EVAL_REPEATS": str(args.eval_repeats),
                    "CRL_ENVS__EVAL_TASKS_PER_ENV": str(args.unseen_tasks)})
    env.update({key: value.format(steps=args.steps) for key, value in arm.env.items()})
    env.update(dict(setting.split("=", 1) for setting in args.set))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(experiment.config), "--arm", arm.arm,
                             "--steps", str(args.steps), "--run-dir", str(run_dir), "--no-report"],
                            env=env, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{experiment.name}/{arm.name} seed {seed} failed ({result.returncode}):\n"
                         f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(f"# {experiment.name}/{arm.name} seed {seed}: {time.monotonic() - started:.0f}s ({run_dir})", flush=True)


def report(name: str, estimate: Estimate, goal: Callable[[Estimate], bool] | None, check: bool) -> None:
    print(f"{name}={estimate.value:.4f}")
    print(f"{name}_ci_low={estimate.low:.4f}")
    print(f"{name}_ci_high={estimate.high:.4f}")
    if check and goal is not None:
        print(f"{name}_goal={'met' if goal(estimate) else 'missed'} ({GOALS[name]})")


def report_pair(name: str, paired: Estimate | None, unpaired: Estimate | None) -> None:
    """A comparison of two arms: its paired interval (`report`), the unpaired one of the same runs, and how much
    narrower the pairing made it."""
    if paired is None or unpaired is None:
        raise SystemExit(f"{name}: the runs lack the evaluations it compares")
    report(name, paired, None, False)
    print(f"{name}_unpaired_ci_low={unpaired.low:.4f}")
    print(f"{name}_unpaired_ci_high={unpaired.high:.4f}")
    width, unpaired_width = paired.high - paired.low, unpaired.high - unpaired.low
    print(f"{name}_ci_narrowing={unpaired_width / width:.2f}" if width > 0 else
          f"{name}_ci_narrowing=inf  # the paired interval is a point: every pair differs by the same amount")


def print_arms(runs: dict[str, list[RunOutcomes]], resamples: int) -> None:
    """Every arm's evaluation success before and after, per pool and slot kind (`eval_<when>_<pool>_<kind>_<arm>=`),
    the rise between them (`rise_...`) and guided minus free at the end (`gap_<pool>_<arm>=`)."""
    from pipeline.audit.learning import arm_table

    for arm_name, outcomes in runs.items():
        for row in arm_table(outcomes, resamples):
            for when, estimate in (("before", row.before), ("after", row.after), ("rise", row.rise)):
                if estimate is not None:
                    prefix = "rise" if when == "rise" else f"eval_{when}"
                    print(f"{prefix}_{row.pool}_{row.kind}_{arm_name}={estimate}")
            if row.gap is not None:
                print(f"gap_{row.pool}_{arm_name}={row.gap}")


def side(text: str) -> str | None:
    """The side of the stairs a corridor lesson or fact states, if any."""
    return "east" if " east of the start" in text else "west" if " west of the start" in text else None


def corridor_diagnostics(run_dirs: list[Path]) -> None:
    """What the complementary runs' archives say about their lessons: guided success by what the served lesson
    states (the corridor's side, the other side, no side, nothing served), at the last evaluation of the recurring
    corridors and in training after the warm-up; and how often the extractor's adds and refines state the side the
    episode revealed (`lesson_side_accuracy=`)."""
    import json

    from pipeline.audit.views import Audit
    from pipeline.envs.dark_corridor import corridor_of

    served: dict[tuple[str, str], list[bool]] = {}
    stated = written = 0
    for run_dir in run_dirs:
        with Audit(run_dir) as audit:
            texts = {(e, 1): t for e, t in audit.query("SELECT experience_id, text FROM experience_added")[1]}
            texts |= {(e, v + 1): t for e, v, t in audit.query(
                "SELECT experience_id, expected_version, text FROM experience_refined")[1]}
            last_eval = audit.query("SELECT max(step) FROM trajectories WHERE split = 'eval'")[1][0][0]
            rows = audit.query("SELECT split, step, group_id, seed, success, retrieved, revealed, trajectory_id "
                               "FROM trajectory_completed WHERE guided")[1]
            warmup = json.loads(audit.query("SELECT config FROM run_started")[1][0][0])["actor_trainer"][
                "warmup_steps"]
            for split, step, group_id, seed, success, retrieved, _revealed, _tid in rows:
                if (split == "eval" and (step != last_eval or "-r" not in group_id)) or \
                        (split == "train" and step < warmup):
                    continue
                refs = json.loads(retrieved) if isinstance(retrieved, str) else retrieved
                truth = "east" if corridor_of(int(seed))[1] > 0 else "west"
                said = side(texts.get((refs[0]["experience_id"], refs[0]["version"]), "")) if refs else "nothing"
                kind = "nothing" if said == "nothing" else "none" if said is None else \
                    "right" if said == truth else "wrong"
                served.setdefault((split, kind), []).append(bool(success))
            facts = {t: json.loads(r) if isinstance(r, str) else r for t, r in audit.query(
                "SELECT trajectory_id, revealed FROM trajectory_completed")[1]}
            for text, sources in audit.query(
                    "SELECT text, source_trajectory_ids FROM experience_added UNION ALL "
                    "SELECT text, source_trajectory_ids FROM experience_refined")[1]:
                sources = json.loads(sources) if isinstance(sources, str) else sources
                truth_side = side("; ".join(facts.get(sources[0], []) if sources else []))
                if truth_side is not None:
                    written += 1
                    stated += side(text) == truth_side
    for (split, kind), outcomes in sorted(served.items()):
        print(f"served_{kind}_{split}_success={sum(outcomes) / len(outcomes):.3f}  # {sum(outcomes)} of "
              f"{len(outcomes)} guided episodes")
    if written:
        print(f"lesson_side_accuracy={stated / written:.3f}  # {stated} of {written} adds and refines of episodes "
              "that revealed the side")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiments", nargs="+", default=list(EXPERIMENTS), choices=list(EXPERIMENTS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-seed", type=int, default=0, help="Seeds the fixed pool of unseen eval tasks.")
    parser.add_argument("--eval-tasks", type=int, default=300, help="Room: unseen rooms per evaluation.")
    parser.add_argument("--eval-repeats", type=int, default=13,
                        help="Memory: plays of each eval corridor per evaluation, guided and as many free.")
    parser.add_argument("--unseen-tasks", type=int, default=8, help="Memory: unseen corridors reported beside.")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None, help="Directory for the runs (default runs/learning-*).")
    parser.add_argument("--quick", action="store_true", help="One seed, 3 steps, small eval pools, no goals.")
    parser.add_argument("--arms", nargs="+", default=[], metavar="ARM",
                        help="Run only these arms (an ablation): their evaluations are printed, no comparison.")
    parser.add_argument("--set", action="append", default=[], metavar="CRL_KEY=VALUE",
                        help="A setting for every run (an ablation: CRL_ACTOR_TRAINER__AGGREGATION=...); repeatable.")
    parser.add_argument("--independent-draws", action="store_true",
                        help="Give each arm its own sampling seeds: the same tasks, other draws (no common random "
                        "numbers).")
    parser.add_argument("--deterministic", action="store_true",
                        help="Run every run in deterministic mode (scheduler.deterministic, lock step).")
    args = parser.parse_args()
    for setting in args.set:
        if not setting.startswith("CRL_") or "=" not in setting:
            parser.error(f"--set takes CRL_KEY=VALUE, got {setting!r}")
    if args.quick:
        args.seeds, args.steps, args.eval_tasks, args.eval_repeats, args.unseen_tasks = 1, 3, 32, 2, 2
    check = not args.quick and args.seeds >= 5
    out = args.out or ROOT / "runs" / f"learning-{time.strftime('%Y%m%d-%H%M%S')}"
    from pipeline.audit.learning import (
        arm_difference,
        eval_rise,
        guided_gap,
        load_outcomes,
        ratio_at_equal_env_steps,
    )
    from pipeline.envs.random_play import random_play
    from pipeline.envs.registry import task_pool
    from pipeline.settings import Settings

    print(f"seeds={args.seeds}")
    print(f"steps={args.steps}")
    print(f"eval_seed={args.eval_seed}")
    print(f"common_random_numbers={'no' if args.independent_draws else 'yes'}")
    print(f"deterministic={'yes' if args.deterministic else 'no'}")
    started = time.monotonic()
    for name in args.experiments:
        experiment = EXPERIMENTS[name]
        settings = Settings(config=experiment.config)
        turns = settings.envs.tasks[0].max_turns or 30
        floor = random_play(experiment.env_id, settings.envs, max_turns=turns, rng_seed=args.eval_seed,
                            seeds=task_pool(experiment.env_id, "eval", 200, args.eval_seed))
        print(f"random_success_{name}={floor.rate:.4f}  # {floor.episodes} episodes at {turns} turns, 95% "
              f"{floor.interval()[0]:.3f}-{floor.interval()[1]:.3f}")
        runs: dict[str, list[RunOutcomes]] = {}
        for arm in [a for a in experiment.arms if not args.arms or a.name in args.arms]:
            runs[arm.name] = []
            for seed in range(args.seeds):
                run_dir = out / name / f"{arm.name}-s{seed}"
                if not (run_dir / "archive").exists():
                    run(experiment, arm, seed, args, run_dir)
                runs[arm.name].append(load_outcomes(run_dir))
        print_arms(runs, args.resamples)
        if args.arms:
            continue  # an ablation of some arms: their evaluations only
        if name == "room":
            grpo = eval_rise(runs["grpo"], "t", guided=False, resamples=args.resamples)
            control = eval_rise(runs["control"], "t", guided=False, resamples=args.resamples)
            if grpo is None or control is None:
                raise SystemExit("the room runs need an evaluation before and after training")
            report("grpo_delta", grpo, lambda e: e.value >= 0.10 and e.low > 0, check)
            report("control_delta", control, lambda e: abs(e.value) < 0.05, check)
            report_pair("grpo_minus_control_before", *(
                arm_difference(runs["grpo"], runs["control"], "t", "first", guided=False, paired=paired,
                               resamples=args.resamples) for paired in (True, False)))
            report_pair("grpo_minus_control_after", *(
                arm_difference(runs["grpo"], runs["control"], "t", "last", guided=False, paired=paired,
                               resamples=args.resamples) for paired in (True, False)))
        else:
            corridor_diagnostics([out / name / f"complementary-s{seed}" for seed in range(args.seeds)])
            gap = guided_gap(runs["complementary"], "r", resamples=args.resamples)
            shuffled = guided_gap(runs["shuffled"], "r", resamples=args.resamples)
            if gap is None or shuffled is None:
                raise SystemExit("the memory runs need an evaluation of the recurring corridors")
            report("guided_minus_free", gap, lambda e: e.low >= 0.15, check)
            report("shuffled_experience_gap", shuffled, lambda e: e.low <= 0, check)
            for other, goal in (("grpo", lambda e: e.value >= 1.3 and e.low > 1),
                                ("static_extractor", lambda e: e.value > 1)):
                ratio, budget = ratio_at_equal_env_steps(runs["complementary"], runs[other], args.resamples)
                print(f"env_step_budget_{other}={budget}")
                report(f"complementary_vs_{other}", ratio, goal, check)
                unpaired, _ = ratio_at_equal_env_steps(runs["complementary"], runs[other], args.resamples,
                                                       paired=False)
                print(f"complementary_vs_{other}_unpaired_ci_low={unpaired.low:.4f}")
                print(f"complementary_vs_{other}_unpaired_ci_high={unpaired.high:.4f}")
                print(f"complementary_vs_{other}_ci_narrowing="
                      f"{(unpaired.high - unpaired.low) / (ratio.high - ratio.low):.2f}")
            report_pair("complementary_minus_grpo_free_after", *(
                arm_difference(runs["complementary"], runs["grpo"], "r", "last", guided=False, paired=paired,
                               resamples=args.resamples) for paired in (True, False)))
    print(f"benchmark_s={time.monotonic() - started:.0f}")
    print(f"# runs in {out}")


if __name__ == "__main__":
    main()
