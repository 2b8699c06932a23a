"""The bank worker through the harness: ops applied to the SQL bank with their position, snapshots published."""

from __future__ import annotations

import numpy as np
from harness_setup import RUN, settings_for

from infra.db import database_url, make_engine
from pipeline.bank.replay import replay
from pipeline.bank.store import BankStore
from pipeline.runtime.harness import build_worker, run_worker
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
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
