"""Bytes <-> events: JSON on the wire, size cap, upcasting, validation. Pure functions, no I/O.

`decode` raises a subclass of `EventDecodeError` whose name and message say exactly what was wrong; the worker
runner turns that into a dead letter. Payloads are JSON only (never pickle), so any client can read the log.

How strict the wire is (one rule, whatever the path or the topic):
- A record is one JSON object carrying the whole envelope: `kind`, `schema_version`, `event_id`, `run_id`,
  `occurred_at` and `producer`. Nothing of it is defaulted on read: an `event_id` or `occurred_at` made up while
  decoding would differ on every read and defeat deduplication, so a record without them is rejected.
- Values have their JSON types, never coerced: an integer field takes a JSON integer (not `"7"`, not `2.0`), a
  boolean `true`/`false` (not `"yes"`, not `1`), a string a JSON string (not `7`); a float field takes any JSON number
  (`2` is 2.0). Ids, UUIDs and timestamps are strings in their documented formats. No NaN or infinity.
- Unknown fields are rejected (`extra="forbid"`). An older `schema_version` is lifted by the upcasters first, then
  held to the same rule.
What is accepted is therefore exactly what `encode` would write for the decoded event, up to JSON spelling (key order,
white space, number formatting): the archive never holds a normalised copy of something the producer did not say.

Claim checks keep large events under the payload cap. Given `ClaimChecks`, `encode` moves the bulky arrays (the
`BULKY_FIELDS`: token ids and log-probs) of an event that would encode to more than the threshold into the run's blob
store, leaves `""` (an empty array) in their place and adds `"claim_check": {"sha256", "size"}` naming the blob: a
JSON object from each array's path (`turns/3/prompt_token_ids`) to its wire string. `decode`, given the store, puts
them back before validating, so readers get the event that was encoded. The blob's bytes are a function of the event,
so encoding the same event twice gives the same record. A reader without a store, or a blob that is missing, altered
or does not fit its record, raises `ClaimCheckError` naming the event and the blob.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Protocol

import pydantic_core
from pydantic import ValidationError

from schemas.base import Event
from schemas.topics import EVENT_TYPES, TOPIC_OF_KIND, Topic, topic_of
from schemas.upcasters import UpcastError, upcast

DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
DEFAULT_CLAIM_CHECK_BYTES = 256 * 1024
"""Events that would encode larger than this keep their bulky arrays in the blob store (a setting)."""


class EventDecodeError(ValueError):
    """A record's bytes are not a valid event for its topic."""


class PayloadTooLargeError(EventDecodeError):
    """The record is larger than the configured payload cap."""


class MalformedPayloadError(EventDecodeError):
    """The bytes are not a JSON object."""


class WrongTopicError(EventDecodeError):
    """The event kind is unknown, or belongs to another topic."""


class SchemaVersionError(EventDecodeError):
    """The schema version is newer than this code, or cannot be upcast."""


class InvalidEventError(EventDecodeError):
    """The payload fails validation (missing fields, NaN rewards, empty ids, ...)."""


class ClaimCheckError(EventDecodeError):
    """A record's claim check cannot be redeemed: no blob store, or its blob is missing, altered or does not fit."""


BULKY_FIELDS = frozenset({"prompt_token_ids", "response_token_ids", "sampling_logprobs"})
"""The array fields a claim check moves out of an event (every `TokenIds` and `LogProbs` field of the schemas)."""

CLAIM_CHECK = "claim_check"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class BlobStorage(Protocol):
    """Where claim-checked arrays live: content-addressed bytes (`pipeline.runtime.blobs.BlobStore`)."""

    def put(self, data: bytes) -> tuple[str, str]:
        """Store `data`; returns (URI, sha256)."""
        ...

    def read(self, sha256: str) -> bytes | None:
        """The bytes stored under `sha256` as they are on disk (unverified), or None when there are none."""
        ...


@dataclass(frozen=True)
class ClaimChecks:
    """Encode events over `threshold_bytes` with their bulky arrays in `store`."""

    store: BlobStorage
    threshold_bytes: int


def describe_validation_error(error: ValidationError) -> str:
    """One line per failing field: `turns.0.sampling_logprobs: NaN or infinite values are not allowed`."""
    lines = []
    for item in error.errors(include_url=False):
        location = ".".join(str(part) for part in item["loc"]) or "<event>"
        lines.append(f"{location}: {item['msg']}")
    return "; ".join(lines)


def encode(event: Event, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, claims: ClaimChecks | None = None) -> bytes:
    """The event as compact JSON bytes, its bulky arrays claim-checked past `claims.threshold_bytes`; raises
    `PayloadTooLargeError` past `max_bytes`."""
    data = event.model_dump_json().encode("utf-8")
    inline = len(data)
    if claims is not None and inline > claims.threshold_bytes:
        data = _check_in(data, claims.store)
    if len(data) > max_bytes:
        moved = f" ({inline} bytes before its arrays went to the blob store)" if len(data) != inline else ""
        raise PayloadTooLargeError(
            f"{event.kind} {event.event_id} encodes to {len(data)} bytes{moved}, over the {max_bytes}-byte payload cap"
        )
    return data


def _check_in(data: bytes, store: BlobStorage) -> bytes:
    """`data` with its bulky arrays moved to `store` and a claim check in their place (unchanged if it has none)."""
    payload = pydantic_core.from_json(data)
    arrays: dict[str, str] = {}
    _take_arrays(payload, "", arrays)
    if not arrays:
        return data
    blob = pydantic_core.to_json(arrays)
    _, sha256 = store.put(blob)
    payload[CLAIM_CHECK] = {"sha256": sha256, "size": len(blob)}
    return pydantic_core.to_json(payload)


