"""How every worker polls, retries and reports (`CRL_RUNNER__*`): the settings the runtime itself reads."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RunnerSettings(BaseModel):
    """How every worker polls, retries and reports. Environment: `CRL_RUNNER__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    poll_timeout_ms: int = Field(default=200, gt=0, description="Longest wait in one poll; bounds stop latency.")
    max_retries: int = Field(default=5, ge=0, description="Retries of a RetryableError before the worker gives up.")
    retry_backoff_s: float = Field(default=0.2, gt=0, description="First retry delay; doubles each attempt.")
    retry_backoff_max_s: float = Field(default=5.0, gt=0, description="Cap on one retry delay.")
    outage_s: float = Field(default=300.0, ge=0, description=(
        "How long a commit keeps retrying a RetryableError of the worker's state flush or offset commit (a database "
        "or broker restarting) before the worker exits without committing; at least max_retries retries either way."))
    metrics_interval_s: float = Field(default=10.0, gt=0, description="Seconds between metrics lines.")
