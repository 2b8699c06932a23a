"""Experience-bank operations (`crl.experience-ops`, one partition); extractor workers produce them.

The bank is a projection of this log. Every op names the experience versions it expects (`expected_version`) so
that every replica rejects a stale op the same way; `op_id` is deterministic (generation id + op index), so a
re-processed trajectory produces the same ids and the bank treats the repeat as a duplicate.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.arrays import EmbeddingVector
from schemas.base import Event, Id, NonNegativeInt

ExperienceText = str
MAX_EXPERIENCE_CHARS = 4000


class VersionedExperience(BaseModel):
    """An experience an op touches, with the version the op expects it to be at."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    experience_id: Id
    expected_version: int = Field(ge=1)


class ExperienceAdded(Event):
    """A new experience. Its key is the embedding of the source trajectory's query (goal + first observation)."""

    kind: Literal["ExperienceAdded"] = "ExperienceAdded"
    schema_version: Literal[1] = 1
    op_id: Id
    experience_id: Id
    task_family: Id
    text: str = Field(min_length=1, max_length=MAX_EXPERIENCE_CHARS)
    key: EmbeddingVector
    generation_id: Id
    extractor_version: NonNegativeInt
    source_trajectory_ids: tuple[Id, ...] = Field(min_length=1)


class ExperienceRefined(Event):
    """A rewrite of one experience that was shown: same id, version + 1, the old text kept in history."""

    kind: Literal["ExperienceRefined"] = "ExperienceRefined"
    schema_version: Literal[1] = 1
    op_id: Id
    experience_id: Id
    expected_version: int = Field(ge=1, description="The version being rewritten; the result is this + 1.")
    text: str = Field(min_length=1, max_length=MAX_EXPERIENCE_CHARS)
    key: EmbeddingVector | None = Field(default=None, description="New key vector, or None to keep the old one.")
    generation_id: Id
    extractor_version: NonNegativeInt
    source_trajectory_ids: tuple[Id, ...] = Field(default=())


class ExperienceMerged(Event):
    """Several experiences consolidated into a new one; the sources are retired with `merged_into`."""

    kind: Literal["ExperienceMerged"] = "ExperienceMerged"
    schema_version: Literal[1] = 1
    op_id: Id
    experience_id: Id = Field(description="Id of the new, merged experience.")
    task_family: Id
    text: str = Field(min_length=1, max_length=MAX_EXPERIENCE_CHARS)
    key: EmbeddingVector = Field(
        description="Its retrieval key: the normalised mean of its sources' keys, or the embedding of its text "
        "(`extractor.merged_key`).")
    sources: tuple[VersionedExperience, ...] = Field(min_length=2)
    generation_id: Id
    extractor_version: NonNegativeInt

    @model_validator(mode="after")
    def _distinct_sources(self) -> ExperienceMerged:
        ids = [source.experience_id for source in self.sources]
        if len(set(ids)) != len(ids):
            raise ValueError("a merge lists the same source twice")
        if self.experience_id in ids:
            raise ValueError("the merged experience needs a new id, not one of its sources")
        return self


class ExperienceRetired(Event):
    """An experience leaves the active bank: discarded in a merge, or evicted by the capacity cap."""

    kind: Literal["ExperienceRetired"] = "ExperienceRetired"
    schema_version: Literal[1] = 1
    op_id: Id
    experience_id: Id
    expected_version: int = Field(ge=1)
    reason: Literal["merge_discard", "capacity", "manual"]
    generation_id: Id | None = Field(default=None, description="Generation that decided it (None for eviction).")
    extractor_version: NonNegativeInt | None = None
