"""The trainers as two data-parallel gloo ranks under torchrun against a real broker: the actor trains two steps (the
extractor one) that record world size 2 and `crl replay train` reproduces on two local ranks; a rank SIGKILLed
mid-step makes the trainer exit non-zero without publishing the step, and a restart publishes every version once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from worker_processes import (
    CRL,
    _archived_kinds,
    _env,
    _published,
    _replays_train,
    _restarted_trainer_continues,
    _send,
    _stop,
    _wait_for,
)

from infra.kafka import KafkaSettings
from pipeline.models.checkpoints import load_checkpoint
from pipeline.rl.synthetic import synthetic_extractions, synthetic_trajectories

# The ranks above 0 never touch the broker, and rank 0 reads and publishes as the one-rank trainer does, whose tests
# (test_trainers.py) run on both brokers: one tier is enough here.
ONE_TIER = pytest.mark.parametrize("kafka_bootstrap", ["tansu"], indirect=True)

pytestmark = pytest.mark.integration

RANKS = 2
REPO = Path(__file__).resolve().parents[2]


def _start_ranks(worker: str, env: dict[str, str], log: Path, script: Path | None = None) -> subprocess.Popen:
    """`crl worker` as RANKS gloo ranks under torchrun (through `script` when given: the same, after a prelude)."""
    target = [str(script)] if script is not None else ["-m", "pipeline.cli", "worker", worker, "--instance",
                                                        f"{worker}-test"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS), *target]
    return subprocess.Popen(command, env={**env, f"CRL_{worker.upper()}__RANKS": str(RANKS)}, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT)


def _policy(kafka: KafkaSettings, log: Path):
    policies = _wait_for("actor version 0", lambda: _published(kafka, "actor")[0], 240, log)
    v0 = policies[0]  # type: ignore[index]
    return load_checkpoint(Path(v0.checkpoint_uri.removeprefix("file://")), v0.sha256).policy


@ONE_TIER
def test_two_ranks_train_steps_that_replay_on_two_ranks(kafka_bootstrap, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    # Collectives time out after 45 s, and the first batch comes a minute after version 0: rank 1 waits for it
    # that long only because rank 0 keeps it alive.
    env = {**_env(kafka_bootstrap, tmp_path), "CRL_ACTOR_TRAINER__RANK_TIMEOUT_S": "45"}
    log = tmp_path / "workers.log"
    archiver = subprocess.Popen([*CRL, "worker", "archiver"], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    trainer = _start_ranks("actor_trainer", env, log)
    try:
        policy = _policy(kafka, log)
        time.sleep(60)
        assert trainer.poll() is None, log.read_text()[-3000:]
        batches = {step: synthetic_trajectories(policy, run_id=tmp_path.name, step=step, groups=2, group_size=4,
                                                seed=3) for step in (0, 1, 2)}
        _send(kafka_bootstrap, [t for step in (0, 1, 2) for t in batches[step]])
        _wait_for("two actor steps", lambda: len(_published(kafka, "actor")[1]) >= 2, 300, log)
        policies, steps = _published(kafka, "actor")
        assert [p.version for p in policies] == [0, 1, 2]
        assert [(s.step, s.policy_version, s.world_size) for s in steps] == [(1, 1, 2), (2, 2, 2)]
        for step in steps:
            expected = sorted(batches[step.step], key=lambda t: (t.group_id, t.slot))
            assert step.batch_event_ids == tuple(str(t.event_id) for t in expected)
            assert step.tokens == sum(len(turn.response_token_ids) for t in expected for turn in t.turns)
            assert step.weight_hash_before != step.weight_hash_after
        assert steps[1].weight_hash_before == steps[0].weight_hash_after
        # Rank 1 took both steps with rank 0 (it logs each command it served and stops when rank 0 does).
        _wait_for("the archive", lambda: _archived_kinds(tmp_path).get("TrainStepCompleted", 0) >= 2, 60, log)
    finally:
        _stop(trainer)
        _stop(archiver)
    assert "actor_trainer rank 1 of 2 stopped after 2 steps" in log.read_text()
    _replays_train(tmp_path, env, "actor", "actor: 2 steps replayed, every weight hash matches (world size 2)")
    limited = subprocess.run([*CRL, "replay", "train", str(tmp_path), "--role", "actor", "--max-ranks", "1"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert limited.returncode == 2, limited.stdout + limited.stderr
    assert "cannot replay here after 0 matching steps" in limited.stderr
    assert "taken by 2 data-parallel ranks; this replay may start at most 1" in limited.stderr


@ONE_TIER
def test_two_extractor_ranks_train_a_step_that_replays_on_two_ranks(kafka_bootstrap, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    env = _env(kafka_bootstrap, tmp_path)
    log = tmp_path / "workers.log"
    archiver = subprocess.Popen([*CRL, "worker", "archiver"], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    trainer = _start_ranks("extractor_trainer", env, log)
    try:
        policies = _wait_for("extractor version 0", lambda: _published(kafka, "extractor")[0], 240, log)
        v0 = policies[0]  # type: ignore[index]
        extractor = load_checkpoint(Path(v0.checkpoint_uri.removeprefix("file://")), v0.sha256).policy
        generations = synthetic_extractions(extractor, run_id=tmp_path.name, count=6, seed=1)[:4]
        episodes = synthetic_trajectories(extractor, run_id=tmp_path.name, step=1, groups=4, group_size=2, seed=5,
                                          served_generations=[g.generation_id for g in generations])
        _send(kafka_bootstrap, [*episodes, *generations])
        _wait_for("extractor step 1", lambda: _published(kafka, "extractor")[1], 300, log)
        step = _published(kafka, "extractor")[1][0]
        assert (step.policy_version, step.world_size) == (1, 2)
        assert sorted(step.batch_event_ids) == sorted(str(g.event_id) for g in generations)
        assert step.weight_hash_before != step.weight_hash_after
        _wait_for("the archive", lambda: _archived_kinds(tmp_path).get("TrainStepCompleted", 0) >= 1, 60, log)
    finally:
        _stop(trainer)
        _stop(archiver)
    _replays_train(tmp_path, env, "extractor", "extractor: 1 steps replayed, every weight hash matches (world size 2)")


@ONE_TIER
def test_a_rank_killed_mid_step_fails_the_trainer_and_a_restart_resumes_without_duplicate_or_gap(
        kafka_bootstrap, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    env = _env(kafka_bootstrap, tmp_path)
    log = tmp_path / "workers.log"
    marker = tmp_path / "rank1-in-step"
    # Rank 1 announces itself once it is inside its shard of the first step, then stays there until it is killed.
    script = tmp_path / "rank1_waits_mid_step.py"
    script.write_text(  # a script's own folder leads sys.path, so the repository is put first as `-m` would
        f"import os, sys, time\nsys.path.insert(0, {str(REPO)!r})\nfrom pathlib import Path\n"
        "import pipeline.rl.policy_step as update\n"
        "original = update.accumulate_gradients\n"
        "def accumulate(*args, **kwargs):\n"
        f"    marker = Path({str(marker)!r})\n"
        "    if os.environ['RANK'] == '1' and not marker.exists():\n"
        "        marker.write_text(str(os.getpid()))\n"
        "        time.sleep(600)\n"
        "    return original(*args, **kwargs)\n"
        "update.accumulate_gradients = accumulate\n"
        "from pipeline.cli import main\nsys.argv = ['crl', 'worker', 'actor_trainer']\nmain()\n")
    trainer = _start_ranks("actor_trainer", env, log, script)
    try:
        policy = _policy(kafka, log)
        _send(kafka_bootstrap, synthetic_trajectories(policy, run_id=tmp_path.name, step=1, groups=2, group_size=4,
                                                      seed=3))
        _wait_for("rank 1 inside the step", lambda: marker.exists() and marker.read_text(), 240, log)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        code = trainer.wait(timeout=180)
        assert code != 0
        text = log.read_text()
        # Rank 0 had trained its shard and was summing the gradients with rank 1 when rank 1 died.
        assert ("RankFailedError: summing gradients: a rank of the 2-rank group failed, was killed or timed out"
                in text)
        assert "nothing of this step is published" in text
        assert not (tmp_path / "checkpoints" / "actor" / "v000001").exists()
        assert [p.version for p in _published(kafka, "actor")[0]] == [0]

        trainer = _start_ranks("actor_trainer", env, log)
        steps = _restarted_trainer_continues(kafka_bootstrap, policy, tmp_path.name, log, seed=3, timeout_s=300)
        assert [(s.step, s.policy_version, s.world_size) for s in steps] == [(1, 1, 2), (2, 2, 2)]
        assert all(s.weight_hash_before != s.weight_hash_after for s in steps)  # both steps moved the weights
    finally:
        _stop(trainer)
