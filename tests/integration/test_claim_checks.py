"""A trajectory of 25 turns with 10,000-token prompts (~1.4 MB encoded, above the 1 MiB payload cap) goes through a
real broker as a claim check, the actor trainer trains a step on it, `crl replay train` reproduces that step
bit-exactly, and `crl audit` shows it whole. (The codec's own tests take 40 such turns; a turn fewer here is a
forward and backward pass of a 10,000-token prompt less, twice: in the trainer and in the replay.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from kafka import KafkaProducer
from worker_processes import CRL, _env, _replays_train, _start, _stop, _wait_for

from infra.kafka import KafkaSettings
from pipeline.models.checkpoints import load_checkpoint
from pipeline.rl.synthetic import synthetic_trajectories
from pipeline.runtime.blobs import BlobStore
from pipeline.runtime.log import read_to_end
from schemas.codec import DEFAULT_CLAIM_CHECK_BYTES, DEFAULT_MAX_PAYLOAD_BYTES, ClaimChecks, encode
from schemas.topics import POLICY, TRAIN_STEPS, topic_of
from schemas.training import PolicyPublished, TrainStepCompleted
from schemas.trajectories import TrajectoryCompleted, Turn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

TURNS = 25
PROMPT_TOKENS = 10_000


def _long(trajectory: TrajectoryCompleted, vocabulary: int) -> TrajectoryCompleted:
    """`trajectory` stretched to `TURNS` turns whose prompts are `PROMPT_TOKENS` long (its own tokens, repeated)."""
    first = trajectory.turns[0]
    turns = []
    for t in range(TURNS):
        prompt = tuple((first.prompt_token_ids[i % len(first.prompt_token_ids)] + t * 7 + i) % vocabulary
                       for i in range(PROMPT_TOKENS))
        turns.append(Turn.model_validate(first.model_dump() | {"prompt_token_ids": prompt,
                                                               "observation": f"turn {t}"}))
    return TrajectoryCompleted.model_validate(trajectory.model_dump() | {"turns": turns, "num_actions": TURNS})


def _rows(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.strip()]


@pytest.mark.parametrize("kafka_bootstrap", ["tansu"], indirect=True)  # the broker carries a small record: one tier
def test_a_trajectory_of_ten_thousand_token_prompts_past_the_payload_cap_trains_replays_and_shows_in_the_audit(
        kafka_bootstrap, tmp_path):
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    env = _env(kafka_bootstrap, tmp_path) | {"CRL_ACTOR_TRAINER__MICRO_BATCH_SIZE": "1",
                                             "CRL_ACTOR_TRAINER__THREADS": "2"}
    log = tmp_path / "workers.log"
    archiver = _start("archiver", env, log)
    trainer = _start("actor_trainer", env, log)
    claims = ClaimChecks(BlobStore(tmp_path / "blobs"), DEFAULT_CLAIM_CHECK_BYTES)  # what a rollout worker uses
    try:
        v0 = _wait_for("actor version 0", lambda: [
            p for p in read_to_end(kafka, POLICY) if isinstance(p, PolicyPublished) and p.role == "actor"], 180, log)[0]
        policy = load_checkpoint(Path(v0.checkpoint_uri.removeprefix("file://")), v0.sha256).policy
        vocabulary = len(policy.tokenizer)
        batches = {step: synthetic_trajectories(policy, run_id=tmp_path.name, step=step, groups=2, group_size=4,
                                                seed=5) for step in (0, 1)}
        # Slot 0 of group 0 of step 1 becomes the long one, with the outcome slot 1 did not have: the two guided slots
        # of the group differ, so its advantage is nonzero and every one of its turns is trained on.
        success = not batches[1][1].success
        long = _long(batches[1][0].model_copy(update={"success": success, "reward": float(success),
                                                      "truncated": not success}), vocabulary)
        batches[1][0] = long
        inline = len(encode(long, max_bytes=1 << 30))
        records = {}
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=5)
        for event in batches[0] + batches[1]:
            topic = topic_of(event)
            records[event.event_id] = encode(event, claims=claims)
            producer.send(topic.name, key=topic.key_bytes(event), value=records[event.event_id])
        producer.flush()
        producer.close()
        claimed = json.loads(records[long.event_id])
        assert inline > DEFAULT_MAX_PAYLOAD_BYTES and "claim_check" in claimed
        assert len(records[long.event_id]) < 16 * 1024
        step = _wait_for("the actor's step 1", lambda: next(
            (s for s in read_to_end(kafka, TRAIN_STEPS) if isinstance(s, TrainStepCompleted) and s.role == "actor"
             and s.step == 1), None), 900, log)
        assert str(long.event_id) in step.batch_event_ids
        expected = sorted(batches[1], key=lambda t: (t.group_id, t.slot))
        assert step.tokens == sum(len(turn.response_token_ids) for t in expected for turn in t.turns)
        assert step.weight_hash_before != step.weight_hash_after

        def archived() -> bool:
            audit = subprocess.run([*CRL, "audit", "sql", str(tmp_path), "--format", "json",
                                    "SELECT count(*) AS n FROM train_steps WHERE role = 'actor' AND step = 1"],
                                   env=env, capture_output=True, text=True, timeout=120)
            return audit.returncode == 0 and _rows(audit.stdout) == [{"n": 1}]

        _wait_for("the archive", archived, 120, log)
    finally:
        _stop(trainer)
        _stop(archiver)
    shown = subprocess.run([*CRL, "audit", "sql", str(tmp_path), "--format", "json",
                            "SELECT turns, response_tokens FROM trajectories WHERE trajectory_id = "
                            f"'{long.trajectory_id}'"], env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert _rows(shown.stdout) == [{"turns": TURNS, "response_tokens": TURNS * len(long.turns[0].response_token_ids)}]
    _replays_train(tmp_path, env, "actor", "actor: 1 steps replayed, every weight hash matches", timeout_s=900)
