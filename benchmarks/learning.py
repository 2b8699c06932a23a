"""Does the complementary arm learn faster than GRPO at equal environment steps? (issue 6's learning benchmark)

    python benchmarks/learning.py                       # 4 arms x 3 seeds x 12 steps of the CPU default (~1.5 h)
    python benchmarks/learning.py --steps 12 --seeds 3  # what docs/benchmarks.md quotes
    python benchmarks/learning.py --quick               # complementary and grpo, 1 seed, 3 steps (~4 min)
    python benchmarks/learning.py --config configs/smol-minihack-room.yaml --arms complementary grpo exp_only \
        --seeds 1 --steps 6                             # SmolLM2 as actor and extractor (~1 h)

Every run is a real `crl run configs/tiny-minihack-room.yaml --arm ARM` (embedded broker, every worker as a
process), with `CRL_ENVS__SEED`, `CRL_ROLLOUT__GENERATION__SEED` and `CRL_EXTRACTOR__GENERATION__SEED` set to the
seed: the task
draws, the sampling and the warm starts change with it (a warm start's demonstrations are drawn with the task seed,
and its cache key holds the environment settings, so each seed's first run pays for its warm starts, later arms of
that seed reuse them). Runs go one after another (2 cores).

From each run's archive: per step, the train success and the cumulative environment steps (actions taken by train
episodes). Arms are compared at equal environment steps: the budget is the smallest total any run reached, and an
arm's success is that of its train episodes after the warm-up, in steps that started within the budget, pooled over
its seeds. Prints `success_<arm>=`, `eval_first_<arm>=` and `eval_success_<arm>=` (the first and the last
evaluation on the fixed eval pool, free and guided slots pooled, over seeds),
`env_steps_<arm>=`, `success_guided_<arm>=` / `success_free_<arm>=` (the same train episodes split by slot kind),
`parse_ok_<arm>=` / `parse_error_<arm>=` (the share of the extractor's generations whose answer produced ops, or was
rejected; the rest kept nothing), `complementary_vs_grpo=` and `complementary_vs_static_extractor=`, then the curves.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = ("complementary", "grpo", "static_extractor", "exp_only")
CONFIG = ROOT / "configs" / "tiny-minihack-room.yaml"


def run_arm(config: Path, arm: str, seed: int, steps: int, run_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "CRL_ENVS__SEED": str(seed), "CRL_ROLLOUT__GENERATION__SEED": str(seed),
                "CRL_EXTRACTOR__GENERATION__SEED": str(seed)})
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(config), "--arm", arm, "--steps",
                             str(steps), "--run-dir", str(run_dir), "--no-report"], env=env, cwd=ROOT,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed ({result.returncode}):\n{result.stdout[-3000:]}"
                         f"\n{result.stderr[-3000:]}")
    print(f"# {arm} seed {seed}: {time.monotonic() - started:.0f}s ({run_dir})", flush=True)


Point = tuple[int, int, int, int, int, int]  # step, cumulative env steps, successes, episodes, guided wins, guided


def curve(run_dir: Path) -> tuple[list[Point], tuple[int, int], tuple[int, int], dict[tuple[int, str], int]]:
    """Per train step (step, cumulative env steps, successes, episodes, guided successes, guided episodes), the first
    and the last evaluation (successes, episodes) on the fixed eval pool, and the extractor's generations per
    (extractor version, parse status)."""
    from pipeline.audit.views import Audit

    with Audit(run_dir) as audit:
        rows = audit.query("SELECT step, sum(num_actions), sum(success::INT), count(*), "
                           "sum((success AND guided)::INT), sum(guided::INT) FROM trajectories "
                           "WHERE split = 'train' GROUP BY step ORDER BY step")[1]
        evaluations = audit.query("SELECT step, sum(success::INT), count(*) FROM trajectories WHERE split = 'eval' "
                                  "GROUP BY step ORDER BY step")[1]
        statuses = audit.query("SELECT extractor_version, parse_status, count(*) FROM extraction_generated "
                               "GROUP BY ALL")[1]
    points, total = [], 0
    for step, actions, successes, episodes, guided_wins, guided in rows:
        total += int(actions)
        points.append((int(step), total, int(successes), int(episodes), int(guided_wins), int(guided)))
    first, last = (evaluations[0], evaluations[-1]) if evaluations else ((None, 0, 0), (None, 0, 0))
    return points, (int(first[1]), int(first[2])), (int(last[1]), int(last[2])), {
        (int(version), status): int(count) for version, status, count in statuses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG, help="The run config every arm uses (default: tiny).")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--out", type=Path, default=None, help="Directory for the runs (default runs/learning-*).")
    parser.add_argument("--quick", action="store_true", help="complementary and grpo, 1 seed, 3 steps.")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds, args.arms = 3, 1, ["complementary", "grpo"]
    out = args.out or ROOT / "runs" / f"learning-{time.strftime('%Y%m%d-%H%M%S')}"
    from pipeline.settings import Settings

    warmup = Settings(config=args.config).actor_trainer.warmup_steps
    curves: dict[str, list] = {arm: [] for arm in args.arms}
    parse: dict[str, dict[tuple[int, str], int]] = {arm: {} for arm in args.arms}
    first_evals: dict[str, list[tuple[int, int]]] = {arm: [] for arm in args.arms}
    evals: dict[str, list[tuple[int, int]]] = {arm: [] for arm in args.arms}
    for seed in range(args.seeds):
        for arm in args.arms:
            run_dir = out / f"{arm}-s{seed}"
            if not (run_dir / "archive").exists():
                run_arm(args.config, arm, seed, args.steps, run_dir)
            points, first, last, statuses = curve(run_dir)
            for key, count in statuses.items():
                parse[arm][key] = parse[arm].get(key, 0) + count
            curves[arm].append(points)
            first_evals[arm].append(first)
            evals[arm].append(last)
    budget = min(points[-1][1] for runs in curves.values() for points in runs)
    print(f"config={args.config.name}")
    print(f"steps={args.steps}")
    print(f"seeds={args.seeds}")
    print(f"env_step_budget={budget}")
    success: dict[str, float] = {}
    for arm in args.arms:
        wins = episodes = guided_wins = guided = 0
        for points in curves[arm]:
            before = 0
            for step, env_steps, successes, count, step_guided_wins, step_guided in points:
                if step >= warmup and before < budget:
                    wins, episodes = wins + successes, episodes + count
                    guided_wins, guided = guided_wins + step_guided_wins, guided + step_guided
                before = env_steps
        success[arm] = wins / episodes if episodes else float("nan")
        print(f"success_{arm}={success[arm]:.4f}")
        if guided:
            print(f"success_guided_{arm}={guided_wins / guided:.4f}")
            free = episodes - guided
            print(f"success_free_{arm}={(wins - guided_wins) / free if free else float('nan'):.4f}")
        generations = sum(parse[arm].values())
        if generations:
            for status in ("ok", "parse_error"):
                count = sum(n for (_, kind), n in parse[arm].items() if kind == status)
                print(f"parse_{status}_{arm}={count / generations:.4f}")
            print(f"generations_{arm}={generations}")
        for name, table in (("eval_first", first_evals), ("eval_success", evals)):
            wins, count = map(sum, zip(*table[arm], strict=True))
            print(f"{name}_{arm}={wins / count if count else float('nan'):.4f}")
        print(f"env_steps_{arm}={sum(points[-1][1] for points in curves[arm]) / len(curves[arm]):.0f}")
    for other in ("grpo", "static_extractor"):
        if "complementary" in success and other in success and success[other] > 0:
            print(f"complementary_vs_{other}={success['complementary'] / success[other]:.4f}")
    print("# success per step (pooled over seeds), with mean cumulative env steps")
    for arm in args.arms:
        cells = []
        for index in range(min(len(points) for points in curves[arm])):
            rows = [points[index] for points in curves[arm]]
            env_steps = sum(r[1] for r in rows) / len(rows)
            cells.append(f"s{rows[0][0]}:{sum(r[2] for r in rows) / sum(r[3] for r in rows):.2f}@{env_steps:.0f}")
        print(f"# {arm:17s} " + " ".join(cells))
    print("# extractor answers that produced ops / all, per extractor version (pooled over seeds)")
    for arm in args.arms:
        versions = sorted({version for version, _ in parse[arm]})
        if versions:
            cells = [f"v{v}:{parse[arm].get((v, 'ok'), 0)}/{sum(n for (w, _), n in parse[arm].items() if w == v)}"
                     for v in versions]
            print(f"# {arm:17s} " + " ".join(cells))
    print(f"# runs in {out}; compare them with: crl report {' '.join(str(out / f'{a}-s0') for a in args.arms)} "
          f"--out {out / 'report'}")


if __name__ == "__main__":
    main()
