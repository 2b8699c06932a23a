"""Parsed answers as events (`pipeline.extractor.ops`), hand-worked: which op each answer item becomes, with which
ids, expected versions and keys, what slides into the next merge chunk, FIFO evictions and the generation record."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.extractor.ops import (
    OpAuthor,
    Shown,
    distill_ops,
    eviction_ops,
    generation_event_id,
    generation_record,
    merge_ops,
    merged_key,
)
from pipeline.extractor.protocol import DistillOp, MergeOp
from pipeline.models.base import Generation
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.experiences import ExperienceAdded, ExperienceMerged, ExperienceRefined, ExperienceRetired
from schemas.trajectories import ExperienceRef, Timings, TrajectoryCompleted, Turn

AUTHOR = OpAuthor(run_id="r", producer=Producer(worker="extractor", instance="extractor-0"), extractor_version=3)
KEY = EmbeddingVector.from_array("m", [1.0, 0.0])
OTHER_KEY = EmbeddingVector.from_array("m", [0.0, 1.0])
SHOWN = [Shown("e-a", 2, "g-a", "Go east."), Shown("e-b", 1, "g-b", "Avoid walls.")]


def _trajectory() -> TrajectoryCompleted:
    turn = Turn(observation="o", prompt_token_ids=(1,), response_token_ids=(2,), sampling_logprobs=(-1.0,),
                response_text="x", action="east", valid=True, reward=1.0)
    return TrajectoryCompleted(
        run_id="r", producer=Producer(worker="rollout", instance="rollout-0"), trajectory_id="t7",
        assignment_event_id="a", step=4, split="train", env_id="MiniHack-Room-Random-5x5-v0",
        task_family="minihack-room", seed=0, group_id="g", slot=0, guided=True, goal="reach >", turns=(turn,),
        reward=1.0, success=True, num_actions=1, invalid_actions=0, truncated=False,
        timings=Timings(generation_s=0, env_s=0, retrieval_s=0), retrieved=(), policy_version=0)


def test_an_add_is_a_new_keyed_experience_and_a_refine_expects_the_version_shown():
    ops = distill_ops(AUTHOR, "r-t7", _trajectory(), SHOWN,
                      [DistillOp("add", "Walk to >."), DistillOp("refine", "Go east first.", alias=1)], KEY)
    add, refine = ops
    assert isinstance(add, ExperienceAdded) and isinstance(refine, ExperienceRefined)
    assert (add.op_id, add.experience_id, add.text, add.task_family, add.key) == (
        "r-t7-op0", "r-t7-e0", "Walk to >.", "minihack-room", KEY)
    assert (refine.op_id, refine.experience_id, refine.expected_version, refine.text) == (
        "r-t7-op1", "e-a", 2, "Go east first.")
    assert all(op.source_trajectory_ids == ("t7",) and op.extractor_version == 3 and op.generation_id == "r-t7"
               for op in ops)
    assert distill_ops(AUTHOR, "r-t7", _trajectory(), SHOWN, [], None) == []


def test_an_add_without_a_key_is_refused():
    with pytest.raises(ValueError, match="query embedding"):
        distill_ops(AUTHOR, "r-t7", _trajectory(), [], [DistillOp("add", "Walk to >.")], None)


def test_merge_ops_name_their_sources_and_the_newest_result_slides_on():
    members = [*SHOWN, Shown("e-c", 4, "g-c", "Stairs are >.")]
    parsed = [MergeOp("merge", (1, 3), "Go east to the >."), MergeOp("keep", (2,)),
              MergeOp("rewrite", (2,), "Walls block moves.")]
    ops, carry = merge_ops(AUTHOR, "m1-room-c000", "minihack-room", members, parsed, [OTHER_KEY])
    merged, rewritten = ops
    assert isinstance(merged, ExperienceMerged) and isinstance(rewritten, ExperienceRefined)
    assert (merged.op_id, merged.experience_id, merged.key, merged.text) == (
        "m1-room-c000-op0", "m1-room-c000-e0", OTHER_KEY, "Go east to the >.")
    assert [(s.experience_id, s.expected_version) for s in merged.sources] == [("e-a", 2), ("e-c", 4)]
    assert (rewritten.op_id, rewritten.experience_id, rewritten.expected_version) == ("m1-room-c000-op2", "e-b", 1)
    assert carry == Shown("e-b", 2, "m1-room-c000", "Walls block moves.")  # the last result: e-b at version 2

    ops, carry = merge_ops(AUTHOR, "g", "f", members, [MergeOp("discard", (3,))], [])
    assert [(type(op), op.experience_id, op.expected_version, op.reason) for op in ops] == [
        (ExperienceRetired, "e-c", 4, "merge_discard")]
    assert carry is None
    with pytest.raises(ValueError, match="1 merges need as many keys"):
        merge_ops(AUTHOR, "g", "f", members, parsed, [])


def test_a_merge_is_keyed_by_its_sources_mean_key_and_its_carry_keeps_that_key():
    # (1, 0) and (0, 1): mean (0.5, 0.5), norm sqrt(0.5), key (0.7071, 0.7071); cosine 0.7071 to either source.
    a, b = np.array([1.0, 0.0], dtype=np.float16), np.array([0.0, 1.0], dtype=np.float16)
    key = merged_key("m", [a, b])
    assert (key.model, key.dim) == ("m", 2) and key.to_numpy() == pytest.approx([0.70711, 0.70711], abs=1e-3)
    assert merged_key("m", [a, a]).to_numpy() == pytest.approx([1.0, 0.0]), "identical sources: their key"
    # three sources (1,0), (1,0), (0,1): mean (2/3, 1/3), norm sqrt(5)/3, key (2/sqrt5, 1/sqrt5) = (0.8944, 0.4472)
    assert merged_key("m", [a, a, b]).to_numpy() == pytest.approx([0.89443, 0.44721], abs=1e-3)
    with pytest.raises(ValueError, match="every source's key"):
        merged_key("m", [a, None])
    with pytest.raises(ValueError, match="cancel out"):
        merged_key("m", [a, -a])
    members = [Shown("e-a", 2, "g-a", "Go east.", a), Shown("e-b", 1, "g-b", "Go north.", b)]
    _ops, carry = merge_ops(AUTHOR, "g", "f", members, [MergeOp("merge", (1, 2), "Go east or north.")], [key])
    assert carry is not None and carry.key == pytest.approx(key.to_numpy())
    _ops, carry = merge_ops(AUTHOR, "g", "f", members, [MergeOp("rewrite", (2,), "Go north twice.")], [])
    assert carry is not None and carry.key is b, "a rewrite keeps its key"


def test_evictions_retire_the_oldest_beyond_capacity_counting_pending_adds():
    evicted = eviction_ops(AUTHOR, "r-t9", SHOWN, pending_adds=2, capacity=3)
    assert [(e.op_id, e.experience_id, e.expected_version, e.reason) for e in evicted] == [
        ("r-t9-evict0", "e-a", 2, "capacity")]
    assert eviction_ops(AUTHOR, "r-t9", SHOWN, pending_adds=1, capacity=3) == []


def test_the_generation_record_carries_tokens_shown_refs_status_and_op_ids():
    generation = Generation(prompt_token_ids=(5, 6), token_ids=(7, 8), text="<answer>[]</answer>",
                            logprobs=(-0.5, -0.25), finish_reason="stop")
    ops = distill_ops(AUTHOR, "r-t7", _trajectory(), SHOWN, [DistillOp("add", "Walk to >.")], KEY)
    record = generation_record(AUTHOR, "r-t7", "distill", "minihack-room", 4, ("t7",), SHOWN, generation, None, ops)
    assert record.event_id == generation_event_id("r-t7") and record.op_ids == ("r-t7-op0",)
    assert record.shown == (ExperienceRef(experience_id="e-a", version=2, generation_id="g-a"),
                            ExperienceRef(experience_id="e-b", version=1, generation_id="g-b"))
    assert (record.prompt_token_ids, record.response_token_ids, record.sampling_logprobs) == (
        (5, 6), (7, 8), (-0.5, -0.25))
    assert (record.parse_status, record.extractor_version, record.step) == ("ok", 3, 4)
    empty = generation_record(AUTHOR, "r-t7", "distill", "f", 4, ("t7",), [], generation, None, [])
    failed = generation_record(AUTHOR, "r-t7", "distill", "f", 4, ("t7",), [], generation, "no <answer>", [])
    assert (empty.parse_status, failed.parse_status, failed.parse_error) == ("no_op", "parse_error", "no <answer>")
