"""How extractor workers distil trajectories and merge the bank (`CRL_EXTRACTOR__*`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.models.settings import GenerationSettings


class ExtractorSettings(BaseModel):
    """How extractor workers distil trajectories and merge the bank. Environment: `CRL_EXTRACTOR__<FIELD>`; the
    extractor's generation is `CRL_EXTRACTOR__GENERATION__<FIELD>`, which the extractor trainer reads too."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    generation: GenerationSettings = Field(
        default_factory=lambda: GenerationSettings(max_new_tokens=160, micro_batch=16),
        description="How the extractor generates (an optional reasoning, then the answer).")
    distill: Literal["all", "guided"] = Field(
        default="all", description="Which train trajectories are distilled: every one, or only guided ones.")
    batch_size: int = Field(default=16, gt=0, description="Trajectories distilled per batched generation.")
    max_ops: int = Field(default=3, ge=1, le=3, description="Most ops one distillation may emit (paper: 3).")
    max_experience_chars: int = Field(default=400, gt=0, le=4000, description="Longest experience text accepted.")
    max_actions_shown: int = Field(default=40, gt=0, description="Actions of the trajectory listed in the prompt.")
    merge_chunk: int = Field(default=5, ge=2, description="Experiences per merge prompt (paper: 5).")
    merged_key: Literal["sources", "text"] = Field(
        default="sources",
        description="The retrieval key of a merged experience: 'sources', the normalised mean of its sources' keys "
        "(each the query of the episode it came from), so the queries that found the sources still find the "
        "merge; 'text', the embedding of the merged text, which no episode's query resembles.")
    capacity: int = Field(
        default=20_000, gt=0, description="Active experiences kept; beyond it the oldest are retired (FIFO).")
    replica_wait_s: float = Field(
        default=10.0, ge=0, description="Before a merge, how long to wait for the bank replica to catch up.")
