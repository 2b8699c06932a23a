"""One long `crl run` per embedded broker that goes through what a run survives, each phase asserted by a test of its
own against the shared run. On Tansu, the whole scenario:

1. a worker kind another package registers (a `crl.workers` entry point) starts in the order its declarations give;
2. a rollout worker SIGKILLed mid-run is restarted and the run carries on (`launch.max_restarts` is 1 here);
3. killed again, it has used up its restarts: the run fails and names `crl run --resume`;
4. `--resume`, then Ctrl-C: the run stops as `stopped`, exit 130, every worker stopped by SIGTERM, everything archived;
5. `--resume`, then the broker itself is SIGKILLed: the run stops naming `--resume`; Tansu keeps records in memory
   only, so the next resume restores the archived log into a fresh Tansu;
6. `--resume` once more: the run completes, every step exactly once, actor versions without gaps or repeats, no dead
   letter, and `crl replay bank` / `crl replay train` match over the whole run.

What depends on the broker runs on Apache Kafka too, whose log outlives its JVM: phases 4 to 6 (Ctrl-C, a killed
broker, the resumes). Phases 1 to 3 are `crl run`'s own supervision, the same whatever the broker, so they run once.

A phase that fails stops the scenario; the tests of later phases then fail naming it. The tiny config with one
warm-up step, ten steps of two groups: each interruption waits until the actor has trained a step in that invocation,
so each falls at a different step and the last resume still has steps to play.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from crl_process import assert_replays_match

from infra.apache_kafka import KAFKA_VERSION
from pipeline.audit.views import Audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

CRL = [sys.executable, "-m", "pipeline.cli"]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
GROUPS = 2  # groups of 4 per step: 8 episodes, a quarter of the config's, so each step costs little CPU
EPISODES = GROUPS * 4
TRAINED = re.compile(r"-> version (\d+)")

STEP_COUNTER = '''
from pipeline.runtime.runner import Worker
from schemas.topics import TRAIN_STEPS


class StepCounter(Worker):
    """A worker kind from another package: it writes down every train step it reads."""

    name = "step_counter"
    consumes = (TRAIN_STEPS,)

    def __init__(self, run_dir):
        self.path = run_dir / "counted.txt"

    @classmethod
    def build(cls, context):
        return cls(context.settings.run_dir)

    def handle(self, event, origin):
        if event.kind != "TrainStepCompleted":
            return ()  # the topic also carries the trainers' warm-start progress
        with self.path.open("a") as out:
            out.write(f"{event.role} {event.step}\\n")
        return ()


WORKERS = {StepCounter.name: StepCounter}
'''


def _plugin(root: Path) -> Path:
    """A package of our own, installed by being on PYTHONPATH: its dist-info publishes the `crl.workers` entry."""
    info = root / "crl_step_counter-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: crl-step-counter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[crl.workers]\nstep_counter = step_counter:WORKERS\n")
    (root / "step_counter.py").write_text(STEP_COUNTER)
    return root


@dataclass
class Phase:
    """What one `crl run` (or `--resume`) invocation printed and how it ended."""

    returncode: int
    output: str
    log_offsets: dict[str, int]  # where each worker log stood when the invocation started
    table: dict[str, dict] = field(default_factory=dict)  # workers.json when it ended

    @property
    def flat(self) -> str:
        return " ".join(self.output.split())


@dataclass
class Scenario:
    broker: str
    run_dir: Path
    env: dict[str, str]
    supervision: bool  # phases 1-3: the plug-in, the restart and the crash
    phases: dict[str, Phase] = field(default_factory=dict)
    notes: dict[str, object] = field(default_factory=dict)
    failure: str | None = None
    running: list[subprocess.Popen[str]] = field(default_factory=list)

    def phase(self, name: str) -> Phase:
        if name not in self.phases:
            pytest.fail(f"phase {name!r} did not run: {self.failure or 'an earlier phase failed'}")
        return self.phases[name]

    def crl(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CRL, *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)


def _log_offsets(run_dir: Path) -> dict[str, int]:
    logs = run_dir / "logs"
    return {p.name: p.stat().st_size for p in logs.glob("*.log")} if logs.is_dir() else {}


def _log_since(run_dir: Path, name: str, offsets: dict[str, int]) -> str:
    path = run_dir / "logs" / name
    if not path.exists():
        return ""
    with path.open("rb") as handle:
        handle.seek(offsets.get(name, 0))
        return handle.read().decode(errors="replace")


def _table(run_dir: Path) -> dict[str, dict]:
    return json.loads((run_dir / "workers.json").read_text())


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Invocation:
    """A `crl run` process the scenario drives: wait for what its workers log, signal it, collect how it ended."""

    def __init__(self, scenario: Scenario, args: list[str]) -> None:
        self.scenario = scenario
        self.offsets = _log_offsets(scenario.run_dir)
        self.process = subprocess.Popen([*CRL, *args], cwd=ROOT, env=scenario.env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        scenario.running.append(self.process)

    def trained(self) -> list[int]:
        """The actor versions trained since this invocation started."""
        log = _log_since(self.scenario.run_dir, "actor_trainer-0.log", self.offsets)
        return [int(version) for version in TRAINED.findall(log)]

    def wait_for_training(self, count: int = 1, timeout: float = 600) -> int:
        """Until the actor trained `count` versions in this invocation; returns the newest. Fails if the run ends
        first: each phase must interrupt a run that still has steps to go."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(trained := self.trained()) >= count:
                return trained[-1]
            if self.process.poll() is not None:
                raise AssertionError(f"crl run exited {self.process.returncode} after training {self.trained()}:\n"
                                     f"{self.process.stdout.read()[-3000:]}")  # type: ignore[union-attr]
            time.sleep(0.5)
        self.process.kill()
        raise AssertionError(f"the actor trained {self.trained()} in {timeout}s, not {count} versions")

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.2)

    def end(self, timeout: float = 900) -> Phase:
        output, _ = self.process.communicate(timeout=timeout)
        return Phase(self.process.returncode, output, self.offsets, _table(self.scenario.run_dir))


