"""`crl run --broker kafka --brokers 3`: a three-node Apache Kafka cluster, one node SIGKILLed in the middle of the run.

The run carries on with no `--resume`: every assignment has exactly one trajectory, every actor version is there
once, nothing is dead-lettered, and both replays match. The topics were made with three replicas and
`min.insync.replicas=2`, which is what lets every write with acks=all land while one node is dead.
"""

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
from kafka.admin import ConfigResource, ConfigResourceType
from run_checks import assert_every_step_exactly_once

from infra.kafka import KafkaSettings, make_admin
from pipeline.audit.views import Audit

pytestmark = [pytest.mark.e2e, pytest.mark.apache_kafka, pytest.mark.timeout(2400)]

CRL = [sys.executable, "-m", "pipeline.cli"]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
GROUPS = 2
EPISODES = GROUPS * 4
KILLED_NODE = 2


@dataclass
class ClusterRun:
    run_dir: Path
    returncode: int
    output: str
    killed_pid: int
    bootstrap_servers: str
    topic_settings: dict[str, tuple[int, str]]  # topic -> (replicas, min.insync.replicas), read while it ran
    killed_at_version: int


def _actor_versions(run_dir: Path) -> int:
    log = run_dir / "logs" / "actor_trainer-0.log"
    return log.read_text().count("-> version ") if log.exists() else 0


def _topic_settings(bootstrap_servers: str) -> dict[str, tuple[int, str]]:
    admin = make_admin(KafkaSettings(bootstrap_servers=bootstrap_servers))
    try:
        names = [name for name in admin.list_topics() if name.startswith("crl.")]
        replicas = {item["name"]: len(item["partitions"][0]["replica_nodes"]) for item in admin.describe_topics(names)}
        described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name) for name in names])
        in_sync = {name: entries["min.insync.replicas"]["value"] for name, entries in described["topic"].items()}
        return {name: (replicas[name], in_sync[name]) for name in names}
    finally:
        admin.close()


@pytest.fixture(scope="module")
def cluster_run(kafka_jars, tmp_path_factory: pytest.TempPathFactory) -> ClusterRun:
    run_dir = tmp_path_factory.mktemp("cluster") / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "COLUMNS": "400", "CRL_ACTOR_TRAINER__WARMUP_STEPS": "1",
                "CRL_ACTOR_TRAINER__GROUP_SIZE": "4", "CRL_ACTOR_TRAINER__GROUPS_PER_STEP": str(GROUPS),
                "CRL_SCHEDULER__EVAL_EVERY": "0", "CRL_BROKER__KAFKA_HEAP_MB": "384"})
    command = [*CRL, "run", "configs/tiny-minihack-room.yaml", "--steps", str(STEPS), "--broker", "kafka",
               "--brokers", "3", "--run-dir", str(run_dir), "--no-report"]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        deadline = time.monotonic() + 1800  # a fresh machine computes the warm starts first
        while _actor_versions(run_dir) < 1:  # mid-run: the actor has trained a step, steps remain
            assert process.poll() is None, process.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "the actor trained no step in 30 minutes"
            time.sleep(0.5)
        broker = json.loads((run_dir / "broker.json").read_text())
        settings = _topic_settings(broker["bootstrap_servers"])
        killed_pid = broker["node_pids"][str(KILLED_NODE)]
        killed_at = _actor_versions(run_dir)
        os.kill(killed_pid, signal.SIGKILL)
        output, _ = process.communicate(timeout=1500)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return ClusterRun(run_dir, process.returncode, output, killed_pid, broker["bootstrap_servers"], settings,
                      killed_at)


def test_the_cluster_replicates_every_topic_three_ways_with_two_in_sync(cluster_run):
    assert len(cluster_run.bootstrap_servers.split(",")) == 3
    assert cluster_run.topic_settings and set(cluster_run.topic_settings.values()) == {(3, "2")}, \
        cluster_run.topic_settings


def test_a_run_that_loses_one_of_three_brokers_carries_on_to_the_end(cluster_run):
    assert cluster_run.returncode == 0, cluster_run.output[-4000:]
    flat = " ".join(cluster_run.output.split())
    assert f"broker node {KILLED_NODE} exited" in flat and "carries on with 2 of 3" in flat
    assert cluster_run.killed_at_version < STEPS - 1  # the kill fell in the middle: steps were left to train
    with Audit(cluster_run.run_dir) as audit:
        def rows(sql: str) -> list[tuple]:
            return audit.query(sql)[1]

        assert rows("SELECT status FROM run_finished") == [("completed",)]
        assert rows("SELECT count(*) FROM run_resumed") == [(0,)]
        assert_every_step_exactly_once(audit, STEPS, EPISODES)


def test_both_replays_match_after_the_broker_died(cluster_run):
    assert cluster_run.returncode == 0
    assert_replays_match(cluster_run.run_dir, run_env(), STEPS - 1)
