"""How extractor workers distil trajectories and merge the bank (`CRL_EXTRACTOR__*`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ExtractorSettings(BaseModel):
    """How extractor workers distil trajectories and merge the bank. Environment: `CRL_EXTRACTOR__<FIELD>`. The
    sampling temperature is the extractor trainer's (`CRL_EXTRACTOR_TRAINER__TEMPERATURE`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    distill: Literal["all", "guided"] = Field(
        default="all", description="Which train trajectories are distilled: every one, or only guided ones.")
    backend: Literal["transformers", "vllm"] = Field(default="transformers", description="Generation backend.")
    device: str = Field(default="cpu", description="torch device for the transformers backend.")
    batch_size: int = Field(default=16, gt=0, description="Trajectories distilled per batched generation.")
    generation_micro_batch: int = Field(default=16, gt=0, description="Rows per forward pass while generating.")
    max_new_tokens: int = Field(default=160, gt=0, description="Longest extractor response.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling (1 = off).")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0 = off).")
    max_ops: int = Field(default=3, ge=1, le=3, description="Most ops one distillation may emit (paper: 3).")
    max_experience_chars: int = Field(default=400, gt=0, le=4000, description="Longest experience text accepted.")
    max_actions_shown: int = Field(default=40, gt=0, description="Actions of the trajectory listed in the prompt.")
    merge_chunk: int = Field(default=5, ge=2, description="Experiences per merge prompt (paper: 5).")
    capacity: int = Field(
        default=20_000, gt=0, description="Active experiences kept; beyond it the oldest are retired (FIFO).")
    replica_wait_s: float = Field(
        default=10.0, ge=0, description="Before a merge, how long to wait for the bank replica to catch up.")
    seed: int = Field(default=0, ge=0, description="Seeds the sampling of this worker's generations.")
