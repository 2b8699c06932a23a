"""A replay from wire bytes (decode, then the state machine's dispatch by op class) decides every op as applying
the ops themselves does, and ends at hashes pinned before the decode and apply paths were made faster.

Run: pytest tests/unit/bank/test_bank_replay_decoded.py
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

import numpy as np
import pytest
from experience_ops import add
from experience_ops import refine as refine_op

from pipeline.bank.replay import Checkpoint, replay
from pipeline.bank.state import Applied, BankState, Duplicate, Outcome, Rejected, _frozen_key, decode_op
from pipeline.bank.synthetic import synthetic_op_log
from pipeline.errors import InvalidArgumentError
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.codec import encode
from schemas.experiences import ExperienceAdded

WHO = Producer(worker="extractor", instance="extractor-0")


def apply_all(ops: list) -> tuple[BankState, list[Outcome]]:
    state = BankState()
    return state, [state.apply(op, offset) for offset, op in enumerate(ops)]


def test_a_synthetic_log_replayed_from_its_bytes_matches_the_pinned_outcomes_and_hash() -> None:
    # Outcomes from the code before this change (commit b232d3b), on the same log; the hash re-pinned when the
    # synthetic keys became the same on every CPU (they had depended on its BLAS kernels' float32 rounding).
    ops = synthetic_op_log(3000, seed=7)
    state, outcomes = apply_all([decode_op(encode(op)) for op in ops])
    assert (state.applied, state.duplicates, state.rejected) == (2468, 235, 263)
    rejected = [offset for offset, outcome in enumerate(outcomes) if isinstance(outcome, Rejected)]
    assert len(rejected) == 263 and rejected[:5] == [35, 36, 46, 50, 52]
    assert state.state_hash() == "c85d7fd0a68078042489512ff1c882ec84493670461d942a7072bc0599f83e74"
    # And exactly as the ops themselves, never through the wire, are decided: outcome by outcome, reasons included.
    live, live_outcomes = apply_all(ops)
    assert outcomes == live_outcomes
    assert live.state_hash() == state.state_hash()


def test_replay_takes_the_checkpoint_hash_of_the_decoded_log() -> None:
    ops = synthetic_op_log(600, seed=11)  # a merge with too few same-family sources is skipped: 587 ops
    wire = [encode(op) for op in ops]
    at_300, _ = apply_all(ops[:300])
    whole, _ = apply_all(ops)
    checkpoints = [Checkpoint("mid", 300, at_300.state_hash()), Checkpoint("end", len(ops), whole.state_hash())]
    result = replay(((offset, decode_op(data)) for offset, data in enumerate(wire)), checkpoints)
    assert result.ops == len(ops) == 587
    assert result.mismatches(checkpoints) == []
    assert result.hashes["mid"] != result.hashes["end"]


def test_the_hand_worked_log_through_the_wire_keeps_the_pinned_hash() -> None:
    # The log of test_bank_state.test_state_hash_is_pinned_and_ignores_counters, encoded and decoded first.
    refine = refine_op("o3", "e1", 1, "walk diagonally to >")
    ops = [add("o1", "e1", "go to the stairs"), add("o2", "e2", "avoid water", family="river"), refine,
           refine, add("o4", "e1", "again")]
    state, outcomes = apply_all([decode_op(encode(op)) for op in ops])
    assert outcomes == [Applied("o1", ("e1",)), Applied("o2", ("e2",)), Applied("o3", ("e1",)), Duplicate("o3"),
                        Rejected("o4", "experience e1 already exists")]
    assert state.state_hash() == "f81f7fcae3855f5dffde3d1c76a406d7fde996853370a17e49721b69361b87f5"


def test_a_decoded_key_is_kept_as_a_read_only_view_of_the_op_bytes() -> None:
    op = decode_op(encode(synthetic_op_log(1, seed=0)[0]))
    assert isinstance(op, ExperienceAdded)
    vector = _frozen_key(op.key)
    assert vector.dtype == np.dtype("<f2") and not vector.flags.writeable
    assert vector.tobytes() == op.key.data.packed  # type: ignore[attr-defined]
    built = EmbeddingVector.from_array("m", [0.5, 2.0])  # built in Python: a read-only float16 array too
    assert _frozen_key(built).tolist() == [0.5, 2.0] and not _frozen_key(built).flags.writeable


class PatchedAdded(ExperienceAdded):
    """A subclass of an op kind: not in the dispatch table by its own class."""

    kind: Literal["PatchedAdded"] = "PatchedAdded"  # type: ignore[assignment]


def test_a_subclass_of_an_op_kind_is_applied_as_its_kind_and_a_non_op_is_refused() -> None:
    op = ExperienceAdded(run_id="r", producer=WHO, op_id="o1", experience_id="e1", task_family="room", text="t",
                         key=EmbeddingVector.from_array("m", [1.0]), generation_id="g", extractor_version=0,
                         source_trajectory_ids=("t1",))
    sub = PatchedAdded(**{**op.model_dump(exclude={"kind"}), "op_id": "o2", "experience_id": "e2"})
    state, outcomes = apply_all([op, sub])
    assert outcomes == [Applied("o1", ("e1",)), Applied("o2", ("e2",))]
    assert state.experiences["e2"].history[0].op_kind == "PatchedAdded"
    with pytest.raises(InvalidArgumentError, match="not an experience op: SimpleNamespace"):
        BankState().apply(SimpleNamespace(run_id="r", op_id="o9"), 0)  # type: ignore[arg-type]
