"""The bank worker through the harness: ops applied to the SQL bank with their position, snapshots published."""

from __future__ import annotations

import hashlib

import numpy as np
from harness_setup import RUN, settings_for

from infra.db import database_url, make_engine
from pipeline.bank.replay import replay
from pipeline.bank.store import BankStore
from pipeline.runtime.harness import RawRecord, build_worker, run_worker
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.codec import encode
from schemas.experiences import ExperienceAdded, ExperienceRefined
from schemas.topics import EXPERIENCE_OPS_TOPIC
from workers.bank import BankProjection

WHO = Producer(worker="extractor", instance="extractor-0")


def _ops() -> list:
    key = EmbeddingVector.from_array("all-MiniLM-L6-v2", np.array([1.0, 0.0, 0.0, 0.0]))
    added = [ExperienceAdded(run_id=RUN, producer=WHO, op_id=f"o{i}", experience_id=f"e{i}", task_family="room",
                             text=f"lesson {i}", key=key, generation_id=f"g{i}", extractor_version=0,
                             source_trajectory_ids=(f"t{i}",)) for i in range(3)]
    refined = ExperienceRefined(run_id=RUN, producer=WHO, op_id="o3", experience_id="e0", expected_version=1,
                                text="lesson 0, better", generation_id="g3", extractor_version=1,
                                source_trajectory_ids=("t3",))
    return [*added, refined, added[1]]  # the last is a re-delivery: a duplicate


def test_the_bank_applies_ops_keeps_its_position_and_publishes_snapshots(tmp_path):
    ops = _ops()
    worker, context = build_worker(BankProjection, settings_for(tmp_path))
    result = run_worker(worker, ops, context=context)
    store = BankStore(make_engine(database_url(context.settings.db, tmp_path)))
    position = store.position(EXPERIENCE_OPS_TOPIC.name, 0)
    clean = replay(enumerate(ops)).state
    assert position is not None and position.next_offset == len(ops)
    assert position.state_hash == clean.state_hash() == store.load_state().state_hash()
    assert store.experience("e0")["version"] == 2  # type: ignore[index]
    snapshots = [e for e in result.outputs if e.kind == "BankSnapshotWritten"]
    assert [s.next_offset for s in snapshots] == [2, 4]  # snapshot_every 2 ops
    assert snapshots[-1].state_hash == replay(enumerate(ops[:4])).state.state_hash()


def test_an_op_of_another_run_is_rejected_by_the_bank_and_by_its_replay(tmp_path):
    # Before: an op stamped with another run's id was applied to this run's bank.
    ops = _ops()[:2]
    foreign = ExperienceAdded(run_id="another-run", producer=WHO, op_id="o-foreign", experience_id="e-foreign",
                              task_family="room", text="planted", key=ops[0].key, generation_id="g-foreign",
                              extractor_version=0, source_trajectory_ids=("t9",))
    log = [ops[0], foreign, ops[1]]
    worker, context = build_worker(BankProjection, settings_for(tmp_path))
    result = run_worker(worker, log, context=context)
    assert result.dead_letters == []  # a recorded outcome of the bank, not bad input
    store = BankStore(make_engine(database_url(context.settings.db, tmp_path)))
    assert store.experience("e-foreign") is None and store.experience("e1") is not None
    assert worker.state.rejected == 1
    position = store.position(EXPERIENCE_OPS_TOPIC.name, 0)
    assert position is not None and position.next_offset == 3
    assert position.state_hash == replay(enumerate(log), run_id=RUN).state.state_hash() \
        == replay(enumerate(ops[:1] + ops[1:2]), run_id=RUN).state.state_hash()


def test_a_poison_record_with_a_large_key_is_dead_lettered_with_the_key_kept_by_claim_check(tmp_path):
    # Before: the key travelled inline in the dead letter, which then exceeded the payload cap; the worker crashed,
    # and crashed again on restart.
    big_key = bytes(range(256)) * 3000  # 768,000 bytes, under the broker's limit
    ops = _ops()[:2]
    worker, context = build_worker(BankProjection, settings_for(tmp_path))
    blobs = context.blobs
    result = run_worker(worker, [ops[0], RawRecord(EXPERIENCE_OPS_TOPIC.name, b"{}", key=big_key), ops[1]],
                        context=context, blobs=blobs)
    [letter] = result.dead_letters
    assert letter.source_key_b64 is None and letter.source_key_size == len(big_key)
    assert letter.source_key_sha256 == hashlib.sha256(big_key).hexdigest()
    assert blobs.get(letter.source_key_uri) == big_key
    assert len(encode(letter)) < 64 * 1024
    assert result.committed[(EXPERIENCE_OPS_TOPIC.name, 0)] == 3
    assert worker.state.applied == 2