def _play(scenario: Scenario) -> None:
    run_dir = scenario.run_dir
    start = ["run", "configs/tiny-minihack-room.yaml", "--steps", str(STEPS), "--broker", scenario.broker,
             "--run-dir", str(run_dir), "--no-report"]
    resume = ["run", "--resume", str(run_dir), "--no-report"]
    # Generous: on a fresh machine the warm starts are computed first (minutes, more when other tests share the cores).
    first_wait_s = 1800

    if scenario.supervision:  # 1-3: a worker killed mid-run is restarted; killed again, it fails the run.
        run = Invocation(scenario, start)
        run.wait_for_training(timeout=first_wait_s)
        first_pid = _table(run_dir)["rollout-0"]["pid"]
        os.kill(first_pid, signal.SIGKILL)
        run.wait_until(lambda: _table(run_dir)["rollout-0"]["restarts"] == 1, "rollout-0's restart")
        restarted = _table(run_dir)["rollout-0"]
        trained_before = len(run.trained())
        scenario.notes.update(killed_pid=first_pid, restarted=restarted)
        # the run carried on with the restarted worker: the actor trained a step on what it played
        scenario.notes["trained_after_restart"] = run.wait_for_training(trained_before + 1)
        scenario.notes["first_table"] = _table(run_dir)
        os.kill(restarted["pid"], signal.SIGKILL)
        scenario.phases["worker crashes past its restarts"] = run.end()
        run, wait_s = Invocation(scenario, resume), 600.0
    else:
        run, wait_s = Invocation(scenario, start), first_wait_s

    # 4: Ctrl-C (a stop drains: the steps in flight still finish).
    run.wait_for_training(timeout=wait_s)
    run.process.send_signal(signal.SIGINT)
    scenario.phases["ctrl-c"] = run.end()
    scenario.notes["broker file after ctrl-c"] = (run_dir / "broker.json").exists()
    with Audit(run_dir) as audit:
        scenario.notes["archived at ctrl-c"] = audit.query(
            "SELECT (SELECT count(*) FROM trajectory_completed), (SELECT count(*) FROM train_steps "
            "WHERE role = 'actor')")[1][0]

    # 5: resume, then the broker dies.
    run = Invocation(scenario, resume)
    run.wait_for_training()
    broker_pid = json.loads((run_dir / "broker.json").read_text())["pid"]
    os.kill(broker_pid, signal.SIGKILL)
    scenario.notes["broker_pid"] = broker_pid
    scenario.phases["broker killed"] = run.end()

    # 6: resume to the end.
    run = Invocation(scenario, resume)
    scenario.phases["completed"] = run.end(timeout=1200)


