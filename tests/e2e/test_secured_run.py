"""`crl run --broker kafka --security sasl_ssl`: the whole loop on an embedded Apache Kafka with TLS, a SCRAM login per
worker kind and ACLs from each kind's declarations, and no secret in anything the run leaves behind.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from infra.kafka_security import SecuredBus
from pipeline.audit.views import Audit
from pipeline.run.security import SECURITY_DIR

pytestmark = [pytest.mark.e2e, pytest.mark.apache_kafka, pytest.mark.timeout(1800)]

CRL = [sys.executable, "-m", "pipeline.cli"]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


@pytest.fixture(scope="module")
def secured_run(kafka_jars, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    run_dir = tmp_path_factory.mktemp("secured") / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "COLUMNS": "400", "CRL_ACTOR_TRAINER__WARMUP_STEPS": "1",
                "CRL_ACTOR_TRAINER__GROUP_SIZE": "4", "CRL_ACTOR_TRAINER__GROUPS_PER_STEP": "2",
                "CRL_SCHEDULER__EVAL_EVERY": "0", "CRL_BROKER__KAFKA_HEAP_MB": "384"})
    result = subprocess.run([*CRL, "run", "configs/tiny-minihack-room.yaml", "--steps", str(STEPS), "--broker", "kafka",
                             "--security", "sasl_ssl", "--run-dir", str(run_dir), "--no-report"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    return run_dir, result


def test_the_loop_completes_on_a_secured_broker(secured_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    run_dir, result = secured_run
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "secured: TLS and SCRAM-SHA-512 logins" in output
    with Audit(run_dir) as audit:
        finished = audit.query("SELECT status, steps_completed FROM run_finished")[1]
        trained = audit.query("SELECT count(*) FROM train_step_completed WHERE role = 'actor'")[1]
        trajectories = audit.query("SELECT count(*) FROM trajectory_completed")[1]
        dead = audit.query("SELECT count(*) FROM dead_letter")[1]
        config = json.loads(audit.query("SELECT config FROM run_started")[1][0][0])
    assert finished == [("completed", STEPS)]
    assert trained[0][0] >= 1 and trajectories[0][0] >= STEPS * 8
    assert dead == [(0,)]
    # The scheduler logged in as its own kind, and RunStarted shows no password.
    assert config["broker"]["security"] == "sasl_ssl"
    assert config["kafka"]["security_protocol"] == "SASL_SSL"
    assert config["kafka"]["sasl_plain_username"] == "crl-scheduler"
    assert config["kafka"]["sasl_plain_password"] == "**********"


def test_no_secret_is_in_the_logs_events_config_or_archive(
        secured_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    run_dir, result = secured_run
    security = run_dir / SECURITY_DIR
    bus = SecuredBus.load(security)
    secrets = bus.secrets()
    assert len(secrets) == len(bus.passwords) + 2  # every password, the CA's key and the broker's key
    assert stat.S_IMODE(security.stat().st_mode) == 0o700
    assert {path.name for path in security.iterdir() if stat.S_IMODE(path.stat().st_mode) != 0o600} == {"ca.pem"}
    # Every file the run wrote (logs, config.yaml, archive, database, metrics, the broker's log segments) but the
    # secured folder and the broker's own config, which holds the broker's logins and is its owner's only.
    properties = run_dir / "kafka" / "server.properties"
    assert stat.S_IMODE(properties.stat().st_mode) == 0o600
    written = [path for path in run_dir.rglob("*")
               if path.is_file() and security not in path.parents and path != properties]
    logs = sorted((run_dir / "logs").glob("*.log"))
    archive = sorted((run_dir / "archive").rglob("*.parquet"))
    assert logs and archive and (run_dir / "config.yaml") in written
    leaks = [(path, n) for path in written for n, secret in enumerate(secrets)
             if secret.encode() in path.read_bytes()]
    assert leaks == [], leaks
    # The events as `crl audit sql` reads them (the archive's payloads, decompressed).
    with Audit(run_dir) as audit:
        payloads = [row[0] for row in audit.query("SELECT payload::VARCHAR FROM events")[1]]
    assert payloads
    assert not [secret for secret in secrets for payload in payloads if secret in payload]
    # What the run printed.
    output = result.stdout + result.stderr
    assert not [secret for secret in secrets if secret in output]
