"""`crl`: the command line. Settings are read here, once; errors become exit codes here and nowhere else.

    crl stack up --run-dir runs/demo             # embedded broker + topics, until Ctrl-C
    crl worker archiver --run-dir runs/demo      # any worker kind of the WORKERS registry
    crl doctor --embedded                        # is everything here and working?
    crl audit sql runs/demo "SELECT kind, count(*) FROM events GROUP BY kind"
    crl replay train runs/demo                   # re-run every training step, compare weight hashes

One module per command group (`topics`, `stack`, `worker`, `run`, `doctor`, `audit`, `replay`, `bank`, `report`,
`track`, `config`, `envs`, `models`); each command parses its arguments, calls one function of the layers below,
prints, and turns errors into exit codes (`pipeline.cli.common.fail`): 1 for a failed check or query, 2 for bad
settings or usage.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import audit, bank, doctor, envs, models, replay, report, run, stack, topics, track, worker
from pipeline.cli import config as config_commands
from pipeline.cli.common import LogLevel, State, configure_logging, errors, report_settings_error, with_exit_codes
from pipeline.errors import ConfigError
from pipeline.settings import load_settings

app = typer.Typer(
    help="Complementary RL on an event log: run the stack, run workers, audit runs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(topics.topics_app, name="topics")
app.add_typer(replay.replay_app, name="replay")
app.add_typer(bank.bank_app, name="bank")
app.add_typer(stack.stack_app, name="stack")
app.add_typer(audit.audit_app, name="audit")
app.add_typer(config_commands.config_app, name="config")
app.add_typer(envs.envs_app, name="envs")
app.add_typer(models.models_app, name="models")
app.command("worker")(worker.worker)
app.command("run")(run.run)
app.command("doctor")(doctor.doctor)
app.command("report")(report.report)
app.command("track")(track.track)
for _typer in (app, *(group.typer_instance for group in app.registered_groups)):
    for _command in _typer.registered_commands:  # type: ignore[union-attr]
        _command.callback = with_exit_codes(_command.callback)  # type: ignore[arg-type]


@app.callback()
def _load(
    log_level: Annotated[LogLevel, typer.Option(
        envvar="CRL_LOG_LEVEL", help="Console logging level (worker log files always get info).")]
    = LogLevel.warning,
    config: Annotated[Path | None, typer.Option(
        help="Run config (YAML); same as CRL_CONFIG. CRL_* variables override it.")] = None,
) -> None:
    """Read settings from CRL_* environment variables (validated field by field)."""
    # Nothing may reach a model hub at run time; set before any Hugging Face library is imported.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    State.log_level = log_level.value
    configure_logging(log_level.value)
    if "CRL_TANSU_BIN" in os.environ:
        errors.print("[yellow]warning:[/yellow] CRL_TANSU_BIN is ignored; the setting is now CRL_BROKER__TANSU_BIN")
    try:
        State.settings = load_settings(config)
    except ConfigError as exc:
        report_settings_error(exc)
        raise typer.Exit(2) from exc


def main() -> None:
    app()
