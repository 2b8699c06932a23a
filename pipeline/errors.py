"""The project's error hierarchy. Errors become exit codes only at the CLI edge.

- `RetryableError`: transient (a database briefly locked, a broker timeout); the runner retries with backoff.
- `PoisonMessageError`: this input can never be processed; the runner writes a dead letter and moves on.
- `ConfigError`: the settings or the environment are wrong; nothing starts.
- `CheckpointError`: a model checkpoint is missing a file or does not match its manifest or published hash.
"""


class PipelineError(Exception):
    """Base of every error this project raises on purpose."""


class RetryableError(PipelineError):
    """A transient failure: the same input may succeed if retried later."""


class PoisonMessageError(PipelineError):
    """The input itself is bad; retrying cannot help."""


class ConfigError(PipelineError):
    """Settings or environment are invalid or incomplete."""


class WorkerFailedError(PipelineError):
    """A worker gave up (retries exhausted, outputs not acknowledged); its input offsets were not committed."""


class CheckpointError(PipelineError):
    """A checkpoint on disk is incomplete, or its bytes differ from its manifest or from the hash it was published
    with; loading it would train or serve different weights than recorded."""
