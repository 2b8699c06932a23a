"""Kill workers and the broker at random points of short `crl run`s and check that nothing was lost or doubled
(issue 16's chaos benchmark).

    python benchmarks/chaos.py --quick                               # 3 runs
    python benchmarks/chaos.py --runs 20 --seed 7                    # what docs/benchmarks.md quotes
    python benchmarks/chaos.py --runs 6 --seed 3 --broker tansu      # the default broker, memory only

Each run is a real `crl run configs/tiny-minihack-room.yaml --steps N --broker kafka` (the embedded Apache Kafka,
whose log stays in the run directory, so the bank can be replayed from Kafka afterwards) or, with `--broker tansu`,
on the memory-only Tansu, whose killed broker is resumed from the log restored out of the archive (and the bank is
replayed from a log restored the same way after the run). A seeded schedule SIGKILLs
one to three workers of any kind (scheduler, rollout, extractor, bank, either trainer, archiver) or the broker at
random moments; `crl run` restarts a worker that dies before the run is over, and a run whose broker was killed
stops and is continued with `crl run --resume`. After each run, from the archive, the SQL store, the checkpoints and
the Kafka log:

- every `EpisodeAssigned` has exactly one trajectory (re-deliveries of the same event id count once);
- actor and extractor versions are 0..N, each published by one event, with no gap;
- each train step holds each event once in its batch, and each (role, step) trained once;
- the live bank hash equals `crl replay bank` from the archive, from Kafka and at every snapshot;
- `crl replay train` reproduces every weight hash of both roles;
- no dead letter was written (a kill is not bad input).

Prints per run what was killed when and each check, then `runs=`, `kills=`, `violations=`; exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "tiny-minihack-room.yaml"
KINDS = ("scheduler", "rollout", "extractor", "bank", "actor_trainer", "extractor_trainer", "archiver", "broker")


@dataclass
class Kill:
    at_s: float
    kind: str
    done: str = "not reached (the run ended first)"


@dataclass
class Outcome:
    kills: list[Kill]
    exit_code: int
    seconds: float
    checks: dict[str, str] = field(default_factory=dict)
    """check name -> "" when it held, else what was wrong."""

    @property
    def violations(self) -> list[str]:
        return [f"{name}: {problem}" for name, problem in self.checks.items() if problem]


def schedule(rng: random.Random, horizon_s: float, kinds: tuple[str, ...] = KINDS) -> list[Kill]:
    """One to three kills of random kinds at random moments within the run's expected length; the broker at most
    once, last (the run stops with it)."""
    kills = sorted((Kill(round(rng.uniform(8.0, horizon_s), 1), rng.choice(kinds)) for _ in range(rng.randint(1, 3))),
                   key=lambda kill: kill.at_s)
    broker = [kill for kill in kills if kill.kind == "broker"]
    return [kill for kill in kills if kill.kind != "broker"] + broker[-1:]


def kill_on_schedule(run_dir: Path, process: subprocess.Popen, kills: list[Kill], started: float) -> None:
    for kill in kills:
        while time.monotonic() - started < kill.at_s:
            if process.poll() is not None:
                return
            time.sleep(0.1)
        try:
            if kill.kind == "broker":
                table = {"broker": {"kind": "broker", "pid": json.loads((run_dir / "broker.json").read_text())["pid"]}}
            else:
                table = json.loads((run_dir / "workers.json").read_text())
        except (OSError, ValueError):
            kill.done = "no worker table yet"
            continue
        pids = [(name, row["pid"]) for name, row in table.items() if row["kind"] == kill.kind and row["pid"]]
        if not pids:
            kill.done = "no such worker in this run"
            continue
        name, pid = pids[0]
        try:
            os.kill(pid, signal.SIGKILL)
            kill.done = f"SIGKILL {name} (pid {pid}) at {time.monotonic() - started:.1f}s"
        except ProcessLookupError:
            kill.done = f"{name} had already exited"


def run_once(run_dir: Path, steps: int, seed: int, kills: list[Kill], timeout_s: float, broker: str) -> Outcome:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    # The sampling changes from run to run; the task draws do not (the warm starts are cached per environment
    # settings, so a new task seed would recompute them in every run).
    env.update({"HF_HUB_OFFLINE": "1", "CRL_ROLLOUT__GENERATION__SEED": str(seed),
                "CRL_EXTRACTOR__GENERATION__SEED": str(seed)})
    log = (run_dir.parent / f"{run_dir.name}.out").open("wb")
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(CONFIG), "--steps", str(steps),
                                "--run-dir", str(run_dir), "--broker", broker, "--no-report"], env=env, cwd=ROOT,
                               stdout=log, stderr=subprocess.STDOUT)
    killer = threading.Thread(target=kill_on_schedule, args=(run_dir, process, kills, started), daemon=True)
    killer.start()
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=120)
    killer.join(timeout=5)
    if code != 0 and any(kill.kind == "broker" and kill.done.startswith("SIGKILL") for kill in kills):
        resumed = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "--resume", str(run_dir),
                                  "--no-report"], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 timeout=timeout_s)
        kills.append(Kill(round(time.monotonic() - started, 1), "resume",
                          f"crl run --resume exited {resumed.returncode}"))
        code = resumed.returncode
    log.close()
    return Outcome(kills, code, time.monotonic() - started)


def check(run_dir: Path, outcome: Outcome, broker: str) -> None:
    from pipeline.audit.views import Audit

    checks = outcome.checks
    checks["run completed"] = "" if outcome.exit_code == 0 else f"crl run exited with {outcome.exit_code}"
    with Audit(run_dir) as audit:
        q = lambda sql: audit.query(sql)[1]  # noqa: E731
        missing = q("SELECT count(*) FROM episode_assigned a WHERE NOT EXISTS (SELECT 1 FROM trajectory_completed t "
                    "WHERE t.assignment_event_id = a.event_id::VARCHAR)")[0][0]
        doubled = q("SELECT count(*) FROM (SELECT assignment_event_id FROM trajectory_completed GROUP BY ALL "
                    "HAVING count(*) > 1)")[0][0]
        assigned = q("SELECT count(*) FROM episode_assigned")[0][0]
        checks["every assignment has one trajectory"] = "" if not missing and not doubled else (
            f"{missing} of {assigned} without a trajectory, {doubled} with more than one")
        problems = []
        for role, versions, events in q("SELECT role, list(DISTINCT version ORDER BY version), count(*) "
                                        "FROM policy_published GROUP BY role"):
            if list(versions) != list(range(len(versions))) or events != len(versions):
                problems.append(f"{role}: versions {list(versions)} in {events} events")
        checks["versions 0..N, each once"] = "; ".join(problems)
        problems = []
        for role, step, batch in q("SELECT role, step, batch_event_ids FROM train_step_completed"):
            ids = json.loads(batch) if isinstance(batch, str) else list(batch)
            if len(ids) != len(set(ids)):
                problems.append(f"{role} step {step}: {len(ids) - len(set(ids))} events twice in its batch")
        for role, step, count in q("SELECT role, step, count(*) FROM train_step_completed GROUP BY ALL "
                                   "HAVING count(*) > 1"):
            problems.append(f"{role} step {step} trained {count} times")
        checks["each batch holds each event once"] = "; ".join(problems)
        letters = q("SELECT count(*), list(DISTINCT error_class) FROM dead_letter")[0]
        checks["no dead letter"] = "" if not letters[0] else f"{letters[0]} dead letters: {letters[1]}"
    checks.update(bank_checks(run_dir, broker))
    checks.update(training_checks(run_dir))


def bank_checks(run_dir: Path, broker_kind: str) -> dict[str, str]:
    from infra.admin import create_topics
    from infra.broker import BrokerSettings, embedded_broker
    from infra.db import DbSettings, database_url, make_engine
    from infra.kafka import KafkaSettings, make_admin
    from pipeline.audit.bank_replay import archived_run_id, ops_from_archive, replay_bank
    from pipeline.bank.replay import Checkpoint, replay
    from pipeline.bank.snapshots import read_manifest, read_snapshot, snapshot_dirs, snapshots_root
    from pipeline.bank.store import BankStore
    from pipeline.run.restore import restore_log

    store = BankStore(make_engine(database_url(DbSettings(), run_dir)))
    results = {}
    try:
        archive = replay_bank(run_dir, store)
        results["bank = replay from the archive"] = "; ".join(archive.problems)
        live = store.position("crl.experience-ops", 0)
        snapshots = [(path, read_manifest(path)) for path in snapshot_dirs(snapshots_root(run_dir))]
        checkpoints = [Checkpoint(f"snapshot {path.name}", manifest.next_offset, read_snapshot(path)[0].state_hash())
                       for path, manifest in snapshots if live is not None and manifest.log_id == live.log_id]
        replayed = replay(ops_from_archive(run_dir, live.log_id), checkpoints, run_id=archived_run_id(run_dir)) \
            if live is not None else None
        results["every snapshot = replay"] = "; ".join(replayed.mismatches(checkpoints)) if replayed else \
            "no live bank position"
    except Exception as exc:  # noqa: BLE001 - a check that cannot run is a violation, named
        results["bank = replay from the archive"] = f"{type(exc).__name__}: {exc}"
    # Apache Kafka's log is in the run directory; Tansu's ended with the run, so its log is restored from the
    # archive into a fresh Tansu, as `crl run --resume` does, and the bank replayed from that.
    broker = embedded_broker(BrokerSettings(kind=broker_kind), data_dir=run_dir / "kafka",
                             log_path=run_dir / "logs" / "broker-check.log")
    try:
        broker.start()
        kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers)
        if broker_kind == "tansu":
            admin = make_admin(kafka, client_id="chaos-check")
            try:
                create_topics(admin)
            finally:
                admin.close()
            restored = restore_log(run_dir, kafka, store.engine, carry_over=False)
            kafka = kafka.model_copy(update={"log_aliases": restored.aliases})
        from_kafka = replay_bank(run_dir, store, kafka)
        results["bank = replay from Kafka"] = "; ".join(from_kafka.problems)
    except Exception as exc:  # noqa: BLE001 - a check that cannot run is a violation, named
        results["bank = replay from Kafka"] = f"{type(exc).__name__}: {exc}"
    finally:
        broker.stop()
    return results


def training_checks(run_dir: Path) -> dict[str, str]:
    from pipeline.audit.training_replay import replay_training

    problems = []
    for role in ("actor", "extractor"):
        try:
            report = replay_training(run_dir, role)  # type: ignore[arg-type]
            problems += [f"{role} step {c.step}" for c in report.checks if not c.ok]
        except Exception as exc:  # noqa: BLE001 - a replay that cannot run is a violation, named
            problems.append(f"{role}: {type(exc).__name__}: {exc}")
    return {"replay train matches": "; ".join(problems)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--horizon", type=float, default=70.0, help="Kills fall within this many seconds.")
    parser.add_argument("--timeout", type=float, default=900.0, help="A run still going after this is stopped.")
    parser.add_argument("--out", type=Path, default=None, help="Directory for the runs (default runs/chaos-*).")
    parser.add_argument("--quick", action="store_true", help="3 runs.")
    parser.add_argument("--broker", choices=("kafka", "tansu"), default="kafka",
                        help="The embedded broker of the runs: Apache Kafka (its log outlives a kill) or Tansu (memory "
                             "only: a killed one is resumed from the log restored out of the archive).")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="What may be killed.")
    args = parser.parse_args()
    if args.quick:
        args.runs = 3
    out = args.out or ROOT / "runs" / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    outcomes = []
    for index in range(args.runs):
        kills = schedule(rng, args.horizon, tuple(args.kinds))
        run_dir = out / f"run-{index:02d}"
        outcome = run_once(run_dir, args.steps, args.seed * 1000 + index, kills, args.timeout, args.broker)
        check(run_dir, outcome, args.broker)
        outcomes.append(outcome)
        print(f"# run {index}: {outcome.seconds:.0f}s, exit {outcome.exit_code}; "
              + "; ".join(kill.done for kill in kills), flush=True)
        for name, problem in outcome.checks.items():
            print(f"#   {'ok ' if not problem else 'VIOLATION'} {name}{': ' + problem if problem else ''}", flush=True)
    kills = sum(1 for outcome in outcomes for kill in outcome.kills if kill.done.startswith("SIGKILL"))
    violations = sum(len(outcome.violations) for outcome in outcomes)
    print(f"runs={len(outcomes)}")
    print(f"kills={kills}")
    by_kind = {kind: sum(1 for outcome in outcomes for kill in outcome.kills
                         if kill.kind == kind and kill.done.startswith("SIGKILL")) for kind in KINDS}
    print(f"resumes={sum(1 for outcome in outcomes for kill in outcome.kills if kill.kind == 'resume')}")
    print(f"kills_by_kind={json.dumps(by_kind)}")
    print(f"violations={violations}")
    print(f"# runs in {out}")
    sys.exit(1 if violations else 0)


if __name__ == "__main__":
    main()
