"""The tracker's settings (`CRL_TRACKER__*`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Backend = Literal["tensorboard", "wandb", "mlflow"]


class TrackerSettings(BaseModel):
    """What the tracker worker writes, and where. Environment: `CRL_TRACKER__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(default=True, description="Whether `crl run` starts the tracker worker.")
    backends: tuple[Backend, ...] = Field(
        default=("tensorboard",), min_length=1,
        description="Where entries go: tensorboard (RUN_DIR/tensorboard), wandb (offline unless wandb_mode says "
        "otherwise), mlflow (a local SQLite store unless mlflow_tracking_uri names one); the latter two need "
        "`pip install -e '.[tracking]'`.")
    samples_per_step: int = Field(
        default=2, ge=0, description="Guided and as many free episodes of each step shown as text.")
    flush_interval_s: float = Field(default=2.0, gt=0, description="Seconds between flushes to the backends.")
    wandb_project: str = Field(default="complementary-rl", min_length=1, description="The W&B project.")
    wandb_entity: str | None = Field(default=None, description="The W&B entity (team or user); None: the default.")
    wandb_mode: Literal["offline", "online"] = Field(
        default="offline", description="offline: RUN_DIR/wandb, for `wandb sync` later; online: needs a login.")
    mlflow_tracking_uri: str | None = Field(
        default=None, description="An MLflow tracking URI (a server or database); None: sqlite in RUN_DIR/mlflow.db.")
    mlflow_experiment: str = Field(default="complementary-rl", min_length=1, description="The MLflow experiment.")
