"""`crl run --resume RUN_DIR` on the embedded Apache Kafka (whose log outlives the run): after Ctrl-C, after a
worker crash that failed the run, and after the broker itself was killed; and on the embedded Tansu (memory only)
after Ctrl-C and after its broker was killed, from the log restored out of the archive. Each resumed run completes
with every step exactly once, versions without gaps or duplicates, and both replays matching over the whole run.
"""

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

pytestmark = [pytest.mark.e2e, pytest.mark.apache_kafka, pytest.mark.timeout(1800)]

CRL = [sys.executable, "-m", "pipeline.cli"]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "COLUMNS": "400", "CRL_ACTOR_TRAINER__WARMUP_STEPS": "1",
                "CRL_SCHEDULER__EVAL_EVERY": "0", **extra})
    return env


def _start(run_dir: Path, broker: str = "kafka", **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*CRL, "run", "configs/tiny-minihack-room.yaml", "--steps", str(STEPS), "--broker",
                             broker, "--run-dir", str(run_dir), "--no-report"], cwd=ROOT, env=_env(**extra),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _resume(run_dir: Path) -> str:
    result = subprocess.run([*CRL, "run", "--resume", str(run_dir), "--no-report"], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=1200)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run_dir / "logs").glob("*.log"))
                         if p.name != "broker.log")
        pytest.fail(f"crl run --resume exited {result.returncode}:\n{output[-4000:]}\n{logs}")
    return output


def _check_the_whole_run(run_dir: Path, *previous_status: str) -> None:
    with Audit(run_dir) as audit:
        def rows(sql: str) -> list[tuple]:
            return audit.query(sql)[1]

        [(attempt, previous)] = rows("SELECT attempt, previous_status FROM run_resumed")
        assert attempt == 1 and previous in previous_status, previous
        assert ("completed",) in rows("SELECT status FROM run_finished")
        # every step exactly once: each assignment once, each with one trajectory, no trajectory twice
        assert rows("SELECT count(*), count(DISTINCT event_id) FROM episode_assigned") == [(STEPS * 16, STEPS * 16)]
        assert rows("SELECT count(*), count(DISTINCT assignment_event_id), count(DISTINCT trajectory_id) "
                    "FROM trajectory_completed") == [(STEPS * 16, STEPS * 16, STEPS * 16)]
        # versions without gaps or duplicates; each trained step once
        assert rows("SELECT list(version ORDER BY version) FROM policy_published WHERE role = 'actor'") == \
            [([0, 1, 2],)]
        assert rows("SELECT list(step ORDER BY step) FROM train_step_completed WHERE role = 'actor'") == [([1, 2],)]
        extractor = rows("SELECT list(version ORDER BY version) FROM policy_published WHERE role = 'extractor'")
        assert extractor[0][0] == list(range(len(extractor[0][0])))
        assert rows("SELECT count(*) FROM dead_letter") == [(0,)]
    env = _env()
    bank = subprocess.run([*CRL, "replay", "bank", str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert bank.returncode == 0 and "live SQL bank" in bank.stdout and "NO" not in bank.stdout, bank.stdout
    train = subprocess.run([*CRL, "replay", "train", str(run_dir)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert train.returncode == 0, train.stdout + train.stderr
    assert "actor: 2 steps replayed, every weight hash matches" in train.stdout


@pytest.mark.parametrize("broker", ["tansu", "kafka"])
def test_a_run_stopped_with_ctrl_c_resumes_and_completes_every_step_once(broker, request, tmp_path):
    if broker == "kafka":
        request.getfixturevalue("kafka_jars")
    run_dir = tmp_path / f"stopped-on-{broker}"
    process = _start(run_dir, broker=broker)
    wait_for_log(run_dir, "actor_trainer-0", "-> version 1", process, 600)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 130, output[-4000:]
    assert f"Continue it with: crl run --resume {run_dir}" in " ".join(output.split())
    output = _resume(run_dir)
    assert f"resuming run {run_dir.name} (attempt 1; the previous one stopped)" in output
    if broker == "tansu":  # drained before it stopped: the whole log was archived, and comes back from there
        assert "records from the archive into the fresh broker" in output, output[-3000:]
    _check_the_whole_run(run_dir, "stopped")


def test_a_run_failed_by_a_crashing_worker_resumes_and_completes(kafka_jars, tmp_path):
    run_dir = tmp_path / "crashed"
    process = _start(run_dir, CRL_LAUNCH__MAX_RESTARTS="0")  # the first crash fails the run
    wait_for_log(run_dir, "rollout-0", "rollout metrics over", process, 600)  # mid-run, episodes in flight
    os.kill(json.loads((run_dir / "workers.json").read_text())["rollout-0"]["pid"], signal.SIGKILL)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 1, output[-4000:]
    assert "rollout-0 exited with code -9" in output
    _resume(run_dir)
    # the failing supervisor asked the scheduler to stop: it may have closed the attempt as stopped first
    _check_the_whole_run(run_dir, "interrupted", "stopped")


@pytest.mark.parametrize("broker", ["tansu", "kafka"])
def test_a_run_whose_broker_was_killed_stops_naming_resume_and_resumes(broker, request, tmp_path):
    """Apache Kafka's log outlives its JVM; Tansu keeps records in memory only, so the resume restores the archived
    log into a fresh Tansu (same offsets, the topic ids mapped to the old ones). Either way the run carries on from
    its positions and checkpoints."""
    if broker == "kafka":
        request.getfixturevalue("kafka_jars")
    run_dir = tmp_path / f"lost-{broker}"
    process = _start(run_dir, broker=broker)
    wait_for_log(run_dir, "actor_trainer-0", "-> version 1", process, 600)
    os.kill(json.loads((run_dir / "broker.json").read_text())["pid"], signal.SIGKILL)
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0, output[-4000:]
    flat = " ".join(output.split())
    assert "the broker exited" in flat and f"crl run --resume {run_dir}" in flat, flat[-3000:]
    output = _resume(run_dir)
    if broker == "tansu":
        assert "records from the archive into the fresh broker" in output, output[-3000:]
    _check_the_whole_run(run_dir, "interrupted")
