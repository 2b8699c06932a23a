"""Worker processes for integration tests: settings for a tiny run, start/stop as `crl worker` subprocesses, wait for
a condition with the workers' log on failure, publish events as a raw client would, and `crl replay train` what the
trainers recorded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kafka import KafkaProducer

from infra.kafka import KafkaSettings
from pipeline.runtime.log import read_to_end
from schemas.base import Event
from schemas.codec import encode
from schemas.topics import POLICY, TRAIN_STEPS, topic_of
from schemas.training import PolicyPublished, TrainStepCompleted

CRL = [sys.executable, "-m", "pipeline.cli"]
TINY = {"HIDDEN_SIZE": "64", "NUM_LAYERS": "2", "NUM_HEADS": "4", "NUM_KV_HEADS": "2", "INTERMEDIATE_SIZE": "128",
        "VOCAB_SIZE": "512", "CORPUS_EPISODES": "4"}


def _env(bootstrap: str, run_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({
        "CRL_KAFKA__BOOTSTRAP_SERVERS": bootstrap, "CRL_RUN_DIR": str(run_dir), "CRL_RUNNER__POLL_TIMEOUT_MS": "100",
        "HF_HUB_OFFLINE": "1", "CRL_ARCHIVER__FLUSH_INTERVAL_S": "0.2",
        "CRL_ACTOR_TRAINER__WARMUP_STEPS": "1", "CRL_ACTOR_TRAINER__GROUP_SIZE": "4",
        "CRL_ACTOR_TRAINER__GROUPS_PER_STEP": "2", "CRL_ACTOR_TRAINER__LR": "0.001",
        "CRL_ACTOR_TRAINER__THREADS": "1", "CRL_ACTOR_TRAINER__MICRO_BATCH_SIZE": "6",
        "CRL_EXTRACTOR_TRAINER__BUFFER_SIZE": "4", "CRL_EXTRACTOR_TRAINER__LR": "0.001",
        "CRL_EXTRACTOR_TRAINER__THREADS": "1",
    })
    for field, value in TINY.items():
        env[f"CRL_ACTOR_TRAINER__MODEL__TINY__{field}"] = value
        env[f"CRL_EXTRACTOR_TRAINER__MODEL__TINY__{field}"] = value
    return env


def _start(worker: str, env: dict[str, str], log: Path, *, prelude: str | None = None) -> subprocess.Popen:
    if prelude is None:
        command = [*CRL, "worker", worker, "--instance", f"{worker}-test"]
    else:
        script = (f"{prelude}\nimport sys\nfrom pipeline.cli import main\n"
                  f"sys.argv = ['crl', 'worker', '{worker}']\nmain()")
        command = [sys.executable, "-c", script]
    return subprocess.Popen(command, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_for(what: str, check: Callable[[], object], timeout_s: float, log: Path) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; worker log:\n{log.read_text()[-4000:]}")


def _send(bootstrap: str, events: list[Event]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_request_size=4 * 1024 * 1024)
    for event in events:
        topic = topic_of(event)
        producer.send(topic.name, key=topic.key_bytes(event), value=encode(event))
    producer.flush()
    producer.close()




def _replays_train(run_dir: Path, env: dict[str, str], role: str, expected: str, timeout_s: float = 600) -> None:
    """`crl replay train RUN_DIR --role ROLE` exits 0 and says `expected` (e.g. "actor: 2 steps replayed, every
    weight hash matches")."""
    replayed = subprocess.run([*CRL, "replay", "train", str(run_dir), "--role", role], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert expected in replayed.stdout, replayed.stdout


def _published(kafka: KafkaSettings, role: str) -> tuple[list[PolicyPublished], list[TrainStepCompleted]]:
    policies = [e for e in read_to_end(kafka, POLICY) if isinstance(e, PolicyPublished) and e.role == role]
    steps = [e for e in read_to_end(kafka, TRAIN_STEPS) if isinstance(e, TrainStepCompleted) and e.role == role]
    return policies, steps


def _archived_kinds(run_dir: Path) -> dict[str, int]:
    from pipeline.audit.views import Audit

    with Audit(run_dir) as audit:
        _, rows = audit.query("SELECT kind, count(*) FROM events GROUP BY kind")
    return dict(rows)


def _restarted_trainer_continues(bootstrap: str, policy: object, run_id: str, log: Path, seed: int,
                                 timeout_s: float) -> list[TrainStepCompleted]:
    """After an actor trainer's restart: it publishes version 1 (trained before it went down), and step 2's episodes
    make version 2 from version 1's weights. Returns both train steps."""
    from pipeline.rl.synthetic import synthetic_trajectories

    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    _wait_for("version 1 published after the restart", lambda: len(_published(kafka, "actor")[1]) == 1, timeout_s,
              log)
    _send(bootstrap, synthetic_trajectories(policy, run_id=run_id, step=2, groups=2, group_size=4, seed=seed))
    _wait_for("version 2", lambda: len(_published(kafka, "actor")[1]) >= 2, timeout_s, log)
    policies, steps = _published(kafka, "actor")
    assert [p.version for p in policies] == [0, 1, 2]
    assert steps[1].weight_hash_before == steps[0].weight_hash_after
    return steps
