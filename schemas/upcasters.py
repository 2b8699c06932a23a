"""Upcasters: functions that lift an older payload of an event kind one schema version up.

Decoding reads `kind` and `schema_version`, then applies `(kind, v) -> v + 1` steps until the payload is at the
version the code validates. Payloads here are the JSON dicts read off the wire, so an upcaster never sees Python
objects. A version newer than the code, or a gap in the chain, is an error (the record goes to the dead letters).

To change an event incompatibly: bump its `schema_version` literal, then register the step from the previous version
here with `@upcaster("Kind", from_version=N)` and test it on a real old payload.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from typing import Any

Payload = dict[str, Any]
Upcaster = Callable[[Payload], Payload]

UPCASTERS: dict[tuple[str, int], Upcaster] = {}


class UpcastError(ValueError):
    """A payload's schema version cannot be brought to the current one."""


def upcaster(kind: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Register `fn` as the step from `from_version` to `from_version + 1` of `kind`."""

    def register(fn: Upcaster) -> Upcaster:
        if (kind, from_version) in UPCASTERS:
            raise ValueError(f"an upcaster for {kind} v{from_version} is already registered")
        UPCASTERS[(kind, from_version)] = fn
        return fn

    return register


def upcast(payload: Payload, current_version: int) -> Payload:
    """Return `payload` lifted to `current_version` (the input dict is not modified)."""
    kind = payload.get("kind")
    version = payload.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise UpcastError(f"{kind}: schema_version must be a positive integer, got {version!r}")
    if version > current_version:
        raise UpcastError(f"{kind}: schema_version {version} is newer than this code's {current_version}; upgrade")
    while version < current_version:
        step = UPCASTERS.get((kind, version)) if isinstance(kind, str) else None
        if step is None:
            raise UpcastError(f"{kind}: no upcaster from schema_version {version} to {version + 1}")
        payload = step(dict(payload))
        version += 1
        payload["schema_version"] = version
    return payload


@upcaster("DeadLetter", from_version=1)
def _dead_letter_v1_to_v2(payload: Payload) -> Payload:
    """v1 stored `error` as one "Class: message" string and only inline raw bytes (`raw_b64`).

    v2 splits the error into `error_class` / `error_message` and adds `raw_size` / `raw_sha256` (computed here from
    the inline bytes) and the optional claim-check `raw_uri`.
    """
    error = payload.pop("error")
    error_class, separator, message = error.partition(": ")
    if not separator:
        error_class, message = "UnknownError", error
    raw = base64.b64decode(payload["raw_b64"])
    payload["error_class"] = error_class
    payload["error_message"] = message
    payload["raw_size"] = len(raw)
    payload["raw_sha256"] = hashlib.sha256(raw).hexdigest()
    return payload


@upcaster("TrajectoryCompleted", from_version=1)
def _trajectory_v1_to_v2(payload: Payload) -> Payload:
    """v1 recorded neither the observation an episode ended on nor what it revealed: v2 states both as unknown
    (`final_observation` null, `revealed` empty), never guessed from the turns."""
    for field in ("final_observation", "revealed"):
        if field in payload:
            raise UpcastError(f"TrajectoryCompleted: a schema_version 1 payload cannot carry {field} (added in v2)")
    payload["final_observation"] = None
    payload["revealed"] = []
    return payload
