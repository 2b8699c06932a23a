"""Does the loop go faster when rollouts may run ahead of training? The default config at scheduler staleness 0, 1
and 2, side by side: throughput after the warm starts, what each worker kind waited for, and what each run learnt.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/loop_throughput.py            # 12 steps per run
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/loop_throughput.py --quick    # 6 steps, 50 eval rooms per run
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/loop_throughput.py --staleness 0 1 --keep
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/loop_throughput.py --quick --staleness 0 --rollout-workers 1 2
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/loop_throughput.py --staleness 0 --modes async deterministic

Every run is a real `crl run configs/tiny-minihack-room.yaml --no-report` (embedded Tansu, every worker a process),
one after another, each in a fresh run directory under a temporary directory (removed at the end unless `--keep`);
with `--out DIR` the runs go to DIR/staleness<k> and are kept, and a run directory there that already holds an
archive is read instead of run again (its `run_s` is not printed). The runs differ only in
`CRL_SCHEDULER__STALENESS` (step s is issued once the actor has trained every step up to s - 1 - staleness) and
`CRL_SCHEDULER__MAX_STEPS_AHEAD`, set to max(1, staleness) unless `--max-steps-ahead` pins it: at the config's 1,
staleness 2 would still wait for every episode of step s - 2, so it could hardly run further ahead than staleness 1.
Same steps, same seeds (`--seed`: `CRL_ENVS__SEED` and both sampling seeds), so every setting plays the same task
draws and evaluates on the same rooms. Every run writes its workers' metrics lines every second
(`CRL_RUNNER__METRICS_INTERVAL_S=1`, default 10 s) so that the wait shares can be cut at the window's edges; nothing
else is changed. `--set CRL_KEY=VALUE` adds a setting to every run. The runs execute the working tree as it is when
each starts: `code=` prints the commit and a hash of the uncommitted changes to the code, one per distinct state,
and says so when they differ (an edit between runs would make the settings differ in more than staleness).

The window: from the later of the two version-0 `PolicyPublished` events (both warm starts done, cached or not; no
episode can be played before the actor's version 0) to the last `TrajectoryCompleted`, all read from the run's
archive (`crl audit sql` views). The drain after the run and the start-up before it are outside it.

Prints `name=value` lines (`# ...` after a value: what it was computed over, or its interval). First `config=`,
`steps=` and `seed=`, then, as each run ends, a `# staleness <k>: crl run took ...` line with its run directory; once
every run is in, `code=` (above), then per setting `staleness<k>_` ...:
- `max_steps_ahead`: what the run's scheduler used;
- `run_s`: wall time of the whole `crl run` (broker, warm starts or their cache, drain, stop);
- `startup_s`: from `RunStarted` to the window's start (the warm starts, or loading them from their cache);
- `window_s`: the window's length;
- `episodes`, `env_steps`: every episode finished in the window, train and eval (the evaluations are the same work in
  every setting), and their environment steps (actions);
- `episodes_per_s`, `env_steps_per_s`: those over `window_s`;
- `train_episodes_per_s`: the train episodes alone over `window_s`;
- `wait_share_<kind>`: for each worker kind, the share of the window its processes spent waiting for input (the
  runner's `wait_seconds`: time in input polls while the worker was not busy; a poll blocks until records arrive or
  its timeout passes), summed over the kind's instances over instances x `window_s`, from the cumulative counter in
  `RUN_DIR/metrics/<instance>.jsonl` interpolated linearly at the window's edges (a worker with no line before the
  window's start counts from 0 there: the trainers start polling only after their warm start);
- `policy_lag`: the mean of (step - warmup steps) - policy version over the train episodes after the warm-up: how
  many actor updates the policy that played an episode was behind on-policy (0 at staleness 0).
Then `async_speedup_staleness1=` and `async_speedup_staleness2=` (`episodes_per_s` over staleness 0's; goal >= 1.3
for staleness 1, `async_speedup_staleness1_goal=met|missed` except with `--quick`), each followed by
`async_env_steps_speedup_staleness<k>=` (the same for `env_steps_per_s`: solved episodes are shorter, so the two can
differ when the settings learn differently).

With `--modes async deterministic` every staleness runs in the default asynchronous mode and in deterministic mode
(`scheduler.deterministic`, which needs staleness 0 and runs at max_steps_ahead 0); the deterministic figures' prefix
gains `_deterministic` and `deterministic_cost_staleness0=` is the asynchronous run's `episodes_per_s` over the
deterministic one's (how many times longer the same work takes in lock step), `deterministic_window_ratio=` the
windows' ratio.

Then the learning figures, one line per setting under each heading so the trade is visible:
- `staleness<k>_train_success`: success of the train episodes of the last `--last-steps` steps (default: the last
  third), guided and free together; `_train_success_after_warmup`: every train episode after the warm-up;
- `staleness<k>_eval_<guided|free>_before` / `_after`: success on the fixed pool of unseen rooms at the first
  evaluation (step 0: the starting policy, an empty bank) and at the last one (after the last step), and
  `_eval_<guided|free>_rise`: after minus before paired per room (`pipeline.audit.learning.arm_table`; each with its
  95% bootstrap interval over rooms after `#`);
- `staleness<k>_actor_train_steps`, `_bank_size`: actor updates and active experiences at the end (the run report's
  summary row).
With `--rollout-workers 1 2` every staleness runs with one and with two rollout worker processes (one consumer group,
`launch.rollout_workers`); the figures' prefix gains `_rollout<n>` and `rollout_workers_speedup_staleness<k>_<n>=`
prints episodes/s with n workers over the first count's, at the same staleness.
Last, `# runs in DIR` when the runs are kept, and `benchmark_s=` (the whole benchmark's wall time).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "tiny-minihack-room.yaml"
GOAL = 1.3
"""`async_speedup_staleness1` goal, fixed before the first full run."""
KINDS = ("rollout", "extractor", "actor_trainer", "extractor_trainer", "bank", "scheduler", "archiver")
"""The kinds a complementary run starts, in the order printed; any other kind found in metrics/ follows them."""


@dataclass
class Setting:
    staleness: int
    max_steps_ahead: int
    run_dir: Path
    rollout_workers: int = 1
    deterministic: bool = False
    label: str = ""
    """The prefix of its figures: `staleness<k>`, with `_rollout<n>` when several worker counts run."""
    run_s: float = 0.0
    code: str = ""
    """`code_state()` when the run started."""
    figures: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    """Comments printed after a figure's value (`# ...`)."""


