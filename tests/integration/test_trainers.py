"""Both trainers against a real broker: synthetic trajectories and generations in, policies and train steps out,
`crl replay train` reproduces every step, and a trainer killed between checkpoint and publish heals itself."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from worker_processes import (
    _archived_kinds,
    _env,
    _published,
    _replays_train,
    _restarted_trainer_continues,
    _send,
    _start,
    _stop,
    _wait_for,
)

from infra.kafka import KafkaSettings
from pipeline.models.checkpoints import load_checkpoint, manifest_sha256
from pipeline.rl.synthetic import synthetic_extractions, synthetic_trajectories

pytestmark = pytest.mark.integration

def test_actor_trainer_publishes_steps_that_replay_exactly(kafka_bootstrap, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    env = _env(kafka_bootstrap, tmp_path)
    log = tmp_path / "workers.log"
    archiver = _start("archiver", env, log)
    trainer = _start("actor_trainer", env, log)
    try:
        policies = _wait_for("actor version 0", lambda: _published(kafka, "actor")[0], 180, log)
        v0 = policies[0]
        assert v0.version == 0 and v0.sha256 == manifest_sha256(Path(v0.checkpoint_uri.removeprefix("file://")))
        policy = load_checkpoint(Path(v0.checkpoint_uri.removeprefix("file://")), v0.sha256).policy
        batches = {step: synthetic_trajectories(policy, run_id=tmp_path.name, step=step, groups=2, group_size=4,
                                                seed=3) for step in (0, 1, 2)}
        _send(kafka_bootstrap, [t for step in (0, 1, 2) for t in reversed(batches[step])])  # arrival order scrambled
        _, steps = _wait_for("two actor steps", lambda: (lambda p: p if len(p[1]) >= 2 else None)(
            _published(kafka, "actor")), 240, log)
        policies, steps = _published(kafka, "actor")
        assert [p.version for p in policies] == [0, 1, 2]
        assert [(s.step, s.policy_version) for s in steps] == [(1, 1), (2, 2)]  # step 0 was warm-up
        for step in steps:
            expected = sorted(batches[step.step], key=lambda t: (t.group_id, t.slot))
            assert step.batch_event_ids == tuple(str(t.event_id) for t in expected)
            assert step.tokens == sum(len(turn.response_token_ids) for t in expected for turn in t.turns)
            assert step.weight_hash_before != step.weight_hash_after
            assert step.loss_variant == "grpo" and step.aggregation == "token-mean"
            assert "train/clip_fraction" in step.metrics and "rollout/success_guided" in step.metrics
        assert steps[1].weight_hash_before == steps[0].weight_hash_after
        for published in policies:
            path = Path(published.checkpoint_uri.removeprefix("file://"))
            assert load_checkpoint(path, published.sha256).manifest["weight_hash"] == (
                steps[published.version - 1].weight_hash_after if published.version else steps[0].weight_hash_before)
        _wait_for("the archive", lambda: _archived_kinds(tmp_path).get("TrainStepCompleted", 0) >= 2, 60, log)
    finally:
        _stop(trainer)
        _stop(archiver)
    _replays_train(tmp_path, env, "actor", "actor: 2 steps replayed, every weight hash matches", timeout_s=300)


def test_extractor_trainer_credits_generations_and_rebuilds_its_join_after_restart(kafka_bootstrap, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    env = _env(kafka_bootstrap, tmp_path)
    log = tmp_path / "workers.log"
    archiver = _start("archiver", env, log)
    trainer = _start("extractor_trainer", env, log)
    try:
        policies = _wait_for("extractor version 0", lambda: _published(kafka, "extractor")[0], 180, log)
        extractor = load_checkpoint(Path(policies[0].checkpoint_uri.removeprefix("file://")), policies[0].sha256)
        generations = synthetic_extractions(extractor.policy, run_id=tmp_path.name, count=6, seed=1)
        served = [g.generation_id for g in generations[:4]]
        episodes = synthetic_trajectories(extractor.policy, run_id=tmp_path.name, step=1, groups=4, group_size=2,
                                          seed=5, served_generations=served)
        _send(kafka_bootstrap, [*episodes, *generations])  # outcomes may arrive before the generation they credit
        _wait_for("extractor step 1", lambda: _published(kafka, "extractor")[1], 240, log)
        first = _published(kafka, "extractor")[1][0]
        assert sorted(first.batch_event_ids) == sorted(str(g.event_id) for g in generations[:4])
        by_generation = {str(g.event_id): g.generation_id for g in generations}
        for event_id, reward, count in zip(first.batch_event_ids, first.rewards, first.outcome_counts, strict=True):
            credited = [1.0 if t.success else -1.0 for t in episodes
                        if any(r.generation_id == by_generation[event_id] for r in t.retrieved)]
            assert count == len(credited) and reward == pytest.approx(sum(credited) / len(credited))
        assert first.advantages == pytest.approx([r - sum(first.rewards) / 4 for r in first.rewards])

        # Restart: the join comes back from the log; nothing new, so no new step. New outcomes for 2 trained and 2
        # fresh generations make the next batch, where the retrained ones are weighted (1 + 1)^-0.5.
        _stop(trainer)
        trainer = _start("extractor_trainer", env, log)
        time.sleep(5)
        assert len(_published(kafka, "extractor")[1]) == 1
        more = synthetic_trajectories(extractor.policy, run_id=tmp_path.name, step=2, groups=4,
                                      group_size=2, seed=6, served_generations=[served[0], served[1],
                                                                                generations[4].generation_id,
                                                                                generations[5].generation_id])
        _send(kafka_bootstrap, more)
        _wait_for("extractor step 2", lambda: len(_published(kafka, "extractor")[1]) >= 2, 240, log)
        policies, steps = _published(kafka, "extractor")
        assert [p.version for p in policies] == [0, 1, 2] and [s.policy_version for s in steps] == [1, 2]
        second = steps[1]
        retrained = {str(generations[0].event_id), str(generations[1].event_id)}
        assert set(second.batch_event_ids) == retrained | {str(g.event_id) for g in generations[4:]}
        assert second.weight_hash_before == first.weight_hash_after
        _wait_for("the archive", lambda: _archived_kinds(tmp_path).get("TrainStepCompleted", 0) >= 2, 60, log)
    finally:
        _stop(trainer)
        _stop(archiver)
    _replays_train(tmp_path, env, "extractor", "extractor: 2 steps replayed, every weight hash matches", timeout_s=300)


def test_trainer_killed_between_checkpoint_and_publish_resumes_without_duplicate_or_gap(kafka_bootstrap, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    env = _env(kafka_bootstrap, tmp_path)
    log = tmp_path / "workers.log"
    # Dies the moment the first new version is written, before any of its events is published.
    die_before_publish = ("import os\nimport workers.actor_trainer as m\n"
                          "m.ActorTrainer.publish_version = lambda self, version, io: os._exit(9)")
    trainer = _start("actor_trainer", env, log, prelude=die_before_publish)
    try:
        policies = _wait_for("actor version 0", lambda: _published(kafka, "actor")[0], 180, log)
        policy = load_checkpoint(Path(policies[0].checkpoint_uri.removeprefix("file://")), policies[0].sha256).policy
        _send(kafka_bootstrap, synthetic_trajectories(policy, run_id=tmp_path.name, step=1, groups=2, group_size=4,
                                                      seed=9))
        assert trainer.wait(timeout=240) == 9
        assert (tmp_path / "checkpoints" / "actor" / "v000001" / "manifest.json").exists()
        assert [p.version for p in _published(kafka, "actor")[0]] == [0]
        trainer = _start("actor_trainer", env, log)
        _restarted_trainer_continues(kafka_bootstrap, policy, tmp_path.name, log, seed=9, timeout_s=240)
        time.sleep(2)
        assert [(s.step, s.policy_version) for s in _published(kafka, "actor")[1]] == [(1, 1), (2, 2)]
    finally:
        _stop(trainer)