@pytest.fixture(scope="module", params=["tansu", pytest.param("kafka", marks=pytest.mark.apache_kafka)])
def scenario(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    if request.param == "kafka":
        request.getfixturevalue("kafka_jars")
    root = tmp_path_factory.mktemp(f"scenario-{request.param}")
    supervision = request.param == "tansu"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "COLUMNS": "400", "CRL_ACTOR_TRAINER__WARMUP_STEPS": "1",
                "CRL_ACTOR_TRAINER__GROUP_SIZE": "4", "CRL_ACTOR_TRAINER__GROUPS_PER_STEP": str(GROUPS),
                "CRL_SCHEDULER__EVAL_EVERY": "0"})
    if supervision:
        plugin = str(_plugin(root / "plugin"))
        env.update({"PYTHONPATH": os.pathsep.join(p for p in (plugin, os.environ.get("PYTHONPATH")) if p),
                    "CRL_LAUNCH__MAX_RESTARTS": "1"})
    scenario = Scenario(request.param, root / "run", env, supervision)
    try:
        _play(scenario)
    except (AssertionError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as exc:
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted((root / "run" / "logs").glob("*.log"))
                         if p.name != "broker.log") if (root / "run" / "logs").is_dir() else ""
        scenario.failure = f"{type(exc).__name__}: {exc}\n{logs[-12000:]}"
    yield scenario
    for process in scenario.running:  # a phase that failed may leave its run going; its workers die with it
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("scenario", ["tansu"], indirect=True)  # broker-independent: once
def test_a_worker_kind_another_package_registers_starts_in_its_place_and_stops_with_the_run(scenario):
    """The plug-in reads train steps, so it starts before the trainers that write them; the clock starts last."""
    scenario.phase("completed")
    table = list(scenario.notes["first_table"])
    assert table[0] == "archiver-0" and table[-1] == "scheduler-0", table
    assert table.index("step_counter-0") < min(table.index("actor_trainer-0"), table.index("extractor_trainer-0"))
    with Audit(scenario.run_dir) as audit:
        steps = {f"{role} {step}" for role, step in audit.query("SELECT role, step FROM train_steps")[1]}
    counted = set((scenario.run_dir / "counted.txt").read_text().splitlines())
    assert counted == steps, "it read every train step of the whole run (at least once)"
    log = (scenario.run_dir / "logs" / "step_counter-0.log").read_text()
    assert log.count("stopped (SIGTERM)") >= 3, "stopped with the run each time"


@pytest.mark.parametrize("scenario", ["tansu"], indirect=True)  # broker-independent: once
def test_a_killed_worker_is_restarted_and_the_run_carries_on(scenario):
    phase = scenario.phase("worker crashes past its restarts")
    assert "rollout-0 exited with code -9; restart 1 of 1" in phase.flat
    restarted = scenario.notes["restarted"]
    assert restarted["restarts"] == 1 and restarted["pid"] != scenario.notes["killed_pid"]
    # it played episodes: the actor trained a step on them before the second kill
    assert f"-> version {scenario.notes['trained_after_restart']}" in \
        _log_since(scenario.run_dir, "actor_trainer-0.log", phase.log_offsets)


@pytest.mark.parametrize("scenario", ["tansu"], indirect=True)  # broker-independent: once
def test_a_worker_crashing_past_its_restarts_fails_the_run_naming_resume(scenario):
    phase = scenario.phase("worker crashes past its restarts")
    assert phase.returncode == 1, phase.output[-3000:]
    assert "rollout-0 exited with code -9 after 1 restarts" in phase.flat
    assert f"Continue it with: crl run --resume {scenario.run_dir}" in phase.flat
    assert not any(_alive(worker["pid"]) for worker in phase.table.values())


def test_ctrl_c_stops_the_run_and_archives_everything_recorded(scenario):
    phase = scenario.phase("ctrl-c")
    assert phase.returncode == 130, phase.output[-3000:]
    assert "stopping the run: interrupted (Ctrl-C)" in phase.flat
    assert f"Continue it with: crl run --resume {scenario.run_dir}" in phase.flat
    for instance in phase.table:  # each finished its event, flushed and committed on the supervisor's SIGTERM
        text = _log_since(scenario.run_dir, f"{instance}.log", phase.log_offsets)
        assert "stopped (SIGTERM)" in text or "stopped (finished)" in text, instance
    assert not any(_alive(worker["pid"]) for worker in phase.table.values())
    assert not scenario.notes["broker file after ctrl-c"], "the broker was stopped and its address file removed"
    trajectories, trained = scenario.notes["archived at ctrl-c"]
    assert trajectories >= 2 * EPISODES and trained >= 1, "the steps played so far are in the archive"
    resumed = scenario.phase("broker killed")  # the resume after it read the stopped attempt back
    if scenario.broker == "tansu":  # drained before it stopped: the whole log was archived, and came back from there
        assert "records from the archive into the fresh broker" in resumed.output
    attempt = 2 if scenario.supervision else 1
    with Audit(scenario.run_dir) as audit:
        assert ("stopped", "interrupted (Ctrl-C)") in audit.query("SELECT status, reason FROM run_finished")[1]
        resumed = audit.query(f"SELECT previous_status FROM run_resumed WHERE attempt = {attempt}")[1]
    assert resumed == [("stopped",)]


def test_a_run_whose_broker_was_killed_stops_naming_resume(scenario):
    phase = scenario.phase("broker killed")
    assert phase.returncode != 0, phase.output[-3000:]
    assert "the broker exited" in phase.flat and f"crl run --resume {scenario.run_dir}" in phase.flat
    assert not _alive(scenario.notes["broker_pid"])
    assert not any(_alive(worker["pid"]) for worker in phase.table.values())


