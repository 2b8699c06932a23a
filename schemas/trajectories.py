"""Finished episodes (`crl.trajectories`); rollout workers produce them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.arrays import LogProbs, TokenIds
from schemas.base import Event, Id, NonNegativeInt, Split


class ExperienceRef(BaseModel):
    """An experience as it was served: the exact version, and the extractor generation that wrote that version."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    experience_id: Id
    version: int = Field(ge=1, description="Version of the experience text that was shown.")
    generation_id: Id = Field(description="ExtractionGenerated that wrote this version (credit goes there).")


class Turn(BaseModel):
    """One actor turn: what it saw, what it generated (with sampling log-probs), what the environment did."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    observation: str = Field(description="Observation text shown before the action (experience text stripped).")
    prompt_token_ids: TokenIds = Field(description="Full prompt given to the actor for this turn.")
    response_token_ids: TokenIds = Field(description="Tokens the actor generated.")
    sampling_logprobs: LogProbs = Field(description="Log-prob of each generated token under the sampling policy.")
    response_text: str = Field(description="Decoded response.")
    action: str = Field(description="Action parsed from the response and sent to the environment.")
    valid: bool = Field(description="Whether the environment accepted the action as valid.")
    reward: float = Field(description="Environment reward for this turn.")

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> Turn:
        if len(self.sampling_logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"{len(self.sampling_logprobs)} sampling log-probs for {len(self.response_token_ids)} response tokens"
            )
        return self


class Timings(BaseModel):
    """Where the episode's wall time went, in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    generation_s: float = Field(ge=0)
    env_s: float = Field(ge=0)
    retrieval_s: float = Field(ge=0)


class TrajectoryCompleted(Event):
    """A finished episode with everything training and credit assignment need, and what the episode revealed for the
    extractor (v2: `final_observation`, `revealed`; a v1 event is upcast with both unknown)."""

    kind: Literal["TrajectoryCompleted"] = "TrajectoryCompleted"
    schema_version: Literal[2] = 2
    trajectory_id: Id
    assignment_event_id: Id = Field(description="event_id of the EpisodeAssigned this episode played.")
    step: NonNegativeInt
    split: Split
    env_id: Id
    task_family: Id
    seed: NonNegativeInt
    group_id: Id
    slot: NonNegativeInt
    guided: bool
    goal: str = Field(description="Task goal text.")
    turns: tuple[Turn, ...] = Field(description="Every turn, in order.")
    reward: float = Field(description="Outcome reward (1/0; ALFWorld +1/-1).")
    success: bool
    num_actions: NonNegativeInt = Field(description="Actions taken (efficiency metric).")
    invalid_actions: NonNegativeInt = Field(description="Actions the environment rejected.")
    truncated: bool = Field(description="True when the episode hit its turn or step limit.")
    final_observation: str | None = Field(
        default=None, description="The environment's text after the last action: how the episode ended. None: not "
        "recorded (events of schema version 1).")
    revealed: tuple[str, ...] = Field(
        default=(), description="Facts the episode uncovered, as the environment states them (for example where "
        "the goal turned out to be, relative to the start); the extractor's digest carries them.")
    retrieved: tuple[ExperienceRef, ...] = Field(default=(), description="Experiences served at episode start.")
    bank_offset: NonNegativeInt | None = Field(
        default=None, description="Next experience-op offset the replica had applied when it served `retrieved`."
    )
    policy_version: NonNegativeInt = Field(description="Actor version that generated every turn.")
    timings: Timings
    score: float | None = Field(
        default=None, description="The environment's own progress score when the episode ended (0-1; ScienceWorld's "
        "falls below 0 on a failed task), where it keeps one (the text worlds). The reward stays the outcome reward.")
    env_error: str | None = Field(
        default=None, description="Why the environment's engine failed this episode (it crashed or threw while "
        "resetting or stepping); None: the episode ran to its end. Such an episode is a failure on the log but "
        "carries no learning signal: the trainers give it no advantage, the extractor neither distils it nor is "
        "credited by it.")

    @model_validator(mode="after")
    def _consistent(self) -> TrajectoryCompleted:
        if self.retrieved and not self.guided:
            raise ValueError("a free (unguided) episode cannot carry retrieved experiences")
        if self.retrieved and self.bank_offset is None:
            raise ValueError("bank_offset is required when experiences were retrieved")
        if self.invalid_actions > self.num_actions:
            raise ValueError("invalid_actions cannot exceed num_actions")
        if self.env_error is not None and self.success:
            raise ValueError("an episode whose engine failed cannot be a success")
        return self
