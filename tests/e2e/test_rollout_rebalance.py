"""More rollout workers: `launch.rollout_workers: 2` starts two, and a third started by hand with `crl worker rollout`
(as on another host: it needs only the run's config) joins their consumer group while the run is under way, plays
episodes, and leaves again (SIGTERM) with steps still to play. The group rebalances twice; the run completes with
every assignment played exactly once, nothing dead-lettered, and both replays matching."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from crl_process import assert_replays_match, run_env

from infra.kafka import KafkaSettings
from pipeline.audit.views import Audit
from pipeline.runtime.blobs import BlobStore
from pipeline.runtime.log import read_to_end
from schemas.topics import TRAJECTORIES
from schemas.trajectories import TrajectoryCompleted

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

CRL = [sys.executable, "-m", "pipeline.cli"]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
GROUPS = 2
EPISODES = GROUPS * 4
EXTRA = "rollout-extra"


@dataclass
class RebalancedRun:
    run_dir: Path
    returncode: int
    output: str
    extra_exit: int
    extra_log: str
    versions_at_leave: int


def _actor_versions(run_dir: Path) -> int:
    log = run_dir / "logs" / "actor_trainer-0.log"
    return log.read_text().count("-> version ") if log.exists() else 0


def _wait(condition, what: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        # the run first: once it ended, its broker is gone and a condition reading the log cannot answer
        assert process.poll() is None, f"crl run ended while waiting for {what}: {process.communicate()[0][-4000:]}"
        if condition():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def rebalanced_run(tmp_path_factory: pytest.TempPathFactory) -> RebalancedRun:
    run_dir = tmp_path_factory.mktemp("rebalance") / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "COLUMNS": "400", "CRL_ACTOR_TRAINER__WARMUP_STEPS": "1",
                "CRL_ACTOR_TRAINER__GROUP_SIZE": "4", "CRL_ACTOR_TRAINER__GROUPS_PER_STEP": str(GROUPS),
                "CRL_SCHEDULER__EVAL_EVERY": "0", "CRL_LAUNCH__ROLLOUT_WORKERS": "2"})
    process = subprocess.Popen([*CRL, "run", "configs/tiny-minihack-room.yaml", "--steps", str(STEPS), "--run-dir",
                                str(run_dir), "--no-report"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    extra_log = run_dir / "logs" / f"{EXTRA}.log"
    extra_exit, versions_at_leave = -1, -1
    try:
        # It starts once the run launched its own workers, so its start (seconds of imports and a policy built) overlaps
        # the warm starts and it joins with every step still to play, however fast the run is.
        _wait(lambda: (run_dir / "logs" / "rollout-0.log").exists(), "the run's own rollout workers", process, 600)
        # A worker on "another host": the run's config, nothing else (no CRL_* variable, no supervisor).
        worker_env = {k: v for k, v in env.items() if not k.startswith("CRL_")}
        extra = subprocess.Popen([*CRL, "--config", str(run_dir / "config.yaml"), "worker", "rollout",
                                  "--instance", EXTRA], cwd=ROOT, env=worker_env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.STDOUT)
        try:
            _wait(lambda: extra_log.exists() and "partitions assigned: [('crl.tasks'" in extra_log.read_text(),
                  "the extra worker's partitions", process, 300)
            # it joined before the warm starts ended: its first episode waits for them (minutes when computed)
            _wait(lambda: _played_by(run_dir, EXTRA) > 0, "an episode of the extra worker", process, 1800)
            versions_at_leave = _actor_versions(run_dir)
            extra.send_signal(signal.SIGTERM)  # leaves the group: its partitions go back to the other two
            extra_exit = extra.wait(timeout=120)
        finally:
            if extra.poll() is None:
                extra.kill()
                extra.wait()
        output, _ = process.communicate(timeout=1500)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return RebalancedRun(run_dir, process.returncode, output, extra_exit,
                         extra_log.read_text() if extra_log.exists() else "", versions_at_leave)


def _played_by(run_dir: Path, instance: str) -> int:
    """Trajectories on the run's broker that `instance` published."""
    broker = json.loads((run_dir / "broker.json").read_text())
    trajectories = read_to_end(KafkaSettings(bootstrap_servers=broker["bootstrap_servers"]), TRAJECTORIES,
                               BlobStore(run_dir / "blobs"))
    return sum(1 for t in trajectories if isinstance(t, TrajectoryCompleted) and t.producer.instance == instance)


def test_a_worker_joining_and_leaving_mid_run_loses_and_duplicates_nothing(rebalanced_run):
    assert rebalanced_run.returncode == 0, rebalanced_run.output[-4000:]
    assert rebalanced_run.extra_exit == 0, rebalanced_run.extra_log[-3000:]
    assert "partitions revoked" in rebalanced_run.extra_log  # it gave its partitions back when it left
    assert rebalanced_run.versions_at_leave < STEPS - 2  # it left with steps still to play
    with Audit(rebalanced_run.run_dir) as audit:
        def rows(sql: str) -> list[tuple]:
            return audit.query(sql)[1]

        assert rows("SELECT status FROM run_finished") == [("completed",)]
        episodes = STEPS * EPISODES
        assert rows("SELECT count(*), count(DISTINCT event_id) FROM episode_assigned") == [(episodes, episodes)]
        assert rows("SELECT count(*), count(DISTINCT assignment_event_id), count(DISTINCT trajectory_id) "
                    "FROM trajectory_completed") == [(episodes, episodes, episodes)]
        players = dict(rows("SELECT producer_instance, count(*) FROM events WHERE kind = 'TrajectoryCompleted' "
                            "GROUP BY ALL"))
        assert set(players) == {"rollout-0", "rollout-1", EXTRA}, players
        assert rows("SELECT list(version ORDER BY version) FROM policy_published WHERE role = 'actor'") == \
            [(list(range(STEPS)),)]
        assert rows("SELECT count(*) FROM dead_letter") == [(0,)]


def test_both_replays_match_after_the_rebalances(rebalanced_run):
    assert rebalanced_run.returncode == 0
    assert_replays_match(rebalanced_run.run_dir, run_env(), STEPS - 1)  # warm-up 1: every later step trains
