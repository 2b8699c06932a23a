"""Bank snapshots (`crl.bank-snapshots`); the bank worker produces them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import Event, NonNegativeInt, Sha256Hex


class BankSnapshotWritten(Event):
    """A snapshot of the bank (index file + manifest) is durable; replicas may start from it."""

    kind: Literal["BankSnapshotWritten"] = "BankSnapshotWritten"
    schema_version: Literal[1] = 1
    next_offset: NonNegativeInt = Field(description="First experience-op offset NOT included in the snapshot.")
    state_hash: Sha256Hex = Field(description="Bank state hash after applying every op before next_offset.")
    uri: str = Field(min_length=1, description="Snapshot directory (file:// URI or path).")
    active_experiences: NonNegativeInt
    ops_applied: NonNegativeInt
