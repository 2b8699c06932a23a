"""`crl envs list | show`: the environment registry."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from pipeline.cli.common import (
    console,
    current_settings,
)

envs_app = typer.Typer(help="The environment registry.", no_args_is_help=True)


@envs_app.command("list")
def envs_list() -> None:
    """Every env id with its task family, paper turn limit and whether it runs on this machine."""
    from pipeline.envs.registry import ENV_SPECS

    table = Table("env id", "task family", "max turns", "runs here")
    for spec in ENV_SPECS.values():
        table.add_row(spec.env_id, spec.task_family, str(spec.max_turns),
                      "yes" if spec.runs_here else "needs data/Docker")
    console.print(table)


@envs_app.command("show")
def envs_show(
    env_id: Annotated[str, typer.Argument(help="An env id of `crl envs list`.")],
    seed: Annotated[int, typer.Option(help="Task seed.")] = 0,
    actions: Annotated[list[str] | None, typer.Option("--action", help="Actions to play, in order.")] = None,
) -> None:
    """Reset an environment from a seed, play the given actions, and print what the agent sees at each turn."""
    from pipeline.envs.registry import make_env

    env = make_env(env_id, current_settings().envs)
    try:
        goal, observation = env.reset(seed)
        console.print(f"[bold]Goal:[/bold] {goal}", markup=True)
        console.print(observation, markup=False, highlight=False)
        for action in actions or []:
            outcome = env.step(action)
            console.print(f"[bold]> {action}[/bold]  valid {outcome.info.valid}, reward {outcome.reward}, "
                          f"done {outcome.done}, success {outcome.info.success}")
            console.print(outcome.observation, markup=False, highlight=False)
            if outcome.done:
                break
    finally:
        env.close()