def code_state() -> str:
    """The commit and a hash of the uncommitted changes to the code a run executes (`git diff HEAD`)."""
    def git(*command: str) -> str:
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True).stdout

    diff = git("diff", "HEAD", "--", "schemas", "infra", "pipeline", "workers", "configs")
    return git("rev-parse", "--short", "HEAD").strip() + (f"+{hashlib.sha256(diff.encode()).hexdigest()[:8]}"
                                                         if diff else "")


def run(setting: Setting, args: argparse.Namespace) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({
        "HF_HUB_OFFLINE": "1",
        "CRL_SCHEDULER__STALENESS": str(setting.staleness),
        "CRL_SCHEDULER__MAX_STEPS_AHEAD": str(setting.max_steps_ahead),
        "CRL_ENVS__SEED": str(args.seed), "CRL_ROLLOUT__GENERATION__SEED": str(args.seed),
        "CRL_EXTRACTOR__GENERATION__SEED": str(args.seed),
        "CRL_RUNNER__METRICS_INTERVAL_S": "1",
        "CRL_LAUNCH__ROLLOUT_WORKERS": str(setting.rollout_workers),
        "CRL_SCHEDULER__DETERMINISTIC": str(setting.deterministic).lower(),
    })
    if args.eval_tasks is not None:
        env["CRL_ENVS__EVAL_TASKS_PER_ENV"] = str(args.eval_tasks)
    env.update(dict(item.split("=", 1) for item in args.set))
    setting.code = code_state()
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(args.config), "--steps",
                             str(args.steps), "--run-dir", str(setting.run_dir), "--no-report"],
                            env=env, cwd=ROOT, capture_output=True, text=True)
    setting.run_s = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"{setting.label} failed ({result.returncode}) in {setting.run_dir}:\n"
                         f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(f"# {setting.label}: crl run took {setting.run_s:.0f}s ({setting.run_dir})", flush=True)


def _epoch(value: datetime) -> float:
    return value.timestamp()