def _take_arrays(node: Any, path: str, arrays: dict[str, str]) -> None:
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        where = f"{path}/{key}" if path else str(key)
        if isinstance(value, str) and key in BULKY_FIELDS and value:
            arrays[where] = value
            node[key] = ""
        elif isinstance(value, dict | list):
            _take_arrays(value, where, arrays)


def _redeem(payload: dict[str, Any], blobs: BlobStorage | None) -> None:
    """Put a claim-checked payload's arrays back from `blobs` (in place); raises `ClaimCheckError`."""
    ticket = payload.pop(CLAIM_CHECK)
    what = f"{payload.get('kind', 'event')} {payload.get('event_id', '?')}"
    if not (isinstance(ticket, dict) and set(ticket) == {"sha256", "size"} and isinstance(ticket["sha256"], str)
            and _SHA256.fullmatch(ticket["sha256"]) and type(ticket["size"]) is int):
        raise ClaimCheckError(f"{what}: malformed claim check {ticket!r:.200} (expected {{sha256, size}})")
    sha256, size = ticket["sha256"], ticket["size"]
    if blobs is None:
        raise ClaimCheckError(f"{what} keeps its arrays in blob {sha256} ({size} bytes), and this reader has no blob "
                              "store (the run directory's blobs/)")
    blob = blobs.read(sha256)
    if blob is None:
        raise ClaimCheckError(f"{what}: its arrays' blob {sha256} ({size} bytes) is missing from the blob store")
    if len(blob) != size or hashlib.sha256(blob).hexdigest() != sha256:
        raise ClaimCheckError(f"{what}: blob {sha256} holds {len(blob)} bytes with sha256 "
                              f"{hashlib.sha256(blob).hexdigest()}; the claim check says {size} bytes, {sha256}")
    try:
        arrays = pydantic_core.from_json(blob)
    except ValueError as exc:
        raise ClaimCheckError(f"{what}: blob {sha256} is not a JSON object of arrays: {exc}") from exc
    if not isinstance(arrays, dict):
        raise ClaimCheckError(f"{what}: blob {sha256} is not a JSON object of arrays")
    for path, value in arrays.items():
        *parents, field = path.split("/")
        node: Any = payload
        try:
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            node = None
        if field not in BULKY_FIELDS or not isinstance(node, dict) or node.get(field) != "" \
                or not isinstance(value, str):
            raise ClaimCheckError(f"{what}: blob {sha256} names {path}, which is not an emptied array of the event")
        node[field] = value


def decode(topic: Topic, data: bytes | None, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
           blobs: BlobStorage | None = None) -> Event:
    """Parse, upcast and validate one record value read from `topic`; a claim-checked record's arrays come back from
    `blobs`."""
    if data is None:
        raise MalformedPayloadError("record has no value (tombstone)")
    if len(data) > max_bytes:
        raise PayloadTooLargeError(f"record is {len(data)} bytes, over the {max_bytes}-byte payload cap")
    try:
        # Fast path, for the current schema version: parse and validate in one pass, without building a dict first
        # (15-25% faster here). Strict, so it accepts only what the path below accepts unchanged (no `1.0` for an int);
        # whatever it rejects (old versions to upcast, lax input, bad input of any kind) takes the path below,
        # which decides, and says exactly what was wrong.
        event = topic.adapter.validate_json(data, strict=True)
        if _carries_envelope(event):
            return event
    except ValidationError:
        pass
    try:
        # pydantic-core's parser: ~1.6x faster decode+validate than json.loads here. NaN/inf parse, then fail
        # validation with the field's name.
        payload = pydantic_core.from_json(data, allow_inf_nan=True)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, numbers out of range, deep nesting
        raise MalformedPayloadError(f"not a JSON document: {exc}") from exc
    if not isinstance(payload, dict):
        raise MalformedPayloadError(f"expected a JSON object, got {type(payload).__name__}")
    if CLAIM_CHECK in payload:
        _redeem(payload, blobs)
    kind = payload.get("kind")
    if not isinstance(kind, str):
        raise WrongTopicError(f"'kind' must be a string naming the event, got {kind!r:.80}")
    if kind not in topic.kinds:
        where = f"; it belongs on {TOPIC_OF_KIND[kind].name}" if kind in TOPIC_OF_KIND else ""
        raise WrongTopicError(
            f"kind {kind!r} is not carried by {topic.name} (expected one of {', '.join(topic.kinds)}){where}"
        )
    try:
        payload = upcast(payload, EVENT_TYPES[kind].current_version())
    except (UpcastError, KeyError, TypeError, ValueError) as exc:
        raise SchemaVersionError(f"{kind}: cannot upcast: {exc}") from exc
    missing = [name for name in Event.ENVELOPE_FIELDS if name not in payload]
    if missing:
        raise InvalidEventError(f"{kind}: {', '.join(missing)}: required on the wire (never defaulted on read)")
    try:
        # The same strict JSON validation as the fast path, on the upcast payload: one rule for every path.
        return topic.adapter.validate_json(pydantic_core.to_json(payload, inf_nan_mode="constants"), strict=True)
    except ValidationError as exc:
        raise InvalidEventError(f"{kind}: {describe_validation_error(exc)}") from exc


_ENVELOPE_FIELDS = frozenset(Event.ENVELOPE_FIELDS)


def _carries_envelope(event: Event) -> bool:
    """Whether the record named every envelope field (validation fills defaults in; the wire may not)."""
    return event.model_fields_set >= _ENVELOPE_FIELDS


def encode_for_topic(event: Event, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                     claims: ClaimChecks | None = None) -> tuple[Topic, bytes, bytes]:
    """(topic, key, value) for publishing `event`."""
    topic = topic_of(event)
    return topic, topic.key_bytes(event), encode(event, max_bytes, claims)
