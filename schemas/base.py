"""The event envelope every event carries, and the constrained field types events share.

An event is a frozen pydantic model with a `kind` literal tag equal to its class name and a `schema_version`
literal. A breaking change to an event bumps its `schema_version` and registers an upcaster in
`schemas/upcasters.py`; adding an optional field does not.
"""

from __future__ import annotations

import functools
import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints, field_validator

Id = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^\s]+$")]
"""An identifier: non-empty, no whitespace, at most 256 characters."""

Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
"""A sha256 digest as 64 lowercase hex characters."""

NonNegativeInt = Annotated[int, Field(ge=0, le=2**63 - 1)]
"""A count, offset, step or seed: fits a signed 64-bit column (Parquet, SQL, DuckDB)."""

Role = Literal["actor", "extractor"]
"""Which of the two models a policy or training event is about."""

Split = Literal["train", "eval"]
"""Whether an episode trains the actor or only measures it on the fixed evaluation pool."""


class Producer(BaseModel):
    """Who wrote an event: the worker kind and the instance of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    worker: Id = Field(description="Worker kind, a key of the WORKERS registry (e.g. 'rollout').")
    instance: Id = Field(description="Which instance of that worker kind, e.g. 'rollout-0' or a host:pid.")


def _now() -> datetime:
    return datetime.now(UTC)


class Event(BaseModel):
    """Envelope shared by every event. Subclasses add `kind`, `schema_version` and their payload fields."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, validate_default=True)

    kind: str
    schema_version: int
    event_id: uuid.UUID = Field(default_factory=uuid.uuid4, description="Unique id of this event.")
    run_id: Id = Field(description="The run this event belongs to.")
    occurred_at: AwareDatetime = Field(default_factory=_now, description="When the producer made the event (UTC).")
    producer: Producer = Field(description="The worker that produced the event.")

    @field_validator("schema_version", mode="before")
    @classmethod
    def _version_is_an_integer(cls, value: Any) -> Any:
        # A subclass's Literal[N] alone would take 1.0 and true, which equal 1.
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"schema_version must be an integer, got {value!r}")
        return value

    ENVELOPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "kind",
        "schema_version",
        "event_id",
        "run_id",
        "occurred_at",
        "producer",
    )

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kind_args = get_args(cls.model_fields["kind"].annotation)
        version_args = get_args(cls.model_fields["schema_version"].annotation)
        if kind_args != (cls.__name__,):
            raise TypeError(f"{cls.__name__}.kind must be Literal[{cls.__name__!r}], got {kind_args}")
        if len(version_args) != 1 or not isinstance(version_args[0], int):
            raise TypeError(f"{cls.__name__}.schema_version must be a single int Literal")

    @classmethod
    @functools.cache
    def current_version(cls) -> int:
        """The schema version this code writes and validates (older payloads are upcast to it)."""
        return get_args(cls.model_fields["schema_version"].annotation)[0]

    @classmethod
    def payload_fields(cls) -> list[str]:
        """Field names beyond the envelope, in declaration order."""
        return [name for name in cls.model_fields if name not in cls.ENVELOPE_FIELDS]


def snake_case(name: str) -> str:
    """`TrajectoryCompleted` -> `trajectory_completed` (used for audit view names)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
