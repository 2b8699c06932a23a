"""The project's error hierarchy (rooted in `infra.errors`, re-exported here) and the pipeline's own kinds. Errors
become exit codes only at the CLI edge (`pipeline.cli.common.EXIT_CODES`).

- `RetryableError`: transient (a database briefly locked, a broker timeout); the runner retries with backoff.
- `GroupMembershipLostError`: the group coordinator refused an offset commit from a member it no longer counts in;
  the runner commits nothing of it and lets the next poll rejoin.
- `PoisonMessageError`: this input can never be processed; the runner writes a dead letter and moves on.
- `ConfigError` (and `EnvUnavailableError`): the settings or the environment are wrong; nothing starts.
- `HashMismatchError` (and `CheckpointError`): recorded and actual hashes differ; every `crl replay` mismatch is one.
- `EngineCrashedError`: an environment's engine failed mid-episode; that episode fails with the reason, not the worker.
- `WorkerFailedError`: a worker gave up; its inputs stay uncommitted (`RankFailedError`: a rank of a data-parallel
  trainer died, timed out or diverged).
- `RunFailedError`: `crl run` stopped because a worker kept crashing or the broker died.
- `InvalidArgumentError`, `UnknownItemError`, `InvalidStateError`: a caller's mistake.
"""

from infra.errors import (
    BrokerError,
    ConfigError,
    HashMismatchError,
    InvalidArgumentError,
    InvalidStateError,
    PipelineError,
    PoisonMessageError,
    RetryableError,
    UnknownItemError,
)

__all__ = [
    "AuditQueryError", "BrokerError", "CheckpointError", "ConfigError", "EngineCrashedError", "EnvUnavailableError",
    "GroupMembershipLostError", "HashMismatchError",
    "InvalidArgumentError", "InvalidStateError", "ParseError", "PipelineError", "PoisonMessageError",
    "RankFailedError", "RetryableError", "RunFailedError", "SnapshotError", "UnknownItemError", "WorkerFailedError",
]


class GroupMembershipLostError(PipelineError):
    """An offset commit the group coordinator refuses because this consumer is not a member of the group's current
    generation (removed after missed heartbeats, or in the middle of a rebalance): retrying cannot help, only a poll,
    which rejoins the group, makes commits possible again."""


class WorkerFailedError(PipelineError):
    """A worker gave up (retries exhausted, outputs not acknowledged); its input offsets were not committed."""


class RankFailedError(WorkerFailedError):
    """A data-parallel trainer lost a rank (killed, crashed, or silent past the collective timeout) or its ranks hold
    different weights after a step; the step is not published and the trainer stops."""


class CheckpointError(HashMismatchError):
    """A checkpoint on disk is incomplete, or its bytes differ from its manifest or from the hash it was published
    with; loading it would train or serve different weights than recorded."""


class SnapshotError(HashMismatchError):
    """A bank snapshot directory is incomplete, corrupt (its files or state differ from its manifest), or not one."""


class EnvUnavailableError(ConfigError):
    """An environment whose package, data or service is not on this machine; the message says how to get it."""


class EngineCrashedError(PipelineError):
    """An environment's engine (a JVM behind py4j) died or threw while resetting or stepping: the episode it played
    ends as failed with this message as its recorded reason; the next episode gets a fresh engine."""


class AuditQueryError(InvalidArgumentError):
    """An audit query that is not a single read-only statement, or that DuckDB refuses."""


class ParseError(InvalidArgumentError):
    """An extractor answer that does not follow the format; recorded as `parse_error` with this message."""


class RunFailedError(PipelineError):
    """`crl run` stopped: a worker kept crashing, the broker died, or the log could not be read."""
