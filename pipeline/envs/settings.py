"""How environments are built (`CRL_ENVS__*`) and one entry of a run's task mixture."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EnvSettings(BaseModel):
    """How environments are built. Environment: `CRL_ENVS__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    invalid_action: Literal["skip", "end"] = Field(
        default="skip",
        description="A response naming no available action: 'skip' uses up the turn without stepping the "
        "environment (the next observation says it was invalid); 'end' ends the episode as a failure.")
    alfworld_data: Path | None = Field(
        default=None, description="ALFWorld's data directory (alfworld-download); required by the ALFWorld env.")
    webshop_num_products: int = Field(default=1000, gt=0, description="WebShop catalogue size (paper: 1,000).")
    swebench_instances: Path | None = Field(
        default=None, description="SWE-Bench Verified instances as a local JSON list; required by that env.")


class TaskMix(BaseModel):
    """One environment of the training mixture."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env_id: str = Field(description="An id of the env registry (`crl envs list`), e.g. 'MiniHack-Room-Random-5x5-v0'.")
    weight: float = Field(default=1.0, gt=0, description="Relative share of the step's task groups.")
    max_turns: int | None = Field(default=None, gt=0, description="Turn limit; None: the env's paper setting.")
