"""`crl envs list | show | random-play`: the environment registry."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from pipeline.cli.common import (
    console,
    current_settings,
)
from pipeline.cli.listing import Format, FormatOption, print_rows

envs_app = typer.Typer(help="The environment registry.", no_args_is_help=True)


@envs_app.command("list")
def envs_list(output: FormatOption = Format.table) -> None:
    """Every env id with its task family, turn limit, what it needs and whether it runs on this machine (columns:
    env id, task family, max turns, needs, runs here)."""
    from pipeline.envs.jvm import ENGINES, engine_requirements
    from pipeline.envs.registry import ENV_SPECS

    rows = []
    missing = {name: engine_requirements(name) for name in ENGINES}
    for spec in ENV_SPECS.values():
        if spec.engine is not None:
            needs = f"Java 17, {ENGINES[spec.engine].pip.removeprefix('pip install ')}"
            here = "yes" if missing[spec.engine] is None else f"no: {missing[spec.engine]}"
        else:
            needs = _NEEDS.get(spec.task_family) or \
                ("nle, minihack" if spec.task_family.startswith("minihack") else "nothing more")
            here = "yes" if spec.runs_here else "no: see docs/environments.md"
        rows.append((spec.env_id, spec.task_family, spec.max_turns, needs, here))
    print_rows(("env id", "task family", "max turns", "needs", "runs here"), rows, output)


_NEEDS = {
    "alfworld": "alfworld + its game files (~2 GB)",
    "webshop": "WebShop's catalogue and search index",
    "swebench": "swebench + a Docker engine",
}


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


@envs_app.command("random-play")
def envs_random_play(
    episodes: Annotated[int, typer.Option(min=1, help="Episodes per environment (tasks of its eval pool).")] = 200,
    max_turns: Annotated[int | None, typer.Option(
        min=1, help="Turn limit; default: each task's limit in the config (or the env's own).")] = None,
) -> None:
    """How often uniformly random actions solve each task of the config's mixture at its turn limit, on an eval
    pool of `--episodes` tasks (Wilson 95% interval): the floor a policy's success must clear to show skill; how
    often the scripted solver the warm start imitates does (a random action where it has none); the same solver
    knowing only what the episode showed (memoryless); and, where one rule holds across tasks, its follower."""
    from pipeline.envs.random_play import random_play
    from pipeline.envs.registry import env_spec, task_pool

    settings = current_settings().envs
    table = Table("env id", "task family", "max turns", "episodes", "random success", "95% interval", "turns/ep",
                  "solver success", "memoryless success", "rule-follower success")
    for task in settings.tasks:
        spec = env_spec(task.env_id)
        turns = max_turns or task.max_turns or spec.max_turns
        seeds = task_pool(task.env_id, "eval", episodes, settings.seed)
        found = random_play(task.env_id, settings, max_turns=turns, seeds=seeds, rng_seed=settings.seed)
        low, high = found.interval()
        others = {policy: random_play(task.env_id, settings, max_turns=turns, seeds=seeds, rng_seed=settings.seed,
                                      policy=policy).rate
                  for policy in ("solver", "memoryless", "rule") if policy != "rule" or spec.rule}
        table.add_row(task.env_id, spec.task_family, str(turns), str(found.episodes), f"{found.rate:.3f}",
                      f"{low:.3f}-{high:.3f}", f"{found.mean_turns:.1f}", f"{others['solver']:.3f}",
                      f"{others['memoryless']:.3f}", f"{others['rule']:.3f}" if "rule" in others else "-")
    console.print(table)
