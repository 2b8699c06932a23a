"""`crl run` on a Kafka it is given (`CRL_KAFKA__BOOTSTRAP_SERVERS`): it starts no broker of its own, and the run's
log stays on that Kafka. Which broker stands behind the address does not matter to this path, so it runs on the
cheapest one, a Tansu the test starts (the embedded brokers' own paths are `test_scenario.py`'s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.kafka import KafkaSettings
from pipeline.runtime.log import read_to_end
from schemas.runs import RunFinished
from schemas.topics import RUNS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kafka_bootstrap", ["tansu"], indirect=True)
def test_crl_run_uses_the_kafka_it_is_given(kafka_bootstrap, tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "CRL_SCHEDULER__EVAL_EVERY": "0",
                "CRL_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap})
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "configs/tiny-minihack-room.yaml", "--arm",
                             "grpo", "--steps", "2", "--run-dir", str(run_dir), "--no-report"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert not (run_dir / "logs" / "broker.log").exists(), "no embedded broker is started for a given Kafka"
    finished = [e for e in read_to_end(KafkaSettings(bootstrap_servers=kafka_bootstrap), RUNS)
                if isinstance(e, RunFinished)]
    assert [(e.run_id, e.status) for e in finished] == [("run", "completed")]  # the log stays on that broker
