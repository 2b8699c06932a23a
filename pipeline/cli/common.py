"""What every command shares: the consoles, the settings read once by the app callback, the `--run-dir` and
`--broker` options, and `fail`, the one way a command turns an error into an exit code."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from kafka.errors import KafkaError
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from infra.kafka import KafkaSettings
from pipeline.errors import ConfigError, HashMismatchError, PipelineError
from pipeline.runtime.context import resolve_kafka
from pipeline.settings import Settings

console = Console()

errors = Console(stderr=True, soft_wrap=True)
"""Errors are one line each, however narrow the terminal or pipe: never wrapped."""

RunDirOption = Annotated[
    Path | None, typer.Option("--run-dir", help="Run directory; its broker file says where the run's broker is "
                              "(default: CRL_RUN_DIR, else run_dir of the --config file, else runs/default).")
]


class State:
    settings: Settings | None = None
    log_level: str = "warning"


def configure_logging(level: str, log_file: Path | None = None) -> None:
    """Log to stderr at `level`; with `log_file`, also everything from INFO up into that file (the worker's log)."""
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    console_handler = logging.StreamHandler(sys.stderr)
    console_handler.setLevel(level.upper())
    # kafka-python logs every failed connection attempt while it retries; the console shows our own summary of a
    # failure instead (the worker's log file keeps kafka-python's lines).
    console_handler.addFilter(lambda record: not record.name.startswith("kafka") or record.levelno >= logging.CRITICAL)
    handlers: list[logging.Handler] = [console_handler]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setLevel(logging.INFO)
        handlers.append(file_handler)
    for handler in handlers:
        handler.setFormatter(formatter)
    root_level = min(console_handler.level, logging.INFO if log_file else console_handler.level)
    logging.basicConfig(level=root_level, handlers=handlers, force=True)
    # kafka-python is chatty at INFO (every connection); its warnings and errors still show.
    logging.getLogger("kafka").setLevel(max(logging.WARNING, root_level))


def current_settings(run_dir: Path | None = None) -> Settings:
    settings = State.settings
    assert settings is not None, "the app callback loads settings first"
    if run_dir is not None:
        settings = settings.model_copy(update={"run_dir": run_dir})
    return settings


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `message` as an error and return the `typer.Exit` to raise (for usage errors a command finds itself)."""
    errors.print(f"[red]error:[/red] {escape(message)}", highlight=False)
    return typer.Exit(code)


EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (ConfigError, 2),
    (ValidationError, 2),
    (PipelineError, 1),
    (KafkaError, 1),
)
"""How an error that reaches the CLI ends the command, first match wins: 2 for bad settings or environment (usage),
1 for a failed run, check, replay or query. The one place errors become exit codes."""


def report_settings_error(exc: ConfigError) -> None:
    """A settings error, one line per problem (`pipeline.settings.load_settings` words them)."""
    for line in str(exc).splitlines():
        errors.print(f"[red]error:[/red] {escape(line)}", highlight=False)


def _report(exc: BaseException) -> None:
    if isinstance(exc, ValidationError):
        from pipeline.settings_errors import explain

        title = exc.title
        root = Settings if title == "Settings" else None
        for line in (explain(exc, None, root) if root is not None else
                     [f"{title}: {' '.join(str(item['msg']).split())}" for item in exc.errors(include_url=False)]):
            errors.print(f"[red]error:[/red] {escape(line)}", highlight=False)
    elif isinstance(exc, HashMismatchError):
        for line in str(exc).splitlines():
            errors.print(f"[red]mismatch:[/red] {escape(line)}", highlight=False)
    elif isinstance(exc, ConfigError):
        report_settings_error(exc)
    elif isinstance(exc, KafkaError):
        errors.print(f"[red]error:[/red] Kafka failed: {type(exc).__name__}: {escape(str(exc))} (is the broker "
                     "running? `crl doctor` checks)", highlight=False)
    else:
        errors.print(f"[red]error:[/red] {type(exc).__name__}: {escape(str(exc))}", highlight=False)


def with_exit_codes(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command`, with the errors of `EXIT_CODES` printed and turned into their exit codes."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except tuple(kind for kind, _ in EXIT_CODES) as exc:
            _report(exc)
            code = next(code for kind, code in EXIT_CODES if isinstance(exc, kind))
            raise typer.Exit(code) from exc

    return run


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


def kafka_of(settings: Settings) -> KafkaSettings:
    return resolve_kafka(settings)


@contextmanager
def broker_admin(run_dir: Path | None) -> Iterator[Any]:
    """A Kafka admin client of the run's broker, closed on exit."""
    from infra.kafka import make_admin

    admin = make_admin(kafka_of(current_settings(run_dir)))
    try:
        yield admin
    finally:
        admin.close()


class BrokerChoice(StrEnum):
    tansu = "tansu"
    kafka = "kafka"

BrokerOption = Annotated[BrokerChoice | None, typer.Option(
    "--broker", help="Embedded broker: tansu (memory-only, starts in ms) or kafka (Apache Kafka 4.1.1, Java 17, "
    "durable). Default: CRL_BROKER__KIND, else tansu.")]


BrokersOption = Annotated[int | None, typer.Option(
    "--brokers", min=1, max=9, help="Nodes of the embedded Apache Kafka: 3 starts a replicated KRaft cluster (3 "
    "replicas, 2 in sync) that survives one dead node. Default: CRL_BROKER__BROKERS, else 1.")]


class SecurityChoice(StrEnum):
    none = "none"
    sasl_ssl = "sasl_ssl"


SecurityOption = Annotated[SecurityChoice | None, typer.Option(
    "--security", help="Secure the embedded Apache Kafka: sasl_ssl serves TLS with SCRAM-SHA-512 logins (an admin and "
    "one principal per worker kind, passwords in RUN_DIR/security/) and ACLs from each kind's declared topics. "
    "Default: CRL_BROKER__SECURITY, else none.")]


def with_broker(settings: Settings, broker: BrokerChoice | None, brokers: int | None = None,
                security: SecurityChoice | None = None) -> Settings:
    """`settings` with the embedded broker the command line chose (kind, number of nodes, security)."""
    update: dict[str, Any] = {}
    if broker is not None:
        update["kind"] = broker.value
    if brokers is not None:
        update["brokers"] = brokers
    if security is not None:
        update["security"] = security.value
    if not update:
        return settings
    from pydantic import ValidationError

    from infra.broker import BrokerSettings

    try:
        chosen = BrokerSettings.model_validate(settings.broker.model_dump() | update)
    except ValidationError as exc:
        raise fail(str(exc.errors()[0]["msg"]).removeprefix("Value error, "), 2) from exc
    return settings.model_copy(update={"broker": chosen})
