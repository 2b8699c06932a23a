"""What a run plays and how its environments are built (`CRL_ENVS__*`): the task mixture, the task pools, and
per-environment options."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TaskMix(BaseModel):
    """One environment of the training mixture."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env_id: str = Field(description="An id of the env registry (`crl envs list`), e.g. 'MiniHack-Room-Random-5x5-v0'.")
    weight: float = Field(default=1.0, gt=0, description="Relative share of the step's task groups.")
    max_turns: int | None = Field(default=None, gt=0, description="Turn limit; None: the env's paper setting.")


class EnvSettings(BaseModel):
    """What a run plays and how its environments are built: the task mixture, the task pools, and per-environment
    options. Environment: `CRL_ENVS__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tasks: tuple[TaskMix, ...] = Field(
        default=(TaskMix(env_id="MiniHack-Room-Random-5x5-v0"),), min_length=1,
        description="The mixture: each step's groups are drawn from these environments by weight.")
    train_pool_size: int = Field(default=1000, gt=0, description="Train task seeds per environment.")
    eval_tasks_per_env: int = Field(
        default=8, gt=0, description="Eval pool size per environment: tasks never drawn for training.")
    eval_repeats: int = Field(
        default=1, gt=0,
        description="Episodes per eval task and slot kind: each task is played this many times guided and as many "
        "free, so a small pool of recurring tasks still gives an evaluation enough episodes.")
    eval_recurring_per_env: int = Field(
        default=0, ge=0,
        description="Train-pool tasks per environment also evaluated (the first N of the pool; group ids end in "
        "-r<i>): where tasks recur, what the bank remembers of them is what memory is for. At most "
        "train_pool_size.")
    seed: int = Field(default=0, ge=0, description="Seeds the task pools and the draw of each step's tasks.")
    eval_seed: int | None = Field(
        default=None, ge=0,
        description="Seeds the eval pool of unseen tasks (None: `seed`); fixing it while `seed` varies keeps every "
        "run's evaluation on the same tasks. Eval tasks never meet a train pool of any seed.")
    invalid_action: Literal["skip", "end"] = Field(
        default="skip",
        description="A response naming no available action: 'skip' uses up the turn without stepping the "
        "environment (the next observation says it was invalid); 'end' ends the episode as a failure.")
    alfworld_data: Path | None = Field(
        default=None, description="ALFWorld's data directory (alfworld-download); required by the ALFWorld env.")
    webshop_num_products: int = Field(default=1000, gt=0, description="WebShop catalogue size (paper: 1,000).")
    swebench_instances: Path | None = Field(
        default=None, description="SWE-Bench Verified instances as a local JSON list; required by that env.")

    @model_validator(mode="after")
    def _recurring_within_the_pool(self) -> EnvSettings:
        if self.eval_recurring_per_env > self.train_pool_size:
            raise ValueError(f"eval_recurring_per_env ({self.eval_recurring_per_env}) exceeds train_pool_size "
                             f"({self.train_pool_size}): only train-pool tasks recur")
        return self
