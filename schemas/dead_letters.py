"""Dead letters (`crl.dead-letters`): every record a worker could not process, with the reason. Any worker writes them.

The raw bytes travel inline (base64) up to `MAX_INLINE_RAW_BYTES`; larger records (the oversize ones, typically) are
written to the run's blob store and referenced by URI and sha256 (claim check), so nothing is lost and the dead
letter itself stays far below the broker's message limit. The record's key is kept the same way, inline up to
`MAX_INLINE_KEY_BYTES`: a poison record with a large key must not make its dead letter too large to publish. Its
headers travel inline (name, base64 value) up to `MAX_INLINE_HEADER_BYTES` in all, else by claim check as the JSON of
that list.

A dead letter's `event_id` is derived from the record (its log, coordinates and sha256) and the error class
(`dead_letter_id`): every worker that reads the same bad record, and a worker that reads it again after a crash,
writes the same dead letter, which the audit counts once.
"""

from __future__ import annotations

import base64
import uuid
from typing import Literal

from pydantic import Field, model_validator

from schemas.base import Event, NonNegativeInt, Sha256Hex

MAX_INLINE_RAW_BYTES = 256 * 1024
MAX_INLINE_KEY_BYTES = 1024
MAX_INLINE_HEADER_BYTES = 4096
DEAD_LETTER_NAMESPACE = uuid.UUID("5d0c6f53-3f0e-4a8e-9a51-2f1c0d7e4b19")


def dead_letter_id(log_id: str, topic: str, partition: int, offset: int, raw_sha256: str,
                   error_class: str) -> uuid.UUID:
    """The dead letter's event id: the same for the same record and the same kind of failure, whoever writes it."""
    return uuid.uuid5(DEAD_LETTER_NAMESPACE, f"{log_id}/{topic}/{partition}/{offset}/{raw_sha256}/{error_class}")


class DeadLetter(Event):
    """A record that could not be decoded, validated or handled. Version 2 split v1's `error` into class + message."""

    kind: Literal["DeadLetter"] = "DeadLetter"
    schema_version: Literal[2] = 2
    source_topic: str = Field(min_length=1)
    source_partition: NonNegativeInt
    source_offset: NonNegativeInt
    source_key_b64: str | None = Field(default=None, description="Record key, base64, when at most 1 KiB.")
    source_key_uri: str | None = Field(default=None, description="Blob-store URI of the key when it is larger.")
    source_key_size: NonNegativeInt | None = Field(default=None, description="Key size in bytes (claim check only).")
    source_key_sha256: Sha256Hex | None = Field(default=None, description="sha256 of the key (claim check only).")
    source_headers: tuple[tuple[str, str], ...] = Field(
        default=(), description="Record headers as (name, base64 value), when at most 4 KiB in all.")
    source_headers_uri: str | None = Field(
        default=None, description="Blob-store URI of the headers (JSON list of [name, base64 value]) when larger.")
    raw_b64: str | None = Field(default=None, description="Record value, base64, when at most 256 KiB.")
    raw_uri: str | None = Field(default=None, description="Blob-store URI of the value when it is larger.")
    raw_size: NonNegativeInt = Field(description="Size of the record value in bytes.")
    raw_sha256: Sha256Hex = Field(description="sha256 of the record value.")
    error_class: str = Field(min_length=1, description="Class of the error, e.g. 'InvalidEventError'.")
    error_message: str = Field(description="What was wrong, field by field for validation errors.")

    @model_validator(mode="after")
    def _raw_is_kept(self) -> DeadLetter:
        if (self.raw_b64 is None) == (self.raw_uri is None):
            raise ValueError("exactly one of raw_b64 (inline) and raw_uri (claim check) must be set")
        if self.raw_b64 is not None and len(base64.b64decode(self.raw_b64)) != self.raw_size:
            raise ValueError("raw_size does not match raw_b64")
        if self.source_key_b64 is not None and self.source_key_uri is not None:
            raise ValueError("a key is kept inline (source_key_b64) or by claim check (source_key_uri), not both")
        claim_check = (self.source_key_uri, self.source_key_size, self.source_key_sha256)
        if any(part is not None for part in claim_check) and None in claim_check:
            raise ValueError("source_key_uri, source_key_size and source_key_sha256 are set together")
        return self
