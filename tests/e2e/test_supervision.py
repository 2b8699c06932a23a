"""`crl run` supervises its workers: a killed worker is restarted and the run completes; Ctrl-C stops the run
cleanly, with everything recorded archived. The grpo arm keeps these runs short (no bank, no extractor)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import wait_for_log

from pipeline.audit.views import Audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def _start(run_dir: Path, steps: int, **extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "CRL_SCHEDULER__EVAL_EVERY": "0", **extra})
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", "configs/tiny-minihack-room.yaml",
                             "--arm", "grpo", "--steps", str(steps), "--run-dir", str(run_dir), "--no-report"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_worker_is_restarted_and_the_run_completes(tmp_path):
    run_dir = tmp_path / "run"
    process = _start(run_dir, steps=3)
    wait_for_log(run_dir, "rollout-0", "rollout metrics over", process, 300)  # mid-run, episodes in flight
    pid = json.loads((run_dir / "workers.json").read_text())["rollout-0"]["pid"]
    os.kill(pid, signal.SIGKILL)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    assert "rollout-0 exited with code -9; restart 1 of 3" in output
    table = json.loads((run_dir / "workers.json").read_text())
    assert table["rollout-0"]["restarts"] == 1 and table["rollout-0"]["pid"] != pid
    with Audit(run_dir) as audit:
        _, rows = audit.query("SELECT count(DISTINCT trajectory_id), min(step), max(step) FROM trajectories "
                              "WHERE split = 'train'")
        assert rows == [(3 * 16, 0, 2)]  # every episode of every step, the re-played ones once
        assert audit.query("SELECT status FROM run_finished")[1] == [("completed",)]
    assert not any(_alive(w["pid"]) for w in table.values())


def test_ctrl_c_stops_the_run_and_archives_everything_recorded(tmp_path):
    run_dir = tmp_path / "run"
    process = _start(run_dir, steps=20)
    wait_for_log(run_dir, "actor_trainer-0", "-> version 1", process, 300)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 130, output[-4000:]
    assert "stopping the run: interrupted (Ctrl-C)" in output
    with Audit(run_dir) as audit:
        assert audit.query("SELECT status, reason FROM run_finished")[1] == [("stopped", "interrupted (Ctrl-C)")]
        archived = audit.query("SELECT count(*) FROM trajectory_completed")[1][0][0]
        trained = audit.query("SELECT count(*) FROM train_steps WHERE role = 'actor'")[1][0][0]
    assert archived >= 32 and trained >= 1
    # every worker stopped on the supervisor's SIGTERM, after finishing and committing what it had
    for log in (run_dir / "logs").glob("*-0.log"):
        text = log.read_text()
        assert "stopped (SIGTERM)" in text or "stopped (finished)" in text, log.name
    table = json.loads((run_dir / "workers.json").read_text())
    assert not any(_alive(w["pid"]) for w in table.values())
    assert not (run_dir / "broker.json").exists()


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
        with self.path.open("a") as out:
            out.write(f"{event.role} {event.step}\\n")
        return ()


WORKERS = {StepCounter.name: StepCounter}
'''


def test_crl_run_starts_a_worker_kind_another_package_registers(tmp_path):
    """A package that publishes a `crl.workers` entry point adds a worker kind: `crl run` starts it in the order its
    declarations give (it reads train steps, so it starts before the actor trainer) and stops it with the rest."""
    plugin = tmp_path / "plugin"
    (plugin / "crl_step_counter-0.1.dist-info").mkdir(parents=True)
    (plugin / "crl_step_counter-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: crl-step-counter\nVersion: 0.1\n")
    (plugin / "crl_step_counter-0.1.dist-info" / "entry_points.txt").write_text(
        "[crl.workers]\nstep_counter = step_counter:WORKERS\n")
    (plugin / "step_counter.py").write_text(STEP_COUNTER)
    run_dir = tmp_path / "run"
    pythonpath = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)
    process = _start(run_dir, steps=1, PYTHONPATH=pythonpath, CRL_ACTOR_TRAINER__WARMUP_STEPS="0")  # step 0 trains
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    table = json.loads((run_dir / "workers.json").read_text())
    assert list(table) == ["archiver-0", "step_counter-0", "actor_trainer-0", "rollout-0", "scheduler-0"]
    assert (run_dir / "counted.txt").read_text() == "actor 0\n"
    assert "stopped (SIGTERM)" in (run_dir / "logs" / "step_counter-0.log").read_text()
    assert not any(_alive(w["pid"]) for w in table.values())


def test_crl_run_uses_the_kafka_it_is_given(kafka_bootstrap, tmp_path):
    from infra.kafka import KafkaSettings
    from pipeline.runtime.log import read_to_end
    from schemas.runs import RunFinished
    from schemas.topics import RUNS

    run_dir = tmp_path / "run"
    process = _start(run_dir, steps=2, CRL_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    assert not (run_dir / "logs" / "broker.log").exists(), "no embedded broker is started for a given Kafka"
    finished = [e for e in read_to_end(KafkaSettings(bootstrap_servers=kafka_bootstrap), RUNS)
                if isinstance(e, RunFinished)]
    assert [(e.run_id, e.status) for e in finished] == [("run", "completed")]  # the log stays on that broker
