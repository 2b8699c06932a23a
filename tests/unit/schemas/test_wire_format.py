"""How strict the wire is (`schemas/codec.py`'s module docstring): the whole envelope on every record, JSON types never
coerced, one rule on the fast path, the upcast path and every topic.

Run: pytest tests/unit/schemas/test_wire_format.py
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import pytest

from schemas.base import Event
from schemas.codec import EventDecodeError, InvalidEventError, decode, encode
from schemas.examples import example_events
from schemas.topics import DEAD_LETTERS, TRAJECTORIES, topic_of

EXAMPLES = {event.kind: event for event in example_events()}


def payload_of(kind: str) -> dict[str, Any]:
    return json.loads(encode(EXAMPLES[kind]))


def decode_payload(kind: str, payload: dict[str, Any]) -> Event:
    return decode(topic_of(EXAMPLES[kind]), json.dumps(payload).encode())


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
@pytest.mark.parametrize("field", Event.ENVELOPE_FIELDS)
def test_a_record_without_an_envelope_field_is_rejected_on_every_topic(kind: str, field: str) -> None:
    # Before: on topics of one kind a missing `kind`, `schema_version`, `event_id` or `occurred_at` was filled in,
    # and an `event_id` drawn anew on every read defeated deduplication.
    payload = payload_of(kind)
    del payload[field]
    with pytest.raises(EventDecodeError, match=field):
        decode_payload(kind, payload)


def test_reading_the_same_bytes_twice_gives_the_same_event() -> None:
    raw = encode(EXAMPLES["TrajectoryCompleted"])
    first, second = decode(TRAJECTORIES, raw), decode(TRAJECTORIES, raw)
    assert (first.event_id, first.occurred_at) == (second.event_id, second.occurred_at)
    assert first == second == EXAMPLES["TrajectoryCompleted"]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("step", "7", "valid integer"),
    ("step", 7.0, "valid integer"),
    ("step", True, "valid integer"),
    ("num_actions", "3", "valid integer"),
    ("success", "yes", "valid boolean"),
    ("success", "true", "valid boolean"),
    ("success", 1, "valid boolean"),
    ("success", 0.0, "valid boolean"),
    ("reward", "1.0", "valid number"),
    ("reward", True, "valid number"),
    ("run_id", 7, "valid string"),
    ("trajectory_id", ["t"], "valid string"),
    ("env_id", None, "valid string"),
])
def test_values_keep_their_json_types_and_are_never_coerced(field: str, value: Any, message: str) -> None:
    payload = payload_of("TrajectoryCompleted")
    payload[field] = value
    with pytest.raises(InvalidEventError, match=rf"{field}: .*{message}"):
        decode_payload("TrajectoryCompleted", payload)


def test_a_float_field_takes_a_json_integer_and_says_the_same_number() -> None:
    payload = payload_of("TrajectoryCompleted")
    payload["reward"] = 1
    event = decode_payload("TrajectoryCompleted", payload)
    assert event.reward == 1.0 and isinstance(event.reward, float)


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_what_is_accepted_is_what_encode_writes_back(kind: str) -> None:
    # Reordered keys and another spelling of the same JSON decode to an event whose encoding is the same JSON value:
    # the archive never holds a normalised copy of something the producer did not say.
    payload = payload_of(kind)
    respelt = json.dumps(dict(reversed(list(payload.items()))), indent=1).encode()
    event = decode(topic_of(EXAMPLES[kind]), respelt)
    assert json.loads(encode(event)) == payload


def v1_dead_letter(**changes: Any) -> dict[str, Any]:
    raw = b"not json"
    letter = payload_of("DeadLetter")
    for name in ("error_class", "error_message", "raw_size", "raw_sha256", "raw_uri"):
        letter.pop(name, None)
    letter.update(schema_version=1, error="MalformedPayloadError: not a JSON document",
                  raw_b64=base64.b64encode(raw).decode(), **changes)
    return letter


def test_the_upcast_path_holds_the_same_rule() -> None:
    # A v1 dead letter is lifted to v2 first, then validated as strictly as a current record.
    good = decode(DEAD_LETTERS, json.dumps(v1_dead_letter()).encode())
    assert good.raw_sha256 == hashlib.sha256(b"not json").hexdigest()
    with pytest.raises(InvalidEventError, match=r"source_offset: .*valid integer"):
        decode(DEAD_LETTERS, json.dumps(v1_dead_letter(source_offset="3")).encode())
    with pytest.raises(InvalidEventError, match=r"source_partition: .*valid integer"):
        decode(DEAD_LETTERS, json.dumps(v1_dead_letter(source_partition=0.0)).encode())
    missing = v1_dead_letter()
    del missing["event_id"]
    with pytest.raises(InvalidEventError, match="event_id: required on the wire"):
        decode(DEAD_LETTERS, json.dumps(missing).encode())


def test_nan_on_the_upcast_path_is_named_by_its_field() -> None:
    letter = v1_dead_letter(source_offset=float("nan"))
    with pytest.raises(InvalidEventError, match="source_offset"):
        decode(DEAD_LETTERS, json.dumps(letter).encode())
