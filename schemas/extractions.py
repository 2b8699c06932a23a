"""Extractor generations (`crl.extractions`); extractor workers produce them, the extractor trainer consumes them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.arrays import LogProbs, TokenIds
from schemas.base import Event, Id, NonNegativeInt
from schemas.trajectories import ExperienceRef

ParseStatus = Literal["ok", "no_op", "parse_error"]


class ExtractionGenerated(Event):
    """One extractor generation: the CISPO training sample, and the origin of the ops it produced."""

    kind: Literal["ExtractionGenerated"] = "ExtractionGenerated"
    schema_version: Literal[1] = 1
    generation_id: Id = Field(description="Deterministic id; op ids derive from it and the op index.")
    extractor_version: NonNegativeInt = Field(description="Extractor policy version that generated it.")
    purpose: Literal["distill", "merge", "ask"] = Field(description="Distil a trajectory, merge a chunk, or answer.")
    task_family: Id
    step: NonNegativeInt | None = Field(
        default=None, description="Actor step of the trajectory it read (distil/ask), or the step after which the "
        "merge was requested (merge). Optional: generations written before it existed have none.")
    source_trajectory_ids: tuple[Id, ...] = Field(default=(), description="Trajectories it read (distil/ask).")
    shown: tuple[ExperienceRef, ...] = Field(default=(), description="Experiences shown; alias i+1 is shown[i].")
    prompt_token_ids: TokenIds
    response_token_ids: TokenIds
    sampling_logprobs: LogProbs = Field(description="Behaviour log-probs; CISPO's ratio is taken against them.")
    response_text: str
    parse_status: ParseStatus = Field(description="ok: ops emitted; no_op: nothing kept; parse_error: rejected.")
    parse_error: str | None = Field(default=None, description="Why the answer was rejected (parse_error only).")
    op_ids: tuple[Id, ...] = Field(default=(), description="Ops it produced, in order.")

    @model_validator(mode="after")
    def _consistent(self) -> ExtractionGenerated:
        if len(self.sampling_logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"{len(self.sampling_logprobs)} sampling log-probs for {len(self.response_token_ids)} response tokens"
            )
        if (self.parse_status == "parse_error") != (self.parse_error is not None):
            raise ValueError("parse_error is set exactly when parse_status is 'parse_error'")
        if (self.parse_status == "ok") != bool(self.op_ids):
            raise ValueError("op_ids are non-empty exactly when parse_status is 'ok'")
        return self
