"""`crl config show | check`: run configs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from pipeline.cli.common import (
    console,
    current_settings,
    errors,
    fail,
)
from pipeline.errors import ConfigError
from pipeline.settings import Settings

config_app = typer.Typer(help="Run configs: YAML files with the structure of the settings.", no_args_is_help=True)


@config_app.command("show")
def config_show(
    config: Annotated[Path | None, typer.Argument(help="Run config; default: --config / CRL_CONFIG.")] = None,
) -> None:
    """Print the resolved settings (the file, CRL_* overrides, defaults) as YAML, passwords masked."""
    import yaml

    from pipeline.provenance import resolved_config

    settings = current_settings() if config is None else _config_settings(config)
    console.print(yaml.safe_dump(resolved_config(settings), sort_keys=False), end="", markup=False, highlight=False)


@config_app.command("check")
def config_check(configs: Annotated[list[Path], typer.Argument(help="Run config files.")]) -> None:
    """Validate run configs; exit 1 naming every invalid one and why."""
    failed = 0
    for path in configs:
        try:
            settings = _config_settings(path)
        except typer.Exit:
            failed += 1
            continue
        tasks = ", ".join(t.env_id for t in settings.envs.tasks)
        console.print(f"[green]ok[/green]      {path}  arm {settings.scheduler.arm}, {settings.scheduler.steps} steps, "
                      f"{tasks}")
    if failed:
        raise fail(f"{failed} of {len(configs)} configs are invalid")


def _config_settings(path: Path) -> Settings:
    try:
        return Settings(config=path)
    except ConfigError as exc:
        errors.print(f"[red]invalid[/red] {path}: {exc}")
        raise typer.Exit(2) from exc
    except ValidationError as exc:
        errors.print(f"[red]invalid[/red] {path}:")
        for item in exc.errors(include_url=False):
            errors.print(f"  {'.'.join(str(part) for part in item['loc'])}: {item['msg']}")
        raise typer.Exit(2) from exc
