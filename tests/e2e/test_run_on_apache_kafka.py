"""`crl run --broker kafka`: the tiny loop on the embedded Apache Kafka, the broker users run in production.

Two steps with one warm-up step, so the second is guided and trained; then both replays must match, as on Tansu.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.apache_kafka import KAFKA_VERSION
from pipeline.audit.views import Audit

pytestmark = [pytest.mark.e2e, pytest.mark.apache_kafka, pytest.mark.timeout(1500)]

CRL = [sys.executable, "-m", "pipeline.cli"]
ROOT = Path(__file__).resolve().parents[2]


def _crl(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CRL, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_the_tiny_loop_completes_on_apache_kafka_and_both_replays_match(kafka_jars, tmp_path):
    run_dir = tmp_path / "on-kafka"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "CRL_ACTOR_TRAINER__WARMUP_STEPS": "1", "CRL_SCHEDULER__EVAL_EVERY": "0"})
    result = _crl("run", "configs/tiny-minihack-room.yaml", "--steps", "2", "--broker", "kafka", "--run-dir",
                  str(run_dir), "--no-report", env=env, timeout=1200)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        pytest.fail(f"crl run --broker kafka exited {result.returncode}:\n{output[-5000:]}\n{logs}")
    assert f"broker Apache Kafka {KAFKA_VERSION} at 127.0.0.1:" in output
    assert (run_dir / "kafka" / "log" / "meta.properties").is_file(), "the broker's log lives in the run directory"
    assert "Kafka Server started" in (run_dir / "logs" / "broker.log").read_text()
    assert not (run_dir / "broker.json").exists(), "the broker was stopped and its address file removed"

    with Audit(run_dir) as audit:
        def one(sql: str) -> object:
            return audit.query(sql)[1][0][0]

        assert one("SELECT status FROM run_finished") == "completed"
        assert one("SELECT count(*) FROM trajectories WHERE split = 'train'") == 2 * 16
        assert one("SELECT count(*) FROM trajectories WHERE split = 'train' AND step = 1 AND guided") == 8
        assert one("SELECT count(*) FROM extraction_generated WHERE purpose = 'distill'") == 32
        assert one("SELECT count(*) FROM experience_added") >= 1
        assert one("SELECT count(*) FROM train_steps WHERE role = 'actor'") == 1
        assert one("SELECT count(*) FROM dead_letter") == 0
        assert one("SELECT json_extract_string(config, '$.broker.kind') FROM run_started") == "kafka"

    bank = _crl("replay", "bank", str(run_dir), env=env, timeout=300)
    assert bank.returncode == 0, bank.stdout + bank.stderr
    assert "live SQL bank" in bank.stdout and "NO" not in bank.stdout
    train = _crl("replay", "train", str(run_dir), env=env, timeout=600)
    assert train.returncode == 0, train.stdout + train.stderr
    assert "actor: 1 steps replayed, every weight hash matches" in train.stdout
