"""A catalogue of bad records for every topic, as a hostile or broken producer with a raw Kafka client writes them.

    for bad in bad_records(run_id="my-run"):
        producer.send(bad.topic, key=bad.key, value=bad.value, headers=list(bad.headers))

Each `BadRecord` names what must become of it (`expect`): the class of the dead letter a consuming worker writes
(`MalformedPayloadError`, `WrongTopicError`, `SchemaVersionError`, `InvalidEventError`, `PayloadTooLargeError`), or a
recorded outcome for records that are valid events a consumer has its own rule for:

- `ACCEPTED`: a valid event in an odd record (no key, binary key, garbage headers): handled and archived as usual;
- `DUPLICATE`: a valid event published a second time: archived once (the audit keeps one row per `event_id`), and
  the bank counts a duplicate op;
- `BANK_REJECTS`: a valid op the bank rejects with a reason (unknown experience, stale version, another run's op):
  archived, never applied, `rejected` counts it, and every replay decides alike.

The tests (`tests/workers/test_bad_input.py`, `tests/integration/test_bad_input_on_a_broker.py`) feed the whole
catalogue to every worker kind and to real brokers; the names are their test ids.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from schemas.base import Event
from schemas.examples import example_events
from schemas.topics import EXPERIENCE_OPS_TOPIC, TOPICS, TRAJECTORIES, Topic, topic_of

ACCEPTED = "accepted"
DUPLICATE = "duplicate"
BANK_REJECTS = "rejected by the bank"
OUTCOMES = (ACCEPTED, DUPLICATE, BANK_REJECTS)


@dataclass(frozen=True)
class BadRecord:
    name: str
    topic: str
    value: bytes | None
    key: bytes | None = b"k"
    headers: tuple[tuple[str, bytes], ...] = ()
    expect: str = "InvalidEventError"
    """The dead letter's error class, or one of `OUTCOMES`."""

    @property
    def dead_letter(self) -> bool:
        return self.expect not in OUTCOMES


