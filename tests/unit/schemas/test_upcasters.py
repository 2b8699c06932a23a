"""Upcasters (`schemas/upcasters.py`): old payloads are lifted to the current schema version, or refused.

The DeadLetter v1 -> v2 step is tested on a payload as a v1 producer wrote it. Test-only upcasters are registered
with `monkeypatch.setitem`, and every test checks that the global registry is left as it was.

Run: pytest tests/unit/schemas/test_upcasters.py
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from schemas import upcasters
from schemas.base import Producer
from schemas.codec import SchemaVersionError, decode, encode
from schemas.dead_letters import DeadLetter
from schemas.topics import DEAD_LETTERS, EVENT_TYPES
from schemas.upcasters import UPCASTERS, UpcastError, upcast, upcaster

V1_EVENT_ID = "0f5c3b8e-6a1d-4c2e-9b7a-3d4e5f607182"


@pytest.fixture(autouse=True)
def registry_is_left_unchanged() -> Iterator[None]:
    before = dict(UPCASTERS)
    yield
    assert before == UPCASTERS


def v1_dead_letter(error: str = "MalformedPayloadError: not a JSON document") -> dict[str, Any]:
    """A DeadLetter exactly as a schema-version-1 producer wrote it (no error_class/message, raw_size/sha256)."""
    return {
        "kind": "DeadLetter",
        "schema_version": 1,
        "event_id": V1_EVENT_ID,
        "run_id": "run-2024-05-01",
        "occurred_at": "2024-05-01T12:00:00Z",
        "producer": {"worker": "rollout", "instance": "rollout-0"},
        "source_topic": "crl.trajectories",
        "source_partition": 3,
        "source_offset": 118,
        "raw_b64": base64.b64encode(b"not json").decode("ascii"),
        "error": error,
    }


def test_v1_dead_letter_decodes_to_v2() -> None:
    event = decode(DEAD_LETTERS, json.dumps(v1_dead_letter()).encode())
    assert event == DeadLetter(
        event_id=uuid.UUID(V1_EVENT_ID),
        run_id="run-2024-05-01",
        occurred_at=datetime(2024, 5, 1, 12, 0, tzinfo=UTC),
        producer=Producer(worker="rollout", instance="rollout-0"),
        source_topic="crl.trajectories",
        source_partition=3,
        source_offset=118,
        raw_b64="bm90IGpzb24=",
        raw_size=8,
        raw_sha256=hashlib.sha256(b"not json").hexdigest(),
        error_class="MalformedPayloadError",
        error_message="not a JSON document",
    )
    assert event.schema_version == 2
    assert event.error_class == "MalformedPayloadError"
    assert event.error_message == "not a JSON document"
    assert event.raw_size == 8
    assert event.raw_sha256 == hashlib.sha256(b"not json").hexdigest()
    assert event.raw_uri is None and event.source_key_b64 is None


def test_upcast_dead_letter_is_written_back_as_v2() -> None:
    event = decode(DEAD_LETTERS, json.dumps(v1_dead_letter()).encode())
    rewritten = json.loads(encode(event))
    assert rewritten["schema_version"] == 2
    assert "error" not in rewritten
    assert decode(DEAD_LETTERS, encode(event)) == event


def test_v1_error_is_split_at_the_first_separator_only() -> None:
    payload = upcast(v1_dead_letter("InvalidEventError: TrajectoryCompleted: reward: Field required"), 2)
    assert payload["error_class"] == "InvalidEventError"
    assert payload["error_message"] == "TrajectoryCompleted: reward: Field required"


def test_v1_error_without_a_class_becomes_unknown_error() -> None:
    event = decode(DEAD_LETTERS, json.dumps(v1_dead_letter("handler crashed")).encode())
    assert event.error_class == "UnknownError"
    assert event.error_message == "handler crashed"


def test_upcast_returns_exactly_the_v2_payload() -> None:
    assert upcast(v1_dead_letter(), 2) == {
        **{key: value for key, value in v1_dead_letter().items() if key != "error"},
        "schema_version": 2,
        "error_class": "MalformedPayloadError",
        "error_message": "not a JSON document",
        "raw_size": 8,
        "raw_sha256": hashlib.sha256(b"not json").hexdigest(),
    }


def test_upcast_does_not_mutate_its_input() -> None:
    payload = v1_dead_letter()
    snapshot = copy.deepcopy(payload)
    upcast(payload, 2)
    assert payload == snapshot


def test_upcast_at_the_current_version_changes_nothing() -> None:
    payload = {"kind": "DeadLetter", "schema_version": 2, "error_class": "X"}
    assert upcast(payload, 2) == {"kind": "DeadLetter", "schema_version": 2, "error_class": "X"}


def test_every_registered_step_lifts_a_known_kind_below_its_current_version() -> None:
    for kind, from_version in UPCASTERS:
        assert kind in EVENT_TYPES, kind
        assert 1 <= from_version < EVENT_TYPES[kind].current_version(), (kind, from_version)


def test_every_versioned_kind_has_a_complete_chain() -> None:
    for kind, cls in EVENT_TYPES.items():
        missing = [v for v in range(1, cls.current_version()) if (kind, v) not in UPCASTERS]
        assert missing == [], f"{kind} has no upcaster from versions {missing}"


def test_registering_a_duplicate_upcaster_raises() -> None:
    original = UPCASTERS[("DeadLetter", 1)]
    with pytest.raises(ValueError, match="an upcaster for DeadLetter v1 is already registered"):
        upcaster("DeadLetter", from_version=1)(lambda payload: payload)
    assert UPCASTERS[("DeadLetter", 1)] is original


def test_registering_a_new_upcaster_twice_raises() -> None:
    key = ("TestOnlyKind", 1)
    try:
        @upcaster("TestOnlyKind", from_version=1)
        def first(payload: dict[str, Any]) -> dict[str, Any]:
            return payload

        assert UPCASTERS[key] is first
        with pytest.raises(ValueError, match="already registered"):
            upcaster("TestOnlyKind", from_version=1)(lambda payload: payload)
        assert UPCASTERS[key] is first
    finally:
        UPCASTERS.pop(key, None)


def test_a_chain_of_steps_runs_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    def one_to_two(payload: dict[str, Any]) -> dict[str, Any]:
        payload["steps"] = [*payload["steps"], 1]
        return payload

    def two_to_three(payload: dict[str, Any]) -> dict[str, Any]:
        assert payload["schema_version"] == 2
        payload["steps"] = [*payload["steps"], 2]
        return payload

    monkeypatch.setitem(UPCASTERS, ("FakeKind", 1), one_to_two)
    monkeypatch.setitem(UPCASTERS, ("FakeKind", 2), two_to_three)
    assert upcast({"kind": "FakeKind", "schema_version": 1, "steps": []}, 3) == {
        "kind": "FakeKind",
        "schema_version": 3,
        "steps": [1, 2],
    }


def test_a_missing_step_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(UPCASTERS, ("FakeKind", 1), lambda payload: payload)
    with pytest.raises(UpcastError, match="FakeKind: no upcaster from schema_version 2 to 3"):
        upcast({"kind": "FakeKind", "schema_version": 1}, 3)


def test_a_kind_without_upcasters_cannot_be_lifted() -> None:
    with pytest.raises(UpcastError, match="RunStarted: no upcaster from schema_version 1 to 2"):
        upcast({"kind": "RunStarted", "schema_version": 1}, 2)


def test_schema_version_zero_raises() -> None:
    with pytest.raises(UpcastError, match="RunStarted: schema_version must be a positive integer, got 0"):
        upcast({"kind": "RunStarted", "schema_version": 0}, 1)


def test_a_version_newer_than_the_code_raises() -> None:
    payload = {**v1_dead_letter(), "schema_version": 3}
    with pytest.raises(UpcastError, match="DeadLetter: schema_version 3 is newer than this code's 2; upgrade"):
        upcast(payload, 2)
    with pytest.raises(SchemaVersionError, match="schema_version 3 is newer"):
        decode(DEAD_LETTERS, json.dumps(payload).encode())


@pytest.mark.parametrize("version", ["1", 1.0, True, None, [1]], ids=["str", "float", "bool", "none", "list"])
def test_a_schema_version_that_is_not_an_int_raises(version: Any) -> None:
    with pytest.raises(UpcastError, match=re.escape(f"schema_version must be a positive integer, got {version!r}")):
        upcast({"kind": "DeadLetter", "schema_version": version}, 2)


def test_a_missing_schema_version_raises() -> None:
    with pytest.raises(UpcastError, match="got None"):
        upcast({"kind": "DeadLetter"}, 2)


def test_a_v1_dead_letter_that_cannot_be_upcast_is_a_schema_version_error() -> None:
    payload = v1_dead_letter()
    del payload["error"]
    with pytest.raises(SchemaVersionError, match="DeadLetter: cannot upcast"):
        decode(DEAD_LETTERS, json.dumps(payload).encode())


def test_upcasters_module_registry_is_the_one_upcast_uses() -> None:
    assert upcasters.UPCASTERS is UPCASTERS


def test_a_v1_trajectory_decodes_to_v2_with_what_it_did_not_record_unknown() -> None:
    """A TrajectoryCompleted as a schema-version-1 producer wrote it: the current example without the v2 fields."""
    from schemas.examples import example_events
    from schemas.topics import TRAJECTORIES

    example = next(e for e in example_events() if e.kind == "TrajectoryCompleted")
    current = json.loads(example.model_dump_json())
    v1 = {key: value for key, value in current.items() if key not in ("final_observation", "revealed")}
    v1["schema_version"] = 1
    event = decode(TRAJECTORIES, json.dumps(v1).encode())
    assert event.schema_version == 2
    assert (event.final_observation, event.revealed) == (None, ())
    assert event == example.model_copy(update={"final_observation": None, "revealed": ()})
    assert json.loads(encode(event))["schema_version"] == 2  # written back as v2
    with pytest.raises(SchemaVersionError, match="cannot carry final_observation"):  # a v2 field in a v1 payload
        decode(TRAJECTORIES, json.dumps({**v1, "revealed": ["x"], "final_observation": 3}).encode())
