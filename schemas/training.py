"""Policy versions, training steps and warm-start progress (`crl.policy`, `crl.train-steps`); the two trainers
produce them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.base import Event, Id, NonNegativeInt, Role, Sha256Hex


class PolicyPublished(Event):
    """A new policy checkpoint is ready. Consumers load it only after its sha256 checks out."""

    kind: Literal["PolicyPublished"] = "PolicyPublished"
    schema_version: Literal[1] = 1
    role: Role
    version: NonNegativeInt = Field(description="Policy version; 0 is the initial checkpoint.")
    step: NonNegativeInt = Field(description="Training step that produced it.")
    checkpoint_uri: str = Field(min_length=1, description="Where the checkpoint lies (file:// URI or path).")
    sha256: Sha256Hex = Field(description="sha256 of the checkpoint manifest.")


class TrainStepCompleted(Event):
    """One optimiser step, recorded well enough to re-run it and compare the weights."""

    kind: Literal["TrainStepCompleted"] = "TrainStepCompleted"
    schema_version: Literal[1] = 1
    role: Role
    step: NonNegativeInt
    policy_version: NonNegativeInt = Field(description="Version published after this step.")
    batch_event_ids: tuple[Id, ...] = Field(min_length=1, description="Events that formed the batch, in order.")
    dropped_event_ids: tuple[Id, ...] = Field(default=(), description="Stragglers dropped at the group timeout.")
    timed_out: bool = Field(default=False, description="True when the batch was closed by the timeout.")
    weight_hash_before: Sha256Hex
    weight_hash_after: Sha256Hex
    loss: float
    tokens: NonNegativeInt = Field(description="Tokens that carried loss.")
    loss_variant: Id = Field(description="Which loss ran, e.g. 'grpo' or 'cispo'.")
    aggregation: Id = Field(description="Loss aggregation, e.g. 'token-mean' or 'seq-mean-token-mean'.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Namespaced scalars (train/..., rollout/...).")
    rewards: tuple[float, ...] = Field(default=(), description="Per batch event: the reward the step used.")
    advantages: tuple[float, ...] = Field(
        default=(), description="Per batch event: the advantage the step used (after any weights), for replay.")
    outcome_counts: tuple[NonNegativeInt, ...] = Field(
        default=(), description="Extractor: per generation, the guided outcomes its reward averaged.")
    world_size: int = Field(
        default=1, ge=1, le=2**31 - 1,
        description="Data-parallel ranks that took the step (each trained a shard of the batch, the gradients "
        "summed); the weights depend on it through float summation order, so `crl replay train` replays the step "
        "on as many ranks. Events written before this field decode as 1.")

    @model_validator(mode="after")
    def _aligned(self) -> TrainStepCompleted:
        for name in ("rewards", "advantages", "outcome_counts"):
            values = getattr(self, name)
            if values and len(values) != len(self.batch_event_ids):
                raise ValueError(f"{len(values)} {name} for {len(self.batch_event_ids)} batch events")
        return self


WarmStartPhase = Literal["data", "train", "done"]
"""Where a warm start is: playing its data episodes, taking its fine-tuning steps, or finished."""


class WarmStartGateCheck(BaseModel):
    """One bound of a warm start's gate (`warm_start.gate`) and what the warm-started policy measured against it on
    held-out data (`pipeline.rl.warm_gate`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: Id = Field(description="The bound: min_parse_ok, min_states_revealed, min_success_right or "
                     "max_success_wrong.")
    value: float = Field(ge=0, le=1, description="The share measured.")
    bound: float = Field(ge=0, le=1, description="The bound it was held against (at least, or at most).")
    samples: NonNegativeInt = Field(description="Episodes or lessons the share is taken over.")
    passed: bool


class WarmStartProgressed(Event):
    """How far a trainer's warm start has come (`pipeline.rl.warm_start`), published while it builds version 0 so
    the live view can show it: the first and the last of each phase and at most about one a second between them.
    The id is derived from (run, role, phase, done), so a restarted trainer that reaches the same point again
    publishes it under the same id. Nothing is replayed from these: the warm start's result is version 0's
    checkpoint."""

    kind: Literal["WarmStartProgressed"] = "WarmStartProgressed"
    schema_version: Literal[1] = 1
    role: Role
    phase: WarmStartPhase = Field(description="'data': playing data episodes; 'train': fine-tuning; 'done'.")
    done: NonNegativeInt = Field(description="Episodes played (data) or steps taken (train, done) so far.")
    total: NonNegativeInt = Field(description="Episodes to play (data) or steps to take (train, done).")
    loss: float | None = Field(
        default=None, description="The latest step's loss (train; done: the last step's); None in phase data.")
    cached: bool = Field(
        default=False, description="The result was loaded from the warm-start cache (then only `done` is published).")
    elapsed_s: float = Field(ge=0, description="Seconds since the warm start began.")
    gate: tuple[WarmStartGateCheck, ...] | None = Field(
        default=None, description="Phase done: the warm start's gate, checked on held-out data (None: the config "
        "sets no gate).")

    @model_validator(mode="after")
    def _done_within_total(self) -> WarmStartProgressed:
        if self.done > self.total:
            raise ValueError(f"done {self.done} is more than total {self.total}")
        return self