def _event_id(name: str) -> str:
    """A fixed event id of its own for the valid record `name` (so two catalogue records never share one by chance)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"crl-bad-records/{name}"))


def _json(payload: Any) -> bytes:
    return json.dumps(payload).encode()


def _example_of(topic: Topic, run_id: str) -> Event:
    return next(event for event in example_events(run_id) if topic_of(event) is topic)


def _changed(payload: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**payload, **changes}


def _without(payload: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in payload.items() if k != name}


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def records_for_topic(topic: Topic, run_id: str, max_payload_bytes: int = 1024 * 1024) -> list[BadRecord]:
    """Every generic kind of bad record, on `topic`, built from a valid example of its first event kind."""
    valid = _example_of(topic, run_id)
    payload = json.loads(valid.model_dump_json())
    other_kind = next(t.events[0].__name__ for t in TOPICS if t is not topic)
    first_payload_field = valid.payload_fields()[0]
    name = topic.name.removeprefix("crl.")

    def bad(what: str, value: bytes | None, expect: str = "InvalidEventError", **options: Any) -> BadRecord:
        return BadRecord(f"{name}:{what}", topic.name, value, expect=expect, **options)

    text = json.dumps(payload)
    return [
        bad("not-json", b"this is not json", "MalformedPayloadError"),
        bad("invalid-utf8", b"\xff\xfe\xfa", "MalformedPayloadError"),
        bad("truncated-json", text[: len(text) // 2].encode(), "MalformedPayloadError"),
        bad("empty-value", b"", "MalformedPayloadError"),
        bad("tombstone", None, "MalformedPayloadError"),
        bad("json-array", _json([payload]), "MalformedPayloadError"),
        bad("json-string", _json("hello"), "MalformedPayloadError"),
        bad("json-null", b"null", "MalformedPayloadError"),
        bad("deep-nesting", _nested(100_000).encode(), "MalformedPayloadError"),
        bad("deep-nesting-in-a-field", f'{text[:-1]}, "extra": {_nested(5000)}}}'.encode(), "MalformedPayloadError"),
        bad("unknown-kind", _json(_changed(payload, kind="NoSuchEvent")), "WrongTopicError"),
        bad("foreign-kind", _json(_changed(payload, kind=other_kind)), "WrongTopicError"),
        bad("kind-not-a-string", _json(_changed(payload, kind=7)), "WrongTopicError"),
        bad("missing-kind", _json(_without(payload, "kind")), "WrongTopicError"),
        bad("newer-schema-version", _json(_changed(payload, schema_version=99)), "SchemaVersionError"),
        bad("schema-version-zero", _json(_changed(payload, schema_version=0)), "SchemaVersionError"),
        bad("schema-version-as-string", _json(_changed(payload, schema_version="1")), "SchemaVersionError"),
        bad("huge-schema-version", f'{text[:-1]}, "schema_version": {10**40}}}'.encode(), "SchemaVersionError"),
        bad("missing-event-id", _json(_without(payload, "event_id"))),
        bad("missing-occurred-at", _json(_without(payload, "occurred_at"))),
        bad("missing-run-id", _json(_without(payload, "run_id"))),
        bad("missing-producer", _json(_without(payload, "producer"))),
        bad("missing-payload-field", _json(_without(payload, first_payload_field))),
        bad("extra-field", _json(_changed(payload, surprise=1))),
        bad("event-id-not-a-uuid", _json(_changed(payload, event_id="not-a-uuid"))),
        bad("empty-run-id", _json(_changed(payload, run_id=""))),
        bad("run-id-with-whitespace", _json(_changed(payload, run_id="my run"))),
        bad("over-long-run-id", _json(_changed(payload, run_id="r" * 300))),
        bad("run-id-not-a-string", _json(_changed(payload, run_id=7))),
        bad("naive-occurred-at", _json(_changed(payload, occurred_at="2026-11-24T10:00:00"))),
        bad("garbage-occurred-at", _json(_changed(payload, occurred_at="yesterday"))),
        bad("nan-in-a-field", f'{text[:-1]}, "run_id": NaN}}'.encode()),
        bad("infinity-in-a-field", f'{text[:-1]}, "run_id": -Infinity}}'.encode()),
        bad("producer-as-string", _json(_changed(payload, producer="me"))),
        bad("oversize-record", _json(_changed(payload, pad="x" * (max_payload_bytes + 1))), "PayloadTooLargeError"),
        bad("oversize-key", b"[1]", "MalformedPayloadError", key=b"K" * 600_000),
        bad("garbage-headers-on-garbage", b"\x00\x01", "MalformedPayloadError",
            headers=(("\u0000", b"\xff" * 10), ("h" * 200, b"\x00" * 5000))),
        bad("null-key-on-garbage", b"{", "MalformedPayloadError", key=None),
        bad("null-key", _json(_changed(payload, event_id=_event_id(f"{name}:null-key"))), ACCEPTED, key=None),
        bad("binary-key-and-garbage-headers", _json(_changed(payload, event_id=_event_id(f"{name}:binary-key"))),
            ACCEPTED, key=b"\xff\x00\xfe", headers=(("x", b"\xff\xfe"), ("", b""))),
        bad("published", _json(payload), ACCEPTED),
        bad("published-twice", _json(payload), DUPLICATE),
    ]


def trajectory_records(run_id: str) -> list[BadRecord]:
    """Bad trajectories: the fields only a `TrajectoryCompleted` has."""
    valid = _example_of(TRAJECTORIES, run_id)
    payload = json.loads(valid.model_dump_json())
    turn = payload["turns"][0]

    def with_turn(**changes: Any) -> bytes:
        return _json(_changed(payload, turns=[_changed(turn, **changes), *payload["turns"][1:]]))

    def bad(what: str, value: bytes, expect: str = "InvalidEventError") -> BadRecord:
        return BadRecord(f"trajectories:{what}", TRAJECTORIES.name, value, expect=expect)

    text = json.dumps(payload)
    return [
        bad("broken-base64-token-ids", with_turn(prompt_token_ids="!!!not base64!!!")),
        bad("base64-of-a-wrong-length", with_turn(response_token_ids="AAA=")),
        bad("logprobs-not-matching-tokens", with_turn(sampling_logprobs=[-0.1])),
        bad("nan-reward", f'{text[:-1]}, "reward": NaN}}'.encode()),
        bad("infinite-reward", f'{text[:-1]}, "reward": Infinity}}'.encode()),
        bad("huge-number", f'{text[:-1]}, "num_actions": {10**30}}}'.encode()),
        bad("negative-count", _json(_changed(payload, num_actions=-1))),
        bad("string-for-an-integer", _json(_changed(payload, step="1"))),
        bad("string-for-a-boolean", _json(_changed(payload, success="yes"))),
        bad("float-for-an-integer", _json(_changed(payload, step=1.0))),
        bad("inconsistent-invalid-actions", _json(_changed(payload, invalid_actions=5, num_actions=2))),
        bad("free-episode-with-served-experiences", _json(_changed(payload, guided=False))),
        bad("served-experiences-without-a-bank-offset", _json(_changed(payload, bank_offset=None))),
        bad("empty-trajectory-id", _json(_changed(payload, trajectory_id=""))),
    ]


def op_records(run_id: str) -> list[BadRecord]:
    """Bad experience ops, and valid ops the bank rejects."""
    examples = {event.kind: event for event in example_events(run_id)}
    added = json.loads(examples["ExperienceAdded"].model_dump_json())
    refined = json.loads(examples["ExperienceRefined"].model_dump_json())

    def op(what: str, payload: dict[str, Any], expect: str) -> BadRecord:
        return BadRecord(f"experience-ops:{what}", EXPERIENCE_OPS_TOPIC.name, _json(payload), expect=expect)

    return [
        op("refine-of-an-unknown-experience", _changed(refined, event_id=_event_id("op-1"),
                                                        op_id="hostile:1", experience_id="no-such-experience"),
           BANK_REJECTS),
        op("add-then-stale-refine", _changed(added, event_id=_event_id("op-2"),
                                             op_id="hostile:2", experience_id="hostile-exp"), ACCEPTED),
        op("refine-at-a-stale-version", _changed(refined, event_id=_event_id("op-3"),
                                                 op_id="hostile:3", experience_id="hostile-exp",
                                                 expected_version=7), BANK_REJECTS),
        op("op-of-another-run", _changed(added, event_id=_event_id("op-4"), op_id="hostile:4",
                                         experience_id="planted", run_id="another-run"), BANK_REJECTS),
        op("key-of-the-wrong-dimension", _changed(added, key=_changed(added["key"], dim=3)), "InvalidEventError"),
        op("empty-op-text", _changed(added, text=""), "InvalidEventError"),
        op("merge-of-one-source", _changed(json.loads(examples["ExperienceMerged"].model_dump_json()),
                                           sources=[{"experience_id": "exp-1", "expected_version": 3}]),
           "InvalidEventError"),
    ]


def bad_records(run_id: str, topics: tuple[Topic, ...] = TOPICS,
                max_payload_bytes: int = 1024 * 1024) -> list[BadRecord]:
    """The whole catalogue for the topics given (all of them by default), generic kinds first."""
    records = [record for topic in topics for record in records_for_topic(topic, run_id, max_payload_bytes)]
    if TRAJECTORIES in topics:
        records += trajectory_records(run_id)
    if EXPERIENCE_OPS_TOPIC in topics:
        records += op_records(run_id)
    return records