def cumulative_at(points: list[tuple[float, float]], at: float) -> float:
    """A cumulative counter sampled at `points` (time, value; sorted) at time `at`: linear between samples, 0 before
    the first, the last value after the last."""
    if not points or at <= points[0][0]:
        return 0.0
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        if at <= t1:
            return v0 + (v1 - v0) * (at - t0) / (t1 - t0) if t1 > t0 else v1
    return points[-1][1]


def wait_series(path: Path) -> tuple[str, list[tuple[float, float]]]:
    """A metrics file's worker kind and its cumulative `wait_seconds` by time, carried across restarts (a restarted
    worker appends to the same file, its counter from 0 again)."""
    kind = path.stem.rsplit("-", 1)[0]
    points: list[tuple[float, float]] = []
    carried = last = 0.0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed worker
        if "wait_seconds" not in row:
            raise SystemExit(f"{path} has no wait_seconds: the runner that wrote it predates them")
        kind = str(row.get("worker", kind))
        value = float(row["wait_seconds"])
        if value < last:
            carried += last
        last = value
        points.append((float(row["t"]), carried + value))
    return kind, sorted(points)


def measure(setting: Setting, last_steps: int | None) -> None:
    """Read the run's archive and metrics into `setting.figures`."""
    from pipeline.audit.learning import arm_table, load_outcomes
    from pipeline.audit.report import load_run
    from pipeline.audit.views import Audit

    figures, notes = setting.figures, setting.notes
    with Audit(setting.run_dir) as audit:
        versions = dict(audit.query("SELECT role, min(occurred_at) FROM policy_published WHERE version = 0 "
                                    "GROUP BY role")[1])
        if set(versions) != {"actor", "extractor"}:
            raise SystemExit(f"{setting.run_dir}: no version 0 of {sorted({'actor', 'extractor'} - set(versions))}")
        start = max(_epoch(v) for v in versions.values())
        run_started = _epoch(audit.query("SELECT min(occurred_at) FROM run_started")[1][0][0])
        rows = audit.query("SELECT epoch_ms(occurred_at) / 1000.0, split, num_actions FROM trajectories")[1]
        config = json.loads(audit.query("SELECT config FROM run_started ORDER BY occurred_at LIMIT 1")[1][0][0])
        warmup = int(config["actor_trainer"]["warmup_steps"])
        figures["max_steps_ahead"] = config["scheduler"]["max_steps_ahead"]
        if config["scheduler"]["staleness"] != setting.staleness:
            raise SystemExit(f"{setting.run_dir} ran at staleness {config['scheduler']['staleness']}")
        lag = audit.query("SELECT avg((step - ?) - policy_version), max((step - ?) - policy_version) "
                          "FROM trajectories WHERE split = 'train' AND step >= ?", [warmup, warmup, warmup])[1][0]
        steps = audit.query("SELECT max(step) FROM trajectories WHERE split = 'train'")[1][0][0]
        first = max(warmup, steps + 1 - (last_steps or max(1, (steps + 1) // 3)))
        train_last = audit.query("SELECT avg(success::INTEGER), count(*) FROM trajectories "
                                 "WHERE split = 'train' AND step >= ?", [first])[1][0]
        train_after = audit.query("SELECT avg(success::INTEGER), count(*) FROM trajectories "
                                  "WHERE split = 'train' AND step >= ?", [warmup])[1][0]
    inside = [(t, split, actions) for t, split, actions in rows if t >= start]
    if not inside:
        raise SystemExit(f"{setting.run_dir}: no episode finished after both versions 0")
    end = max(t for t, _, _ in inside)
    window = end - start
    figures["startup_s"] = start - run_started
    figures["window_s"] = window
    figures["episodes"] = len(inside)
    figures["env_steps"] = sum(int(actions) for _, _, actions in inside)
    figures["episodes_per_s"] = len(inside) / window
    figures["env_steps_per_s"] = figures["env_steps"] / window
    figures["train_episodes_per_s"] = sum(split == "train" for _, split, _ in inside) / window
    if len(inside) < len(rows):
        notes["episodes"] = f"{len(rows) - len(inside)} finished before the window's start, not counted"

    waited: dict[str, list[float]] = {}
    for path in sorted((setting.run_dir / "metrics").glob("*.jsonl")):
        kind, points = wait_series(path)
        waited.setdefault(kind, []).append(cumulative_at(points, end) - cumulative_at(points, start))
    for kind in [k for k in KINDS if k in waited] + sorted(set(waited) - set(KINDS)):
        figures[f"wait_share_{kind}"] = sum(waited[kind]) / (len(waited[kind]) * window)
        if len(waited[kind]) > 1:
            notes[f"wait_share_{kind}"] = f"{len(waited[kind])} instances"
    figures["policy_lag"] = float(lag[0] or 0.0)
    notes["policy_lag"] = f"max {lag[1]}"

    figures["train_success"] = float(train_last[0])
    notes["train_success"] = f"steps {first}-{steps}, {train_last[1]} episodes"
    figures["train_success_after_warmup"] = float(train_after[0])
    notes["train_success_after_warmup"] = f"steps {warmup}-{steps}, {train_after[1]} episodes"
    for row in arm_table([load_outcomes(setting.run_dir)]):
        if row.pool != "unseen":
            continue
        for when, estimate in (("before", row.before), ("after", row.after), ("rise", row.rise)):
            if estimate is not None:
                figures[f"eval_{row.kind}_{when}"] = estimate.value
                notes[f"eval_{row.kind}_{when}"] = f"95% [{estimate.low:.3f}, {estimate.high:.3f}], {row.tasks} rooms"
    summary = load_run(setting.run_dir).summary
    figures["actor_train_steps"] = summary.actor_train_steps
    figures["bank_size"] = summary.bank_size


def show(name: str, value: float, note: str | None = None) -> None:
    text = str(value) if isinstance(value, int) else f"{value:.3f}"
    print(f"{name}={text}" + (f"  # {note}" if note else ""))


THROUGHPUT = ("max_steps_ahead", "run_s", "startup_s", "window_s", "episodes", "env_steps", "episodes_per_s",
              "env_steps_per_s", "train_episodes_per_s")
LEARNING = ("train_success", "train_success_after_warmup", "eval_guided_before", "eval_guided_after",
            "eval_guided_rise", "eval_free_before", "eval_free_after", "eval_free_rise", "actor_train_steps",
            "bank_size")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="6 steps and 50 eval rooms per run (three runs in about 10 minutes on 2 cores); no goal")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="Settings to run (0 first).")
    parser.add_argument("--rollout-workers", type=int, nargs="+", default=[1],
                        help="Rollout worker processes of each run (launch.rollout_workers); with several, every "
                        "staleness runs with each (e.g. --staleness 0 --rollout-workers 1 2).")
    parser.add_argument("--modes", nargs="+", default=["async"], choices=["async", "deterministic"],
                        help="Run each setting in these modes (deterministic: scheduler.deterministic, staleness 0).")
    parser.add_argument("--steps", type=int, default=None, help="Steps per run (default: the config's 12; quick 6).")
    parser.add_argument("--max-steps-ahead", type=int, default=None,
                        help="scheduler.max_steps_ahead of every run (default: max(1, staleness)).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-tasks", type=int, default=None,
                        help="Unseen eval rooms per evaluation (default: the config's 100; quick 50).")
    parser.add_argument("--last-steps", type=int, default=None,
                        help="Train success over this many last steps (default: a third of the steps, at least 1).")
    parser.add_argument("--out", type=Path, default=None, help="Directory for the runs, kept (default: a temporary "
                        "directory, removed at the end unless --keep).")
    parser.add_argument("--keep", action="store_true", help="Keep the temporary directory with the runs.")
    parser.add_argument("--config", type=Path, default=CONFIG, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], metavar="CRL_KEY=VALUE",
                        help="A setting for every run; repeatable.")
    args = parser.parse_args()
    for item in args.set:
        if not item.startswith("CRL_") or "=" not in item:
            parser.error(f"--set takes CRL_KEY=VALUE, got {item!r}")
    if sorted(set(args.staleness)) != sorted(args.staleness) or min(args.staleness) < 0:
        parser.error("--staleness takes distinct values >= 0, in increasing order")
    if args.steps is None:
        from pipeline.settings import Settings

        args.steps = 6 if args.quick else Settings(config=args.config).scheduler.steps
    if args.quick and args.eval_tasks is None:
        args.eval_tasks = 50

    out = args.out or Path(tempfile.mkdtemp(prefix="loop-throughput-"))
    several = len(args.rollout_workers) > 1 or args.rollout_workers != [1]
    settings = []
    if "deterministic" in args.modes and any(k > 0 for k in args.staleness):
        parser.error("deterministic mode runs at staleness 0 only: --staleness 0 --modes async deterministic")
    for k, workers, mode in itertools.product(args.staleness, args.rollout_workers, args.modes):
        label = f"staleness{k}" + (f"_rollout{workers}" if several else "") + \
            ("_deterministic" if mode == "deterministic" else "")
        ahead = 0 if mode == "deterministic" else \
            args.max_steps_ahead if args.max_steps_ahead is not None else max(1, k)
        settings.append(Setting(k, ahead, out / label, workers, mode == "deterministic", label))
    for setting in settings:
        if setting.run_dir.exists() and not (setting.run_dir / "archive").is_dir():
            parser.error(f"{setting.run_dir} exists without an archive: a run needs a fresh directory")
    print(f"config={args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config}")
    print(f"steps={args.steps}")
    print(f"seed={args.seed}")
    started = time.monotonic()
    try:
        for setting in settings:
            if setting.run_dir.exists():
                setting.code = "earlier-run"
                print(f"# {setting.label}: read from the earlier run in {setting.run_dir}", flush=True)
            else:
                run(setting, args)
                setting.figures["run_s"] = setting.run_s
            measure(setting, args.last_steps)
        codes = sorted({s.code for s in settings})
        print(f"code={' '.join(codes)}" + ("  # the code changed between the runs: their figures do not compare"
                                          if len(codes) > 1 else ""))
        for setting in settings:
            prefix = f"{setting.label}_"
            for name in [n for n in THROUGHPUT if n in setting.figures]:
                show(prefix + name, setting.figures[name], setting.notes.get(name))
            for name in [n for n in setting.figures if n.startswith("wait_share_")] + ["policy_lag"]:
                show(prefix + name, setting.figures[name], setting.notes.get(name))
        for fixed in [s for s in settings if s.deterministic]:
            free = next(s for s in settings if not s.deterministic and s.staleness == fixed.staleness
                        and s.rollout_workers == fixed.rollout_workers) if "async" in args.modes else None
            if free is not None:
                suffix = f"_rollout{fixed.rollout_workers}" if several else ""
                show(f"deterministic_cost_staleness{fixed.staleness}{suffix}",
                     free.figures["episodes_per_s"] / fixed.figures["episodes_per_s"],
                     "asynchronous episodes/s over deterministic")
                show(f"deterministic_window_ratio{suffix}", fixed.figures["window_s"] / free.figures["window_s"])
        base = next((s for s in settings if s.staleness == 0 and s.rollout_workers == args.rollout_workers[0]
                     and not s.deterministic), None)
        if base is not None and len(args.staleness) > 1:
            for setting in settings:
                if setting.rollout_workers != base.rollout_workers or setting is base or setting.deterministic:
                    continue
                speedup = setting.figures["episodes_per_s"] / base.figures["episodes_per_s"]
                show(f"async_speedup_staleness{setting.staleness}", speedup)
                if setting.staleness == 1 and not args.quick:
                    print(f"async_speedup_staleness1_goal={'met' if speedup >= GOAL else 'missed'} (>= {GOAL})")
                show(f"async_env_steps_speedup_staleness{setting.staleness}",
                     setting.figures["env_steps_per_s"] / base.figures["env_steps_per_s"])
        for first in [s for s in settings if s.rollout_workers == args.rollout_workers[0]]:
            for setting in settings:
                if setting.staleness == first.staleness and setting is not first \
                        and setting.deterministic == first.deterministic:
                    show(f"rollout_workers_speedup_staleness{setting.staleness}_{setting.rollout_workers}",
                         setting.figures["episodes_per_s"] / first.figures["episodes_per_s"],
                         f"episodes/s with {setting.rollout_workers} rollout workers over {first.rollout_workers}")
        for name in LEARNING:
            for setting in settings:
                if name in setting.figures:
                    show(f"{setting.label}_{name}", setting.figures[name], setting.notes.get(name))
    finally:
        if args.out is None and not args.keep:
            shutil.rmtree(out, ignore_errors=True)
        else:
            print(f"# runs in {out}")
    print(f"benchmark_s={time.monotonic() - started:.0f}")


if __name__ == "__main__":
    main()
