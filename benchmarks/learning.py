"""Does it learn? GRPO that improves on MiniHack Room, experiences that help on the dark corridors, and an extractor
that learns from the outcomes of its lessons, with 95% intervals, from empty warm-start caches.

    python benchmarks/learning.py                  # every experiment, 5 seeds per arm, goals checked
    python benchmarks/learning.py --quick          # one seed, 3 steps, small pools; no goals
    python benchmarks/learning.py --experiments extractor --seeds 5 --seed-base 100
    python benchmarks/learning.py --experiments room --set CRL_ACTOR_TRAINER__AGGREGATION=seq-mean-token-mean

Every run is a real `crl run CONFIG --arm ARM` (embedded broker, every worker a process), its seed set through
`CRL_ENVS__SEED` and the sampling seeds (seeds `--seed-base` to `--seed-base + --seeds - 1`); runs go one after
another (2 cores), and a run directory that already holds an archive is read instead of run again. The warm starts
are computed into an empty cache of the benchmark's own (`OUT/warm-start-cache`) unless `--warm-start-cache DIR`
names another, so every figure comes from the code as it is; the runs of one benchmark share it. A run whose warm
start missed its gate (`warm_start.gate`) is not scored: the benchmark names it and exits. The gates are checked on
each arm's first run: its later seeds load the same cached weights (the seeds are not part of the cache key), so they
skip the check (`warm_start.gate: null`), which takes minutes with SmolLM2. Five experiments:

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
  group: both arms of a seed play the same task draws) with `_ci_low=`; `complementary_vs_grpo_free=` is the same
  ratio on the free slots alone (what the actor itself learnt, without a lesson), beside the pooled one.
- **extractor** (`configs/tiny-dark-corridor-extractor.yaml`): does the extractor learn from its reward? The actor
  is frozen at a warm start that follows lessons, and the extractor starts deliberately imperfect (its warm start
  leaves what the episode revealed out of half its lessons). Arms `trained` (`exp_only`: CISPO trains the extractor)
  and `frozen` (neither model trains). Prints, per extractor version of the trained runs (pooled), the share of its
  lessons that state what their episode revealed, the success of the guided episodes its lessons were served to and
  the CISPO steps behind it, then each CISPO step's reward mean and variance; then `extractor_right_share_gain=`:
  the share of lessons that state what their episode revealed, written by the last version trained minus version 0
  of the frozen run, both distilling the same `--held-out` data episodes of unseen corridors with the same draws
  (paired per episode), and `extractor_guided_gain=`: guided eval success on the recurring corridors at the last
  evaluation, trained minus frozen (paired per corridor).
- **signpost** (`configs/tiny-signpost-corridor.yaml`): do lessons carry over to unseen tasks, and does training the
  extractor pay? Every figure is on unseen corridors (`--signpost-tasks`, each played `--signpost-repeats` times
  guided and as often free) at the last evaluation. Arms `complementary`, `grpo`, `static_extractor`,
  `extractor_trained` (`exp_only`: the actor frozen) and `extractor_frozen` (`frozen`), and the controls `flipped`
  (`envs.signpost.flip_unseen`), `shuffled` (`retrieval.serve: other-task`) and `same_instance`
  (`retrieval.min_similarity: 0.99`). Prints the kinds of lesson per extractor version and arm
  (`rule_share_<arm>_v<version>=`), `frozen_actor_extractor_gain=` (guided, trained minus frozen extractor),
  `coevolution_vs_static=` (guided, complementary over static_extractor), `unseen_guided_minus_free=`,
  `internalization=` (free, complementary minus grpo), `flipped_guided_minus_free=`, `shuffled_unseen_gap=` and
  `same_instance_unseen_gap=`, paired per corridor.
- **smol-signpost** (`configs/smol-signpost-corridor.yaml`): the same family with SmolLM2-135M-Instruct as actor
  and extractor, each warm-started for a few steps and then trained with a LoRA adapter. One arm, `complementary`,
  6 steps, 16 unseen corridors per evaluation (fewer with `--signpost-tasks`); prints its lessons' kinds per
  extractor version and `unseen_guided_minus_free=`. Meant for 3 seeds (`--seeds 3`): no goal is checked.

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

Intervals: a two-level bootstrap (seeds, then tasks, groups or episodes within each seed; `pipeline.audit.stats`),
95% percentile, 2,000 resamples. "At equal environment steps": the train groups after the warm-up in steps that
began before the smallest total of actions any run of the two arms reached (`pipeline.audit.learning`). Random
play's success at each family's turn limit on the eval pool is printed first (`random_success_<experiment>=`). The
goals (`GOALS`) were fixed before the runs that produced the figures in docs/benchmarks.md.
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
    "shuffled_experience_gap": "near 0: the interval covers 0 and is at most 0.2 wide",
    "complementary_vs_static_extractor": "> 1",
    "extractor_right_share_gain": ">= 0.25 with its interval above 0",
    "frozen_actor_extractor_gain": ">= 0.15 with its interval above 0",
    "coevolution_vs_static": ">= 1.2 with its interval above 1",
    "unseen_guided_minus_free": "interval low >= 0.15",
    "flipped_guided_minus_free": "below 0: the interval's high < 0",
    "shuffled_unseen_gap": "near 0: the interval covers 0 and is at most 0.2 wide",
    "same_instance_unseen_gap": "near 0: the interval covers 0 and is at most 0.2 wide",
}


def near_zero(estimate: Estimate) -> bool:
    return estimate.low <= 0 <= estimate.high and estimate.high - estimate.low <= 0.2


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
    steps: int = 10
    """Steps per run (`--steps` overrides every experiment's)."""
    unseen_tasks: int | None = None
    """Signpost families: unseen corridors per evaluation in place of `--signpost-tasks` (at most it)."""
    goals: bool = True
    """Whether its figures are held to `GOALS` (with 5 seeds or more, not `--quick`)."""

    @property
    def signpost(self) -> bool:
        return self.env_id == "MiniHack-SignpostCorridor-v0"


EXPERIMENTS = {
    "room": Experiment("room", ROOT / "configs" / "tiny-minihack-room.yaml", "MiniHack-Room-Random-5x5-v0", (
        Arm("grpo", "grpo"),
        Arm("control", "grpo", {"CRL_ACTOR_TRAINER__WARMUP_STEPS": "{steps}", "CRL_SCHEDULER__VARIANT": "control"}))),
    "memory": Experiment("memory", ROOT / "configs" / "tiny-dark-corridor.yaml", "MiniHack-DarkCorridor-v0", (
        Arm("complementary", "complementary"), Arm("grpo", "grpo"), Arm("static_extractor", "static_extractor"),
        Arm("shuffled", "complementary",
            {"CRL_RETRIEVAL__SERVE": "other-task", "CRL_SCHEDULER__VARIANT": "shuffled"}))),
    "extractor": Experiment("extractor", ROOT / "configs" / "tiny-dark-corridor-extractor.yaml",
                            "MiniHack-DarkCorridor-v0", (Arm("trained", "exp_only"), Arm("frozen", "frozen")),
                            steps=24),
    "signpost": Experiment("signpost", ROOT / "configs" / "tiny-signpost-corridor.yaml",
                           "MiniHack-SignpostCorridor-v0", (
                               Arm("complementary", "complementary"), Arm("grpo", "grpo"),
                               Arm("static_extractor", "static_extractor"),
                               Arm("extractor_trained", "exp_only"), Arm("extractor_frozen", "frozen"),
                               Arm("flipped", "complementary",
                                   {"CRL_ENVS__SIGNPOST__FLIP_UNSEEN": "true", "CRL_SCHEDULER__VARIANT": "flipped"}),
                               Arm("shuffled", "complementary",
                                   {"CRL_RETRIEVAL__SERVE": "other-task", "CRL_SCHEDULER__VARIANT": "shuffled"}),
                               Arm("same_instance", "complementary",
                                   {"CRL_RETRIEVAL__MIN_SIMILARITY": "0.99",
                                    "CRL_SCHEDULER__VARIANT": "same_instance"})),
                           steps=24),
    "smol-signpost": Experiment("smol-signpost", ROOT / "configs" / "smol-signpost-corridor.yaml",
                                "MiniHack-SignpostCorridor-v0", (Arm("complementary", "complementary"),),
                                steps=6, unseen_tasks=16, goals=False),
}


def run_env(experiment: Experiment, arm: Arm, seed: int, args: argparse.Namespace, steps: int,
            gated: bool = False) -> dict[str, str]:
    """The environment of one run of `arm`: the process's own without its `CRL_*` variables, then the seeds, the
    evaluation pools, the shared warm-start cache, the arm's own settings and the `--set` ones, in that order.
    `gated`: an earlier run of the arm passed the gates of the warm starts this run loads, so it checks none."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    # common random numbers: one sampling seed for every arm; --independent-draws gives each arm its own
    draws = seed + 1000 * (1 + experiment.arms.index(arm)) if args.independent_draws else seed
    env.update({
        "HF_HUB_OFFLINE": "1", "CRL_ENVS__SEED": str(seed), "CRL_ROLLOUT__GENERATION__SEED": str(draws),
        "CRL_EXTRACTOR__GENERATION__SEED": str(draws), "CRL_ENVS__EVAL_SEED": str(args.eval_seed),
        "CRL_SCHEDULER__EVAL_EVERY": str(steps),  # before training (step 0) and at the last step
        "CRL_ACTOR_TRAINER__WARM_START__CACHE_DIR": str(args.warm_start_cache),
        "CRL_EXTRACTOR_TRAINER__WARM_START__CACHE_DIR": str(args.warm_start_cache),
    })
    if gated:
        env.update({"CRL_ACTOR_TRAINER__WARM_START__GATE": "null", "CRL_EXTRACTOR_TRAINER__WARM_START__GATE": "null"})
    if args.deterministic:
        env.update({"CRL_SCHEDULER__DETERMINISTIC": "true", "CRL_SCHEDULER__MAX_STEPS_AHEAD": "0"})
    if experiment.name == "room":
        env["CRL_ENVS__EVAL_TASKS_PER_ENV"] = str(args.eval_tasks)
    elif experiment.signpost:
        tasks = min(experiment.unseen_tasks or args.signpost_tasks, args.signpost_tasks)
        env.update({"CRL_ENVS__EVAL_REPEATS": str(args.signpost_repeats), "CRL_ENVS__EVAL_TASKS_PER_ENV": str(tasks)})
    else:
        env.update({"CRL_ENVS__EVAL_REPEATS": str(args.eval_repeats),
                    "CRL_ENVS__EVAL_TASKS_PER_ENV": str(args.unseen_tasks)})
    env.update({key: value.format(steps=steps) for key, value in arm.env.items()})
    env.update(dict(setting.split("=", 1) for setting in args.set))
    return env


def run(experiment: Experiment, arm: Arm, seed: int, args: argparse.Namespace, run_dir: Path, steps: int,
        gated: bool) -> None:
    env = run_env(experiment, arm, seed, args, steps, gated)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(experiment.config), "--arm", arm.arm,
                             "--steps", str(steps), "--run-dir", str(run_dir), "--no-report"],
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


def extractor_report(runs: dict[str, list[RunOutcomes]], args: argparse.Namespace, check: bool) -> None:
    """The extractor experiment: what each version of the trained extractor wrote and what its lessons did, its CISPO
    steps, then the trained extractor against the frozen one on held-out episodes and in evaluation."""
    from pipeline.audit.learning import ExtractorVersion, arm_difference, extractor_steps, extractor_versions

    trained, frozen = runs["trained"], runs["frozen"]
    pooled: dict[int, list[ExtractorVersion]] = {}
    for run in trained:
        for written in extractor_versions(run.run_dir):
            pooled.setdefault(written.version, []).append(written)
    for version, parts in sorted(pooled.items()):
        lessons, stating = sum(p.lessons for p in parts), sum(p.stating for p in parts)
        guided, successes = sum(p.guided for p in parts), sum(p.successes for p in parts)
        share = f"{stating / lessons:.3f}" if lessons else "-"
        success = f"{successes / guided:.3f}" if guided else "-"
        print(f"version_{version}_right_share={share}  # {stating} of {lessons} lessons of revealing episodes; "
              f"guided success {success} ({guided} episodes); {version} CISPO steps before it; {len(parts)} runs")
    frozen_versions = [v for run in frozen for v in extractor_versions(run.run_dir)]
    lessons, stating = sum(v.lessons for v in frozen_versions), sum(v.stating for v in frozen_versions)
    guided, successes = sum(v.guided for v in frozen_versions), sum(v.successes for v in frozen_versions)
    print(f"frozen_right_share={stating / max(1, lessons):.3f}  # {stating} of {lessons}; guided success "
          f"{successes / max(1, guided):.3f} ({guided} episodes)")
    for index, run in enumerate(trained):
        for step in extractor_steps(run.run_dir):
            print(f"cispo_s{index}_step_{step.step}: reward_mean={sum(step.rewards) / len(step.rewards):+.3f} "
                  f"reward_var={step.reward_variance:.3f} loss={step.loss:+.4f} clip_fraction="
                  f"{step.clip_fraction if step.clip_fraction is not None else float('nan'):.3f}")
    gain = held_out_right_share_gain(trained, frozen, args.held_out, args.resamples)
    report("extractor_right_share_gain", gain, lambda e: e.value >= 0.25 and e.low > 0, check)
    guided_gain = arm_difference(trained, frozen, "r", "last", guided=True, resamples=args.resamples)
    if guided_gain is None:
        raise SystemExit("the extractor runs need an evaluation of the recurring corridors")
    report("extractor_guided_gain", guided_gain, None, False)


def signpost_report(runs: dict[str, list[RunOutcomes]], args: argparse.Namespace, check: bool) -> None:
    """The signpost experiment, every figure on the unseen corridors at the last evaluation: the kinds of lesson each
    extractor version wrote (per arm, pooled over seeds), then the trained extractor against the frozen one under a
    frozen actor, co-evolution against a static extractor, guided against free, what the actor internalised, and
    the three controls."""
    from pipeline.audit.learning import arm_difference, arm_ratio, guided_gap, lesson_kinds

    for arm_name in [a for a in ("extractor_trained", "extractor_frozen", "complementary", "static_extractor")
                     if a in runs]:
        pooled: dict[int, dict[str, int]] = {}
        for run in runs[arm_name]:
            for written in lesson_kinds(run.run_dir):
                counted = pooled.setdefault(written.version, {})
                for kind, count in written.counts.items():
                    counted[kind] = counted.get(kind, 0) + count
        for version, counts in sorted(pooled.items()):
            lessons = sum(counts.values())
            kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(counts.items()))
            print(f"rule_share_{arm_name}_v{version}={counts.get('rule', 0) / lessons:.3f}  # {lessons} lessons of "
                  f"revealing episodes: {kinds}")

    def need(name: str, estimate: Estimate | None) -> Estimate:
        if estimate is None:
            raise SystemExit(f"{name}: the signpost runs lack the unseen evaluations it compares")
        return estimate

    def ran(*arms: str) -> bool:
        """Whether every arm a figure compares ran (`--arms` runs some: the figures of those are printed)."""
        return all(arm in runs for arm in arms)

    if ran("extractor_trained", "extractor_frozen"):
        report("frozen_actor_extractor_gain", need("frozen_actor_extractor_gain", arm_difference(
            runs["extractor_trained"], runs["extractor_frozen"], "t", "last", guided=True, resamples=args.resamples)),
            lambda e: e.value >= 0.15 and e.low > 0, check)
    if ran("complementary", "static_extractor"):
        report("coevolution_vs_static", need("coevolution_vs_static", arm_ratio(
            runs["complementary"], runs["static_extractor"], "t", "last", guided=True, resamples=args.resamples)),
            lambda e: e.value >= 1.2 and e.low > 1, check)
    if ran("complementary"):
        report("unseen_guided_minus_free", need("unseen_guided_minus_free", guided_gap(
            runs["complementary"], "t", resamples=args.resamples)), lambda e: e.low >= 0.15, check)
    if ran("complementary", "grpo"):
        report("internalization", need("internalization", arm_difference(
            runs["complementary"], runs["grpo"], "t", "last", guided=False, resamples=args.resamples)), None, False)
    for control, goal in (("flipped_guided_minus_free", lambda e: e.high < 0), ("shuffled_unseen_gap", near_zero),
                          ("same_instance_unseen_gap", near_zero)):
        arm = control.removesuffix("_guided_minus_free").removesuffix("_unseen_gap")
        if ran(arm):
            report(control, need(control, guided_gap(runs[arm], "t", resamples=args.resamples)), goal, check)


def held_out_right_share_gain(trained: list[RunOutcomes], frozen: list[RunOutcomes], episodes: int,
                              resamples: int) -> Estimate:
    """Whether a lesson states what its episode revealed: the trained run's last extractor version minus the frozen
    run's version 0, each distilling the same held-out data episodes of unseen tasks with the same draws
    (`pipeline.rl.warm_gate.distil_held_out`), paired per episode; seeds, then episodes, resampled."""
    from pipeline.audit.stats import bootstrap
    from pipeline.models.checkpoints import load_checkpoint
    from pipeline.rl.versions import checkpoints_root, version_dir, versions_in
    from pipeline.rl.warm_gate import distil_held_out, held_out_episodes
    from pipeline.settings import Settings

    by_seed: dict[int, list[tuple[float, float]]] = {}
    for index, (run_trained, run_frozen) in enumerate(zip(trained, frozen, strict=True)):
        stated, last = [], []
        for run in (run_trained, run_frozen):
            settings = Settings(config=run.run_dir / "config.yaml")
            root = checkpoints_root(run.run_dir, "extractor")
            last.append(max(v for v in versions_in(root) if (version_dir(root, v) / "manifest.json").exists()))
            policy = load_checkpoint(version_dir(root, last[-1])).policy
            pool = held_out_episodes(settings.envs.tasks, settings.envs, settings.extractor_trainer.warm_start,
                                     episodes)
            stated.append([d.states_fact for d in distil_held_out(policy, pool, settings.extractor)])
        by_seed[index] = [(float(a), float(b)) for a, b in zip(*stated, strict=True)
                          if a is not None and b is not None]
        trained_share = sum(a for a, _ in by_seed[index]) / max(1, len(by_seed[index]))
        frozen_share = sum(b for _, b in by_seed[index]) / max(1, len(by_seed[index]))
        print(f"held_out_right_share_s{index}: trained={trained_share:.3f} (version {last[0]}) frozen="
              f"{frozen_share:.3f} (version {last[1]})  # {len(by_seed[index])} revealing held-out episodes")
    return bootstrap(by_seed, lambda units: sum(a - b for a, b in units) / len(units), resamples=resamples)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked, with `--quick`'s sizes applied, the runs' directory (`out`) and the warm-start
    cache resolved."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiments", nargs="+", default=list(EXPERIMENTS), choices=list(EXPERIMENTS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seed-base", type=int, default=0, help="The first seed: runs use seeds base..base+seeds-1.")
    parser.add_argument("--steps", type=int, default=None,
                        help="Steps per run (default: each experiment's: room and memory 10, extractor 24).")
    parser.add_argument("--eval-seed", type=int, default=0, help="Seeds the fixed pool of unseen eval tasks.")
    parser.add_argument("--eval-tasks", type=int, default=300, help="Room: unseen rooms per evaluation.")
    parser.add_argument("--eval-repeats", type=int, default=13,
                        help="Corridors: plays of each eval corridor per evaluation, guided and as many free.")
    parser.add_argument("--unseen-tasks", type=int, default=8, help="Corridors: unseen corridors reported beside.")
    parser.add_argument("--signpost-tasks", type=int, default=32,
                        help="Signpost: unseen corridors per evaluation (the only pool evaluated).")
    parser.add_argument("--signpost-repeats", type=int, default=4,
                        help="Signpost: plays of each unseen corridor per evaluation, guided and as many free.")
    parser.add_argument("--held-out", type=int, default=192,
                        help="Extractor: held-out data episodes of unseen corridors each extractor distils.")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None, help="Directory for the runs (default runs/learning-*).")
    parser.add_argument("--warm-start-cache", type=Path, default=None,
                        help="Warm-start cache of the runs (default: OUT/warm-start-cache, empty at the start).")
    parser.add_argument("--quick", action="store_true", help="One seed, 3 steps, small eval pools, no goals.")
    parser.add_argument("--arms", nargs="+", default=[], metavar="ARM",
                        help="Run only these arms (an ablation): their evaluations are printed, and on signpost "
                        "corridors the figures that compare only arms among them.")
    parser.add_argument("--set", action="append", default=[], metavar="CRL_KEY=VALUE",
                        help="A setting for every run (an ablation: CRL_ACTOR_TRAINER__AGGREGATION=...); repeatable.")
    parser.add_argument("--independent-draws", action="store_true",
                        help="Give each arm its own sampling seeds: the same tasks, other draws (no common random "
                        "numbers).")
    parser.add_argument("--deterministic", action="store_true",
                        help="Run every run in deterministic mode (scheduler.deterministic, lock step).")
    args = parser.parse_args(argv)
    for setting in args.set:
        if not setting.startswith("CRL_") or "=" not in setting:
            parser.error(f"--set takes CRL_KEY=VALUE, got {setting!r}")
    if args.quick:
        args.seeds, args.steps, args.eval_tasks, args.eval_repeats, args.unseen_tasks, args.held_out = \
            1, 3, 32, 2, 2, 32
        args.signpost_tasks, args.signpost_repeats = 8, 2
    args.out = args.out or ROOT / "runs" / f"learning-{time.strftime('%Y%m%d-%H%M%S')}"
    args.warm_start_cache = (args.warm_start_cache or args.out / "warm-start-cache").resolve()
    return args


def main() -> None:
    args = arguments()
    check = not args.quick and args.seeds >= 5
    out = args.out
    from pipeline.audit.learning import (
        arm_difference,
        eval_rise,
        guided_gap,
        load_outcomes,
        missed_gates,
        ratio_at_equal_env_steps,
        warm_start_gates,
    )
    from pipeline.envs.random_play import random_play
    from pipeline.envs.registry import task_pool
    from pipeline.settings import Settings

    seeds = range(args.seed_base, args.seed_base + args.seeds)
    print(f"seeds={seeds.start}-{seeds.stop - 1}")
    print(f"eval_seed={args.eval_seed}")
    print(f"common_random_numbers={'no' if args.independent_draws else 'yes'}")
    print(f"deterministic={'yes' if args.deterministic else 'no'}")
    print(f"warm_start_cache={args.warm_start_cache}")
    started = time.monotonic()
    for name in args.experiments:
        experiment = EXPERIMENTS[name]
        steps = args.steps or experiment.steps
        print(f"steps_{name}={steps}")
        settings = Settings(config=experiment.config)
        turns = settings.envs.tasks[0].max_turns or 30
        floor = random_play(experiment.env_id, settings.envs, max_turns=turns, rng_seed=args.eval_seed,
                            seeds=task_pool(experiment.env_id, "eval", 200, args.eval_seed))
        print(f"random_success_{name}={floor.rate:.4f}  # {floor.episodes} episodes at {turns} turns, 95% "
              f"{floor.interval()[0]:.3f}-{floor.interval()[1]:.3f}")
        runs: dict[str, list[RunOutcomes]] = {}
        for arm in [a for a in experiment.arms if not args.arms or a.name in args.arms]:
            runs[arm.name] = []
            gated = False  # a run of this arm has passed the gates of the warm starts every run of it loads
            for seed in seeds:
                run_dir = out / name / f"{arm.name}-s{seed}"
                if not (run_dir / "archive").exists():
                    run(experiment, arm, seed, args, run_dir, steps, gated)
                runs[arm.name].append(load_outcomes(run_dir))
                gated = gated or (bool(warm_start_gates(run_dir)) and not missed_gates(run_dir))
        missed = [f"{run.run_dir}: {line}" for arm_runs in runs.values() for run in arm_runs
                  for line in missed_gates(run.run_dir)]
        if missed:
            raise SystemExit("not scored: these runs' warm starts missed their gates (warm_start.gate), so their "
                             "figures would measure a broken start, not the method:\n" + "\n".join(missed))
        print_arms(runs, args.resamples)
        if args.arms and not experiment.signpost:
            continue  # an ablation of some arms: their evaluations only (signpost: the figures of the arms run)
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
        elif name == "extractor":
            extractor_report(runs, args, check)
        elif experiment.signpost:
            signpost_report(runs, args, check and experiment.goals)
        else:
            corridor_diagnostics([run.run_dir for run in runs["complementary"]])
            gap = guided_gap(runs["complementary"], "r", resamples=args.resamples)
            shuffled = guided_gap(runs["shuffled"], "r", resamples=args.resamples)
            if gap is None or shuffled is None:
                raise SystemExit("the memory runs need an evaluation of the recurring corridors")
            report("guided_minus_free", gap, lambda e: e.low >= 0.15, check)
            report("shuffled_experience_gap", shuffled, near_zero, check)
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
            free, _ = ratio_at_equal_env_steps(runs["complementary"], runs["grpo"], args.resamples, slots="free")
            report("complementary_vs_grpo_free", free, None, False)
            report_pair("complementary_minus_grpo_free_after", *(
                arm_difference(runs["complementary"], runs["grpo"], "r", "last", guided=False, paired=paired,
                               resamples=args.resamples) for paired in (True, False)))
    print(f"benchmark_s={time.monotonic() - started:.0f}")
    print(f"# runs in {out}")


if __name__ == "__main__":
    main()
