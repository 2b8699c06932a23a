"""The project's one error hierarchy, from its root: every exception `infra/`, `pipeline/` and `workers/` raise on
purpose descends from `PipelineError` (`schemas/` keeps its own `EventDecodeError` family: it imports nothing of the
repository). `pipeline.errors` re-exports these and adds the pipeline's own kinds; the CLI turns them into exit codes
in one place (`pipeline.cli.common.EXIT_CODES`).

- `RetryableError`: transient (a database briefly locked, a broker timeout); the runner retries with backoff.
- `PoisonMessageError`: this input can never be processed; the runner writes a dead letter and moves on.
- `ConfigError`: the settings or the environment are wrong; nothing starts.
- `HashMismatchError`: bytes or a state differ from the hash recorded for them (checkpoints, snapshots, blobs,
  downloads, replays).
- `InvalidArgumentError`, `UnknownItemError`, `InvalidStateError`: a caller's mistake (a bad value, an unknown id, a
  call at the wrong time). They also subclass `ValueError`, `KeyError` and `RuntimeError`, which is what such
  mistakes raise in Python.
- `BrokerError`: an embedded broker could not be found, installed, started or reached.
"""


class PipelineError(Exception):
    """Base of every error this project raises on purpose."""


class RetryableError(PipelineError):
    """A transient failure: the same input may succeed if retried later."""


class PoisonMessageError(PipelineError):
    """The input itself is bad; retrying cannot help."""


class ConfigError(PipelineError):
    """Settings or environment are invalid or incomplete."""


class HashMismatchError(PipelineError, ValueError):
    """Bytes or a state differ from the sha256 recorded for them: refuse them rather than run on other data."""


class InvalidArgumentError(PipelineError, ValueError):
    """A function was given a value it cannot work with."""


class UnknownItemError(PipelineError, KeyError):
    """An id or name that is not there (an experience, a topic, a step)."""

    def __str__(self) -> str:  # KeyError quotes its message; this one reads as a sentence
        return str(self.args[0]) if self.args else ""


class InvalidStateError(PipelineError, RuntimeError):
    """A call at the wrong time: on something closed, stopped, finished or not yet loaded."""


class BrokerError(PipelineError):
    """An embedded broker could not be found, installed, started or reached."""