def test_the_last_resume_completes_the_run_with_every_step_once(scenario, report_measurement):
    phase = scenario.phase("completed")
    assert phase.returncode == 0, phase.output[-3000:]
    attempts = 3 if scenario.supervision else 2
    assert f"resuming run {scenario.run_dir.name} (attempt {attempts}; the previous one interrupted)" in phase.output
    with Audit(scenario.run_dir) as audit:
        def rows(sql: str) -> list[tuple]:
            return audit.query(sql)[1]

        assert [attempt for (attempt,) in rows("SELECT attempt FROM run_resumed ORDER BY attempt")] == \
            list(range(1, attempts + 1))
        if scenario.supervision:  # the failing supervisor asked the scheduler to stop: it may have closed it first
            assert rows("SELECT previous_status FROM run_resumed WHERE attempt = 1")[0][0] in ("interrupted", "stopped")
        assert ("completed",) in rows("SELECT status FROM run_finished")
        # every step exactly once: each assignment once, each with one trajectory, no trajectory twice
        episodes = STEPS * EPISODES
        assert rows("SELECT count(*), count(DISTINCT event_id) FROM episode_assigned") == [(episodes, episodes)]
        assert rows("SELECT count(*), count(DISTINCT assignment_event_id), count(DISTINCT trajectory_id) "
                    "FROM trajectory_completed") == [(episodes, episodes, episodes)]
        assert rows("SELECT count(*) FROM trajectories WHERE split = 'train' AND guided AND step = 0") == [(0,)]
        assert rows("SELECT count(*) FROM trajectories WHERE split = 'train' AND guided AND step > 0") == \
            [((STEPS - 1) * EPISODES // 2,)]
        # versions without gaps or duplicates; each trained step once
        assert rows("SELECT list(version ORDER BY version) FROM policy_published WHERE role = 'actor'") == \
            [(list(range(STEPS)),)]
        assert rows("SELECT list(step ORDER BY step) FROM train_step_completed WHERE role = 'actor'") == \
            [(list(range(1, STEPS)),)]
        extractor = rows("SELECT list(version ORDER BY version) FROM policy_published WHERE role = 'extractor'")
        assert extractor[0][0] == list(range(len(extractor[0][0])))
        assert rows("SELECT count(*) FROM extraction_generated WHERE purpose = 'distill'")[0][0] >= episodes
        assert rows("SELECT count(*) FROM experience_added")[0][0] >= 1
        assert rows("SELECT count(*) FROM dead_letter") == [(0,)]
        assert rows("SELECT json_extract_string(config, '$.broker.kind') FROM run_started") == [(scenario.broker,)]
        # What the restarts and the killed broker cost: episodes played again (their first play was not committed
        # before a worker or the broker went down; the audit keeps the first of each), and consumers the group
        # watch had to recreate (a last resort: none is needed once kafka-python finishes its joins).
        played = rows(f"SELECT count(*) FROM read_parquet('{scenario.run_dir / 'archive'}/*/*.parquet') "
                      "WHERE kind = 'TrajectoryCompleted'")[0][0]
    recreated = sum(path.read_text(errors="replace").count("recreating its consumer")
                    for path in (scenario.run_dir / "logs").glob("*.log"))
    report_measurement(f"scenario on {scenario.broker}: {played - episodes} of {episodes} episodes played again over "
                       f"{attempts + 1} attempts; consumers recreated by the group watch: {recreated}")


def test_both_replays_match_over_the_whole_run(scenario):
    scenario.phase("completed")
    assert_replays_match(scenario.run_dir, scenario.env, STEPS - 1)


def test_each_embedded_broker_keeps_its_log_where_it_says(scenario):
    """Apache Kafka's log lives in the run directory and outlives the JVM; Tansu's lives in memory, so a resume after
    its death restored the log from the archive. Either way the broker was stopped at the end."""
    first = scenario.phase("worker crashes past its restarts" if scenario.supervision else "ctrl-c")
    last = scenario.phase("completed")
    if scenario.broker == "kafka":
        assert f"broker Apache Kafka {KAFKA_VERSION} at 127.0.0.1:" in first.output
        assert (scenario.run_dir / "kafka" / "log" / "meta.properties").is_file()
        assert "Kafka Server started" in (scenario.run_dir / "logs" / "broker.log").read_text()
        assert "records from the archive" not in last.output
    else:
        assert "broker Tansu" in first.output
        assert not (scenario.run_dir / "kafka").exists()
        assert "records from the archive into the fresh broker" in last.output
    assert not (scenario.run_dir / "broker.json").exists(), "the broker was stopped and its address file removed"
