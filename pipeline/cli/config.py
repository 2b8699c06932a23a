"""`crl config show | check`: run configs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli.common import (
    console,
    current_settings,
    fail,
    report_settings_error,
)
from pipeline.errors import ConfigError
from pipeline.settings import Settings, load_settings

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
        return load_settings(path)
    except ConfigError as exc:
        report_settings_error(exc)
        raise typer.Exit(2) from exc


@config_app.command("reference")
def config_reference() -> None:
    """Print every setting (its YAML key, environment variable, default and meaning) as the Markdown page
    docs/configuration.md: `crl config reference > docs/configuration.md`."""
    console.print(settings_reference(), end="", markup=False, highlight=False, soft_wrap=True)


REFERENCE_INTRO = """\
# Configuration

Every setting of the project, generated from the settings classes by `crl config reference` (a test keeps this page
equal to its output). Settings are read once, at the command line, and passed down frozen. Three sources, the first
that names a setting wins:

1. `CRL_*` environment variables, `__` between levels: `CRL_SCHEDULER__STEPS=3`,
   `CRL_ACTOR_TRAINER__MODEL__LORA__RANK=8`. Lists and mappings are JSON: `CRL_ENVS__TASKS='[{"env_id": "..."}]'`;
   `null` sets a setting whose default may be None to None: `CRL_RETRIEVAL__SIMILARITY_MARGIN=null`.
2. A run config: YAML with the same structure (`configs/*.yaml`), named by `crl --config FILE`, by `CRL_CONFIG` or
   as the argument of `crl run CONFIG`. Unknown keys are errors.
3. The defaults below.

`crl config show` prints the resolved settings of a config (passwords masked); `crl config check FILE...` validates
configs. Every mistake is reported in one line that names where it was written, the key and the file or the
variable, with a guess for a misspelt name or choice (`actor_trainer.gruop_size in configs/x.yaml: unknown key; did
you mean group_size?`, `CRL_SCHEDULER__ARM: 'grp' is not one of complementary, grpo, ...; did you mean grpo?`), and
exit code 2. `crl run` writes the resolved settings to `RUN_DIR/config.yaml` and its workers read only that file.
"""


def settings_reference() -> str:
    """docs/configuration.md: one table per settings section, every field with its default and description."""
    from pydantic import BaseModel

    def rows(model: BaseModel, path: list[str]) -> list[tuple[list[str], BaseModel]]:
        sections = [(path, model)]
        for name in type(model).model_fields:
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                sections += rows(value, [*path, name])
        return sections

    defaults = {name: field.get_default(call_default_factory=True) for name, field in Settings.model_fields.items()}
    top = Settings.model_construct(**defaults)
    out = [REFERENCE_INTRO]
    for path, model in rows(top, []):
        leaves = [(name, field) for name, field in type(model).model_fields.items()
                  if not isinstance(getattr(model, name), BaseModel)]
        if not leaves:
            continue
        title = ".".join(path) or "top level"
        doc = (type(model).__doc__ or "").strip().split("\n\n")[0] if path else ""
        out.append(f"\n## `{title}`\n" if path else "\n## Top level\n")
        if doc:
            out.append("\n" + " ".join(doc.split()) + "\n")
        out.append("\n| setting | variable | default | meaning |\n|---|---|---|---|\n")
        for name, field in leaves:
            key = ".".join([*path, name])
            variable = "CRL_" + "__".join([*path, name]).upper()
            default = _shown_default(getattr(model, name))
            meaning = " ".join((field.description or "").split()).replace("|", "\\|")
            out.append(f"| `{key}` | `{variable}` | {default} | {meaning} |\n")
    return "".join(out)


def _shown_default(value: object) -> str:
    import json

    from pydantic import SecretStr

    if value is None:
        return "none"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, Path):
        text = str(value)
        home = str(Path.home())
        text = "~" + text[len(home):] if text.startswith(home) else text
    elif isinstance(value, str):
        text = value
    else:
        from pydantic import TypeAdapter

        text = json.dumps(TypeAdapter(type(value)).dump_python(value, mode="json"))
    return "`" + text.replace("|", "\\|") + "`"
