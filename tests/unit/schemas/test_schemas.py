"""Event schemas and the codec: round trips, immutability, compact arrays, validation and decode errors.

No broker: events go through `schemas.codec.encode` / `decode` in memory.

Run: pytest tests/unit/schemas/test_schemas.py
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import pickle
import struct
from typing import Any, Literal, get_args

import numpy as np
import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from schemas.arrays import EmbeddingVector, Float16s, LogProbs, TokenIds
from schemas.base import Event, Producer
from schemas.codec import (
    EventDecodeError,
    InvalidEventError,
    MalformedPayloadError,
    PayloadTooLargeError,
    SchemaVersionError,
    WrongTopicError,
    decode,
    describe_validation_error,
    encode,
    encode_for_topic,
)
from schemas.examples import example_events
from schemas.experiences import VersionedExperience
from schemas.runs import RunStarted
from schemas.topics import DEAD_LETTERS, EVENT_TYPES, RUNS, TRAJECTORIES, topic_of
from schemas.trajectories import ExperienceRef, Turn

LOG_PROBS: TypeAdapter[Any] = TypeAdapter(LogProbs)

EXAMPLES: dict[str, Event] = {event.kind: event for event in example_events()}


def rebuilt(kind: str, **changes: Any) -> Event:
    """The example of `kind` built again from Python values with `changes` applied (validation runs again)."""
    event = EXAMPLES[kind]
    return type(event)(**{**event.model_dump(), **changes})


def wire_payload(kind: str) -> dict[str, Any]:
    """The example of `kind` as the JSON dict a consumer reads off the wire."""
    return json.loads(encode(EXAMPLES[kind]))


def turn(**changes: Any) -> Turn:
    base = {
        "observation": "You see a wall.",
        "prompt_token_ids": (1, 2, 3),
        "response_token_ids": (4, 5),
        "sampling_logprobs": (-0.5, -1.25),
        "response_text": "north",
        "action": "north",
        "valid": True,
        "reward": 0.0,
    }
    return Turn(**{**base, **changes})


# --- round trip -------------------------------------------------------------------------------------------------


def test_examples_cover_exactly_the_registered_kinds() -> None:
    kinds = [event.kind for event in example_events()]
    assert len(kinds) == len(set(kinds)), "one example per kind"
    assert set(kinds) == set(EVENT_TYPES)


@pytest.mark.parametrize("event", example_events(), ids=lambda event: event.kind)
def test_every_event_kind_round_trips_exactly(event: Event) -> None:
    data = encode(event)
    decoded = decode(topic_of(event), data)
    assert decoded == event
    assert type(decoded) is type(event)
    assert encode(decoded) == data


def test_decode_preserves_arrays_and_timestamps_of_a_trajectory() -> None:
    event = EXAMPLES["TrajectoryCompleted"]
    decoded = decode(TRAJECTORIES, encode(event))
    assert decoded.turns[0].response_token_ids == (41, 9)
    assert decoded.turns[0].sampling_logprobs == (float(np.float32(-0.105)), -2.5)
    assert decoded.turns[1].prompt_token_ids == (5, 17, 301, 2)
    assert decoded.occurred_at == event.occurred_at
    assert decoded.event_id == event.event_id
    assert decoded.retrieved == (ExperienceRef(experience_id="exp-1", version=2, generation_id="gen-7"),)


def test_encode_for_topic_returns_topic_key_and_value() -> None:
    event = EXAMPLES["EpisodeAssigned"]
    topic, key, value = encode_for_topic(event)
    assert topic is topic_of(event)
    assert key == b"step1-task0"
    assert value == encode(event)


# --- every event class -------------------------------------------------------------------------------------------

EVENT_CLASSES = sorted(EVENT_TYPES.items())


@pytest.mark.parametrize(("kind", "cls"), EVENT_CLASSES, ids=[kind for kind, _ in EVENT_CLASSES])
def test_event_is_frozen(kind: str, cls: type[Event]) -> None:
    event = EXAMPLES[kind]
    with pytest.raises(ValidationError, match="frozen"):
        event.run_id = "another-run"  # type: ignore[misc]
    assert event.run_id == "example-run"


@pytest.mark.parametrize(("kind", "cls"), EVENT_CLASSES, ids=[kind for kind, _ in EVENT_CLASSES])
def test_event_forbids_unknown_fields(kind: str, cls: type[Event]) -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted") as excinfo:
        cls(**EXAMPLES[kind].model_dump(), surprise_field=1)
    assert [error["loc"] for error in excinfo.value.errors()] == [("surprise_field",)]


@pytest.mark.parametrize(("kind", "cls"), EVENT_CLASSES, ids=[kind for kind, _ in EVENT_CLASSES])
def test_event_kind_is_a_literal_of_the_class_name(kind: str, cls: type[Event]) -> None:
    assert kind == cls.__name__
    assert get_args(cls.model_fields["kind"].annotation) == (cls.__name__,)
    assert EXAMPLES[kind].kind == cls.__name__
    with pytest.raises(ValidationError):
        cls(**{**EXAMPLES[kind].model_dump(), "kind": "SomethingElse"})


@pytest.mark.parametrize(("kind", "cls"), EVENT_CLASSES, ids=[kind for kind, _ in EVENT_CLASSES])
def test_event_schema_version_is_the_current_version(kind: str, cls: type[Event]) -> None:
    expected = 2 if kind in ("DeadLetter", "TrajectoryCompleted") else 1
    assert cls.current_version() == expected
    assert EXAMPLES[kind].schema_version == expected
    with pytest.raises(ValidationError):
        cls(**{**EXAMPLES[kind].model_dump(), "schema_version": expected + 1})


def test_event_subclass_with_a_wrong_kind_literal_is_refused_at_class_creation() -> None:
    with pytest.raises(TypeError, match=r"Misnamed.kind must be Literal\['Misnamed'\]"):

        class Misnamed(Event):
            kind: Literal["SomethingElse"] = "SomethingElse"
            schema_version: Literal[1] = 1


# --- compact arrays ----------------------------------------------------------------------------------------------


class Arrays(BaseModel):
    ids: TokenIds = ()
    logprobs: LogProbs = ()
    halves: Float16s = ()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def test_arrays_serialise_to_base64_of_little_endian_machine_arrays() -> None:
    arrays = Arrays(ids=[1, 2, 2**31 - 1], logprobs=[-0.1, -2.5], halves=[0.5, -1.0])
    assert arrays.model_dump(mode="json") == {
        "ids": b64(struct.pack("<3i", 1, 2, 2**31 - 1)),
        "logprobs": b64(struct.pack("<2f", -0.1, -2.5)),
        "halves": b64(struct.pack("<2e", 0.5, -1.0)),
    }
    # Python mode keeps plain tuples.
    assert arrays.model_dump() == {"ids": (1, 2, 2**31 - 1), "logprobs": (float(np.float32(-0.1)), -2.5),
                                   "halves": (0.5, -1.0)}


def test_arrays_decode_back_exactly_from_json() -> None:
    arrays = Arrays(ids=(0, 7, 50_000), logprobs=(-0.1, -1e-7, -30.123), halves=(0.1, 3.14159))
    again = Arrays.model_validate_json(arrays.model_dump_json())
    assert again == arrays
    assert again.ids == (0, 7, 50_000)
    assert again.logprobs == tuple(float(np.float32(x)) for x in (-0.1, -1e-7, -30.123))
    assert again.halves == tuple(float(np.float16(x)) for x in (0.1, 3.14159))


def test_logprobs_are_quantised_to_float32_on_construction() -> None:
    arrays = Arrays(logprobs=[-0.1])
    assert arrays.logprobs == (float(np.float32(-0.1)),)
    assert arrays.logprobs != (-0.1,)
    assert turn(sampling_logprobs=(-0.1, -0.2)).sampling_logprobs == (float(np.float32(-0.1)),
                                                                      float(np.float32(-0.2)))


def test_empty_arrays_are_empty_tuples_and_empty_base64() -> None:
    arrays = Arrays(ids=[], logprobs=[], halves=[])
    assert arrays.model_dump(mode="json") == {"ids": "", "logprobs": "", "halves": ""}
    assert Arrays.model_validate_json(arrays.model_dump_json()) == Arrays()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([-1], r"\[0, 2\*\*31\)"),
        ([2**31], r"\[0, 2\*\*31\)"),
        ([1.5], "flat sequence of integers"),
        ([1.0, 2.0], "flat sequence of integers"),
        ([True, False], "flat sequence of integers"),
        ([[1, 2], [3, 4]], "flat sequence of integers"),
        (7, "flat sequence of integers"),
        (b64(struct.pack("<i", -1)), r"\[0, 2\*\*31\)"),
    ],
    ids=["negative", "over-int32", "fraction", "float", "bool", "nested", "scalar", "negative-base64"],
)
def test_token_ids_reject(value: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Arrays(ids=value)


@pytest.mark.parametrize(
    ("field", "text", "message"),
    [
        ("ids", b64(b"\x01\x00"), "2 bytes is not a whole number of <i4 items"),
        ("logprobs", b64(b"\x00" * 6), "6 bytes is not a whole number of <f4 items"),
        ("halves", b64(b"\x00" * 3), "3 bytes is not a whole number of <f2 items"),
        ("ids", "@@@@", "not valid base64"),
        ("logprobs", "AAA", "not valid base64"),
    ],
    ids=["ids-2-bytes", "logprobs-6-bytes", "halves-3-bytes", "ids-bad-alphabet", "logprobs-bad-padding"],
)
def test_base64_of_a_wrong_length_or_alphabet_is_rejected(field: str, text: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Arrays(**{field: text})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_float_arrays_reject_nan_and_inf_in_python_and_on_the_wire(bad: float) -> None:
    with pytest.raises(ValidationError, match="NaN or infinite"):
        Arrays(logprobs=[-0.5, bad])
    with pytest.raises(ValidationError, match="NaN or infinite"):
        Arrays(halves=[bad])
    with pytest.raises(ValidationError, match="NaN or infinite"):
        Arrays(logprobs=b64(struct.pack("<2f", -0.5, bad)))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float16_overflow_is_rejected() -> None:
    with pytest.raises(ValidationError, match="overflow"):
        Arrays(halves=[70000.0])
    assert Arrays(halves=[65504.0]).halves == (65504.0,)


def test_embedding_vector_rejects_a_dimension_mismatch() -> None:
    with pytest.raises(ValidationError, match="vector has 3 components but dim says 4"):
        EmbeddingVector(model="m", dim=4, data=[0.1, 0.2, 0.3])
    with pytest.raises(ValidationError):
        EmbeddingVector(model="", dim=1, data=[0.1])
    with pytest.raises(ValidationError):
        EmbeddingVector(model="m", dim=0, data=[])


def test_embedding_vector_from_array_and_to_numpy_quantise_to_float16() -> None:
    source = np.array([0.1, -0.2, 3.14159, 1000.5, -1e-3], dtype=np.float32)
    vector = EmbeddingVector.from_array("all-MiniLM-L6-v2", source)
    assert vector.model == "all-MiniLM-L6-v2"
    assert vector.dim == 5
    assert vector.data == tuple(float(np.float16(x)) for x in source)
    array = vector.to_numpy()
    assert array.dtype == np.float32
    assert array.shape == (5,)
    np.testing.assert_array_equal(array, source.astype(np.float16).astype(np.float32))
    # JSON round trip is exact, and a second quantisation changes nothing.
    assert EmbeddingVector.model_validate_json(vector.model_dump_json()) == vector
    assert EmbeddingVector.from_array("all-MiniLM-L6-v2", array) == vector
    assert vector.model_dump(mode="json")["data"] == b64(source.astype("<f2").tobytes())


def test_validated_floats_act_as_tuples_and_keep_their_wire_bytes() -> None:
    source = np.array([0.5, -0.25, 2.0, 1e-3], dtype=np.float32)
    vector = EmbeddingVector.from_array("m", source)
    wire = EmbeddingVector.model_validate_json(vector.model_dump_json())
    plain = tuple(float(np.float16(x)) for x in source)
    for made in (vector, wire):
        # Equal and hashing alike to the plain tuple, so events compare and hash as before.
        assert made.data == plain and plain == made.data and hash(made.data) == hash(plain)
        assert made.data != list(plain) and made.data != plain[:3] and made.data != (*plain[:3], 0.75)
        assert tuple(made.data) == plain and list(made.data) == list(plain) and len(made.data) == 4
        assert made.data[1] == -0.25 and made.data[1:3] == (-0.25, 2.0) and repr(made.data) == repr(plain)
        assert np.asarray(made.data, dtype=np.float64).tolist() == list(plain)  # a writable copy
        view = made.float16()  # the packed bytes themselves: no copy, not writable
        assert view.dtype == np.dtype("<f2") and not view.flags.writeable
        np.testing.assert_array_equal(view, source.astype("<f2"))
    assert wire == vector and hash(wire) == hash(vector)
    assert pickle.loads(pickle.dumps(wire)) == wire
    assert pickle.loads(pickle.dumps(wire)).float16().tobytes() == source.astype("<f2").tobytes()
    # Built without validation it still answers, by converting.
    unchecked = EmbeddingVector.model_construct(model="m", dim=4, data=plain)
    np.testing.assert_array_equal(unchecked.float16(), view)
    # Log-probs too keep their float32 bytes, and encode from them.
    turn_logprobs = LOG_PROBS.validate_python([-0.5, -1.25])
    assert turn_logprobs == (-0.5, -1.25) and turn_logprobs.as_array().dtype == np.dtype("<f4")
    assert turn_logprobs == EmbeddingVector.from_array("m", np.array([-0.5, -1.25])).data  # other bytes, same values
    assert sum(turn_logprobs) == -1.75
    assert LOG_PROBS.dump_json(turn_logprobs) == json.dumps(b64(np.array([-0.5, -1.25], "<f4").tobytes())
                                                                   ).encode()


def test_embedding_vector_from_array_flattens() -> None:
    vector = EmbeddingVector.from_array("m", np.arange(6, dtype=np.float32).reshape(2, 3))
    assert vector.dim == 6
    assert vector.data == (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)


# --- validation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_trajectory_reward_must_be_finite_in_python(bad: float) -> None:
    with pytest.raises(ValidationError, match="finite number") as excinfo:
        rebuilt("TrajectoryCompleted", reward=bad)
    assert [error["loc"] for error in excinfo.value.errors()] == [("reward",)]


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_trajectory_reward_must_be_finite_on_the_wire(literal: bytes) -> None:
    data = encode(EXAMPLES["TrajectoryCompleted"]).replace(b'"reward":1.0', b'"reward":' + literal)
    assert literal in data
    with pytest.raises(InvalidEventError, match="reward: Input should be a finite number"):
        decode(TRAJECTORIES, data)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_turn_sampling_logprobs_must_be_finite(bad: float) -> None:
    with pytest.raises(ValidationError, match="NaN or infinite"):
        turn(sampling_logprobs=(-0.5, bad))
    with pytest.raises(ValidationError, match="finite number"):
        turn(reward=bad)


def test_nan_logprob_in_a_wire_turn_is_reported_with_its_path() -> None:
    payload = wire_payload("TrajectoryCompleted")
    payload["turns"][1]["sampling_logprobs"] = [math.nan]
    data = json.dumps(payload).encode()
    assert b"NaN" in data
    with pytest.raises(InvalidEventError, match=r"turns\.1\.sampling_logprobs: .*NaN or infinite"):
        decode(TRAJECTORIES, data)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_extraction_sampling_logprobs_must_be_finite(bad: float) -> None:
    with pytest.raises(ValidationError, match="NaN or infinite"):
        rebuilt("ExtractionGenerated", sampling_logprobs=(-0.5, bad, -1.0))


def test_train_step_metrics_and_loss_must_be_finite() -> None:
    with pytest.raises(ValidationError, match="finite number") as excinfo:
        rebuilt("TrainStepCompleted", metrics={"train/clip_fraction": math.nan})
    assert excinfo.value.errors()[0]["loc"] == ("metrics", "train/clip_fraction")
    with pytest.raises(ValidationError, match="finite number"):
        rebuilt("TrainStepCompleted", metrics={"train/kl": math.inf})
    with pytest.raises(ValidationError, match="finite number") as excinfo:
        rebuilt("TrainStepCompleted", loss=math.nan)
    assert excinfo.value.errors()[0]["loc"] == ("loss",)


def test_a_train_step_written_before_world_size_decodes_as_one_rank() -> None:
    payload = wire_payload("TrainStepCompleted")
    del payload["world_size"]  # what a trainer wrote before data-parallel training existed
    event = decode(topic_of(EXAMPLES["TrainStepCompleted"]), json.dumps(payload).encode())
    assert event.world_size == 1 and event.schema_version == 1  # type: ignore[attr-defined]
    assert rebuilt("TrainStepCompleted", world_size=4).world_size == 4  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        rebuilt("TrainStepCompleted", world_size=0)


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("RunStarted", "run_id", ""),
        ("RunStarted", "run_id", "my run"),
        ("EpisodeAssigned", "group_id", ""),
        ("TrajectoryCompleted", "group_id", ""),
        ("TrajectoryCompleted", "group_id", "step1\ttask0"),
        ("ExperienceAdded", "experience_id", ""),
        ("ExperienceAdded", "experience_id", "exp 2"),
        ("ExperienceRetired", "experience_id", "exp-3\n"),
        ("ExperienceAdded", "op_id", "x" * 257),
    ],
    ids=["run-empty", "run-space", "group-empty", "traj-group-empty", "group-tab", "exp-empty", "exp-space",
         "exp-newline", "op-too-long"],
)
def test_ids_must_be_non_empty_without_whitespace(kind: str, field: str, value: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        rebuilt(kind, **{field: value})
    assert [error["loc"] for error in excinfo.value.errors()] == [(field,)]


def test_producer_ids_are_checked_too() -> None:
    with pytest.raises(ValidationError) as excinfo:
        rebuilt("RunFinished", producer={"worker": "", "instance": "rollout 0"})
    assert {error["loc"] for error in excinfo.value.errors()} == {("producer", "worker"), ("producer", "instance")}


def test_sampling_logprobs_need_one_value_per_response_token() -> None:
    with pytest.raises(ValidationError, match="1 sampling log-probs for 2 response tokens"):
        turn(sampling_logprobs=(-0.5,))
    with pytest.raises(ValidationError, match="2 sampling log-probs for 3 response tokens"):
        rebuilt("ExtractionGenerated", sampling_logprobs=(-0.5, -0.25))


def test_free_trajectory_cannot_carry_retrieved_experiences() -> None:
    with pytest.raises(ValidationError, match="free \\(unguided\\) episode cannot carry retrieved"):
        rebuilt("TrajectoryCompleted", guided=False)
    free = rebuilt("TrajectoryCompleted", guided=False, retrieved=(), bank_offset=None)
    assert free.guided is False and free.retrieved == ()


def test_retrieved_experiences_need_a_bank_offset() -> None:
    with pytest.raises(ValidationError, match="bank_offset is required"):
        rebuilt("TrajectoryCompleted", bank_offset=None)


def test_invalid_actions_cannot_exceed_actions() -> None:
    with pytest.raises(ValidationError, match="invalid_actions cannot exceed num_actions"):
        rebuilt("TrajectoryCompleted", num_actions=2, invalid_actions=3)


@pytest.mark.parametrize(("slot", "group_size"), [(4, 4), (5, 4), (0, 0)])
def test_episode_slot_must_lie_inside_its_group(slot: int, group_size: int) -> None:
    with pytest.raises(ValidationError):
        rebuilt("EpisodeAssigned", slot=slot, group_size=group_size)
    assert rebuilt("EpisodeAssigned", slot=3, group_size=4).slot == 3


def test_episode_slot_message_names_slot_and_group() -> None:
    with pytest.raises(ValidationError, match="slot 4 is outside a group of 4"):
        rebuilt("EpisodeAssigned", slot=4, group_size=4)


def test_merge_rejects_duplicate_sources() -> None:
    twice = (VersionedExperience(experience_id="exp-1", expected_version=3),
             VersionedExperience(experience_id="exp-1", expected_version=4))
    with pytest.raises(ValidationError, match="same source twice"):
        rebuilt("ExperienceMerged", sources=twice)


def test_merge_needs_at_least_two_sources() -> None:
    with pytest.raises(ValidationError, match="at least 2 items") as excinfo:
        rebuilt("ExperienceMerged", sources=(VersionedExperience(experience_id="exp-1", expected_version=3),))
    assert excinfo.value.errors()[0]["loc"] == ("sources",)


def test_merge_needs_a_new_id() -> None:
    with pytest.raises(ValidationError, match="needs a new id"):
        rebuilt("ExperienceMerged", experience_id="exp-2")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"parse_status": "ok", "op_ids": ()}, "op_ids are non-empty exactly when parse_status is 'ok'"),
        ({"parse_status": "no_op"}, "op_ids are non-empty exactly when parse_status is 'ok'"),
        ({"parse_status": "parse_error", "op_ids": ()}, "parse_error is set exactly when"),
        ({"parse_error": "unbalanced tags"}, "parse_error is set exactly when"),
        ({"parse_status": "parse_error", "parse_error": "bad json"}, "op_ids are non-empty exactly when"),
    ],
    ids=["ok-without-ops", "no-op-with-ops", "parse-error-without-reason", "ok-with-reason", "parse-error-with-ops"],
)
def test_extraction_status_and_op_ids_must_agree(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        rebuilt("ExtractionGenerated", **changes)


def test_consistent_extraction_statuses_are_accepted() -> None:
    assert rebuilt("ExtractionGenerated", parse_status="no_op", op_ids=()).op_ids == ()
    failed = rebuilt("ExtractionGenerated", parse_status="parse_error", parse_error="no <answer>", op_ids=())
    assert failed.parse_error == "no <answer>"


def test_dead_letter_keeps_exactly_one_copy_of_the_raw_bytes() -> None:
    with pytest.raises(ValidationError, match="exactly one of raw_b64"):
        rebuilt("DeadLetter", raw_uri="file:///runs/r/blobs/abc")
    with pytest.raises(ValidationError, match="exactly one of raw_b64"):
        rebuilt("DeadLetter", raw_b64=None)
    claim_check = rebuilt("DeadLetter", raw_b64=None, raw_uri="file:///runs/r/blobs/abc", raw_size=2_000_000)
    assert decode(DEAD_LETTERS, encode(claim_check)) == claim_check


def test_dead_letter_raw_size_must_match_inline_bytes() -> None:
    with pytest.raises(ValidationError, match="raw_size does not match raw_b64"):
        rebuilt("DeadLetter", raw_size=9)


@pytest.mark.parametrize(
    ("kind", "field"),
    [("PolicyPublished", "sha256"), ("TrainStepCompleted", "weight_hash_before"),
     ("TrainStepCompleted", "weight_hash_after"), ("BankSnapshotWritten", "state_hash"), ("DeadLetter", "raw_sha256")],
)
@pytest.mark.parametrize(
    "bad",
    [hashlib.sha256(b"x").hexdigest().upper(), hashlib.sha256(b"x").hexdigest()[:63],
     hashlib.sha256(b"x").hexdigest() + "0", "g" * 64, "", hashlib.sha256(b"x").hexdigest() + "\n"],
    ids=["uppercase", "63-chars", "65-chars", "not-hex", "empty", "trailing-newline"],
)
def test_sha256_fields_need_64_lowercase_hex_characters(kind: str, field: str, bad: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        rebuilt(kind, **{field: bad})
    assert [error["loc"] for error in excinfo.value.errors()] == [(field,)]


# --- codec errors ------------------------------------------------------------------------------------------------


def test_decode_errors_form_one_hierarchy() -> None:
    for error in (PayloadTooLargeError, MalformedPayloadError, WrongTopicError, SchemaVersionError,
                  InvalidEventError):
        assert issubclass(error, EventDecodeError)
    assert issubclass(EventDecodeError, ValueError)


def test_decode_rejects_a_record_over_the_cap() -> None:
    cap = 64
    with pytest.raises(PayloadTooLargeError, match="record is 65 bytes, over the 64-byte payload cap"):
        decode(RUNS, b"x" * (cap + 1), max_bytes=cap)
    # Exactly at the cap passes the size check and fails later, on parsing.
    with pytest.raises(MalformedPayloadError):
        decode(RUNS, b"x" * cap, max_bytes=cap)


def test_decode_cap_applies_to_valid_events_too() -> None:
    data = encode(EXAMPLES["RunStarted"])
    assert decode(RUNS, data, max_bytes=len(data)) == EXAMPLES["RunStarted"]
    with pytest.raises(PayloadTooLargeError):
        decode(RUNS, data, max_bytes=len(data) - 1)


def test_encode_rejects_an_event_over_the_cap() -> None:
    event = EXAMPLES["RunStarted"]
    size = len(encode(event))
    with pytest.raises(PayloadTooLargeError, match=f"RunStarted {event.event_id} encodes to {size} bytes, "
                                                   "over the 10-byte payload cap"):
        encode(event, max_bytes=10)


@pytest.mark.parametrize("data", [b"not json", b"{", b"\x80\x81", b""], ids=["text", "truncated", "binary", "empty"])
def test_decode_rejects_bytes_that_are_not_json(data: bytes) -> None:
    with pytest.raises(MalformedPayloadError, match="not a JSON document"):
        decode(RUNS, data)


@pytest.mark.parametrize(("data", "type_name"), [(b"[1, 2]", "list"), (b'"RunStarted"', "str"), (b"42", "int"),
                                                 (b"null", "NoneType")])
def test_decode_rejects_json_that_is_not_an_object(data: bytes, type_name: str) -> None:
    with pytest.raises(MalformedPayloadError, match=f"expected a JSON object, got {type_name}"):
        decode(RUNS, data)


def test_decode_rejects_a_tombstone() -> None:
    with pytest.raises(MalformedPayloadError, match="tombstone"):
        decode(RUNS, None)


def test_decode_names_the_right_topic_for_a_kind_of_another_topic() -> None:
    with pytest.raises(WrongTopicError) as excinfo:
        decode(TRAJECTORIES, encode(EXAMPLES["RunStarted"]))
    message = str(excinfo.value)
    assert "'RunStarted' is not carried by crl.trajectories" in message
    assert "expected one of TrajectoryCompleted" in message
    assert message.endswith("it belongs on crl.runs")


@pytest.mark.parametrize(
    ("kind", "message"),
    [("NoSuchEvent", "kind 'NoSuchEvent' is not carried by crl.runs"),
     (None, "'kind' must be a string naming the event, got None"),
     (3, "'kind' must be a string naming the event, got 3")],
)
def test_decode_rejects_an_unknown_kind(kind: Any, message: str) -> None:
    payload = wire_payload("RunStarted")
    payload["kind"] = kind
    with pytest.raises(WrongTopicError, match=message) as excinfo:
        decode(RUNS, json.dumps(payload).encode())
    assert "belongs on" not in str(excinfo.value)


def test_decode_rejects_a_payload_without_kind() -> None:
    payload = wire_payload("RunStarted")
    del payload["kind"]
    with pytest.raises(WrongTopicError, match="'kind' must be a string naming the event, got None"):
        decode(RUNS, json.dumps(payload).encode())


@pytest.mark.parametrize("data", [b'{"kind": []}', b'{"kind": {}}'], ids=["list", "dict"])
def test_decode_rejects_an_unhashable_kind_as_a_decode_error(data: bytes) -> None:
    with pytest.raises(WrongTopicError, match="'kind' must be a string"):
        decode(RUNS, data)


def test_decode_rejects_deeply_nested_json_as_malformed() -> None:
    with pytest.raises(MalformedPayloadError):
        decode(RUNS, b"[" * 100_000)


def test_decode_rejects_a_huge_integer_literal_as_malformed() -> None:
    with pytest.raises(MalformedPayloadError):
        decode(RUNS, b'{"kind": "RunStarted", "n": ' + b"1" * 5000 + b"}")


def test_decode_names_a_missing_field() -> None:
    payload = wire_payload("TrajectoryCompleted")
    del payload["reward"]
    with pytest.raises(InvalidEventError, match=r"^TrajectoryCompleted: reward: Field required$"):
        decode(TRAJECTORIES, json.dumps(payload).encode())


def test_decode_names_a_nested_missing_field_in_a_union_topic() -> None:
    payload = wire_payload("RunStarted")
    del payload["code_version"]
    with pytest.raises(InvalidEventError, match=r"RunStarted: .*code_version: Field required"):
        decode(RUNS, json.dumps(payload).encode())


def test_decode_rejects_a_schema_version_newer_than_the_code() -> None:
    payload = wire_payload("RunStarted")
    payload["schema_version"] = 2
    with pytest.raises(SchemaVersionError, match=r"RunStarted: cannot upcast: .*schema_version 2 is newer than "
                                                 r"this code's 1"):
        decode(RUNS, json.dumps(payload).encode())


@pytest.mark.parametrize("version", ["1", 1.0, True, None, 0, -1])
def test_decode_rejects_a_schema_version_that_is_not_a_positive_int(version: Any) -> None:
    payload = wire_payload("RunStarted")
    payload["schema_version"] = version
    with pytest.raises(SchemaVersionError, match="schema_version must be a positive integer"):
        decode(RUNS, json.dumps(payload).encode())


# --- describe_validation_error -----------------------------------------------------------------------------------


class _Pair(BaseModel):
    a: int
    b: list[int]


def test_describe_validation_error_joins_location_and_message_lines() -> None:
    with pytest.raises(ValidationError) as excinfo:
        _Pair.model_validate({"a": "x", "b": [1, "y"]})
    assert describe_validation_error(excinfo.value) == (
        "a: Input should be a valid integer, unable to parse string as an integer; "
        "b.1: Input should be a valid integer, unable to parse string as an integer"
    )


def test_describe_validation_error_marks_model_level_errors() -> None:
    with pytest.raises(ValidationError) as excinfo:
        rebuilt("EpisodeAssigned", slot=4, group_size=4)
    assert describe_validation_error(excinfo.value) == "<event>: Value error, slot 4 is outside a group of 4"


def test_describe_validation_error_lists_every_failing_field() -> None:
    with pytest.raises(ValidationError) as excinfo:
        rebuilt("TrajectoryCompleted", reward=math.nan, group_id="")
    assert describe_validation_error(excinfo.value) == (
        "group_id: String should have at least 1 character; reward: Input should be a finite number"
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_run_config_must_be_plain_json_without_nan(bad: float) -> None:
    with pytest.raises(ValidationError, match="config must be plain JSON without NaN or infinity"):
        RunStarted(run_id="r", producer=Producer(worker="w", instance="w-0"), config={"lr": bad},
                   code_version="0.1.0")


def test_embedding_from_array_rounds_once_to_float16() -> None:
    x = 1 + 2**-11 + 2**-40  # float32 rounding first would give 1.0; float16 of the exact value is 1.0009765625
    assert EmbeddingVector.from_array("m", np.array([x])).data == (float(np.float16(x)),) == (1.0009765625,)


def test_counts_and_seeds_fit_a_signed_64_bit_column() -> None:
    assigned = EXAMPLES["EpisodeAssigned"]
    assert assigned.model_copy(update={"seed": 2**63 - 1}).model_validate(
        assigned.model_dump() | {"seed": 2**63 - 1}).seed == 2**63 - 1
    with pytest.raises(ValidationError, match="seed"):
        type(assigned).model_validate(assigned.model_dump() | {"seed": 2**63})
