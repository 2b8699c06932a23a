"""Episode assignments (`crl.tasks`); the scheduler produces them, rollout workers consume them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.base import Event, Id, NonNegativeInt, Split


class EpisodeAssigned(Event):
    """One slot of one GRPO group: play `env_id` from `seed`, guided by an experience or free."""

    kind: Literal["EpisodeAssigned"] = "EpisodeAssigned"
    schema_version: Literal[1] = 1
    step: NonNegativeInt = Field(description="Training step this episode belongs to.")
    split: Split = Field(description="'train' episodes feed the trainers; 'eval' ones only measure.")
    env_id: Id = Field(description="Environment id in the env registry, e.g. 'MiniHack-Room-Random-5x5-v0'.")
    task_family: Id = Field(description="Bank partition used for retrieval, e.g. 'minihack-room'.")
    seed: NonNegativeInt = Field(description="Task seed; every slot of a group shares it.")
    group_id: Id = Field(description="The GRPO group (one task, K slots).")
    slot: NonNegativeInt = Field(description="Index of this episode in its group, 0..group_size-1.")
    group_size: int = Field(gt=0, description="K, the number of episodes in the group.")
    guided: bool = Field(description="True: retrieve an experience at episode start. False: play free.")
    policy_version: NonNegativeInt = Field(description="Oldest actor version allowed to play it (staleness bound).")
    max_turns: int = Field(gt=0, description="Turn limit for the episode.")
    bank_position: NonNegativeInt | None = Field(
        default=None,
        description="Deterministic mode: a guided slot is served from the bank as of this op-log offset (every op "
        "derived from the earlier steps, applied), and the rollout worker waits for its replica to get there. None: "
        "whatever the replica holds when the episode starts (the recorded `bank_offset` says which).")

    @model_validator(mode="after")
    def _slot_in_group(self) -> EpisodeAssigned:
        if self.slot >= self.group_size:
            raise ValueError(f"slot {self.slot} is outside a group of {self.group_size}")
        return self
