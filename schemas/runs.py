"""Run lifecycle and control events (`crl.runs`, `crl.control`; the scheduler produces them), and deterministic mode's
`StepSettled` (`crl.train-steps`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from schemas.base import Event, Id, NonNegativeInt


class RunStarted(Event):
    """A run began. Carries everything needed to reproduce it: the resolved config and the code version."""

    kind: Literal["RunStarted"] = "RunStarted"
    schema_version: Literal[1] = 1
    config: dict[str, Any] = Field(description="The fully resolved run config (JSON-serialisable).")
    code_version: str = Field(min_length=1, description="Git commit (plus '-dirty') or package version.")

    @field_validator("config")
    @classmethod
    def _strict_json(cls, config: dict[str, Any]) -> dict[str, Any]:
        # NaN / inf would be written as null and the config would not replay as it was run.
        try:
            json.dumps(config, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config must be plain JSON without NaN or infinity: {exc}") from exc
        return config


class RunFinished(Event):
    """A run ended, normally after its last step or early on a stop request or a failure."""

    kind: Literal["RunFinished"] = "RunFinished"
    schema_version: Literal[1] = 1
    status: Literal["completed", "stopped", "failed"] = Field(description="How the run ended.")
    steps_completed: NonNegativeInt = Field(description="Training steps scheduled and completed.")
    reason: str | None = Field(default=None, description="Why it stopped or failed; None when completed.")
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description="The run's rollout totals and its last evaluation (success, actions per solved, invalid rate; "
        "per environment and subgroup), namespaced train/... and eval/...")


class MergeRequested(Event):
    """The scheduler asks extractors to consolidate the bank (every N actor steps, per task family)."""

    kind: Literal["MergeRequested"] = "MergeRequested"
    schema_version: Literal[1] = 1
    merge_id: Id = Field(description="Deterministic id of this merge round; op ids derive from it.")
    step: NonNegativeInt = Field(description="The actor step after which the merge was requested.")
    task_families: tuple[Id, ...] = Field(min_length=1, description="Families whose experiences are merged.")


class StopRequested(Event):
    """Someone (a person or the scheduler) asked every worker of the run to finish and stop."""

    kind: Literal["StopRequested"] = "StopRequested"
    schema_version: Literal[1] = 1
    reason: str = Field(min_length=1, description="Why the run is being stopped.")


class RunResumed(Event):
    """`crl run --resume` continues the run: a `StopRequested` before this on `crl.control` no longer stops it, and
    the run's next `RunFinished` is that of this attempt."""

    kind: Literal["RunResumed"] = "RunResumed"
    schema_version: Literal[1] = 1
    attempt: int = Field(ge=1, description="1 for the first resume, 2 for the second, ...")
    previous_status: Literal["stopped", "failed", "interrupted"] = Field(
        description="How the previous attempt ended: stopped (RunFinished stopped), failed, or interrupted (no "
        "RunFinished: a crash, a kill, a lost broker).")


class StepSettled(Event):
    """On `crl.train-steps`. Deterministic mode (`scheduler.deterministic`): a worker finished its part of a step, so
    the next one may be issued. The extractor trainer publishes it once it trained on every outcome of the step's
    train episodes (its version is the one that distils the step); the extractor once it distilled every train
    episode of the step (in trajectory-id order, with that version), ran the merge due after it, and read its ops
    back (`bank_offset`: where the op log then ends, the bank the next step is served from)."""

    kind: Literal["StepSettled"] = "StepSettled"
    schema_version: Literal[1] = 1
    role: Literal["extractor", "extractor_trainer"] = Field(description="Which worker settled the step.")
    step: NonNegativeInt = Field(description="The step it settled.")
    extractor_version: NonNegativeInt = Field(
        description="The extractor trainer's version after the step (extractor_trainer); the version that distilled "
        "the step (extractor).")
    bank_offset: NonNegativeInt | None = Field(
        default=None, description="extractor: the end of the op log once every op of the step was applied.")
    extraction_event_ids: tuple[str, ...] = Field(
        default=(), description="extractor: the `ExtractionGenerated` events it published for the step (distillations "
        "and the merge), so the extractor trainer waits until it has read them all.")
