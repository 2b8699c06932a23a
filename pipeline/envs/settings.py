"""What a run plays and how its environments are built (`CRL_ENVS__*`): the task mixture, the task pools, and
per-environment options."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TaskMix(BaseModel):
    """One environment of the training mixture."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env_id: str = Field(description="An id of the env registry (`crl envs list`), e.g. 'MiniHack-Room-Random-5x5-v0'.")
    weight: float = Field(default=1.0, gt=0, description="Relative share of the step's task groups.")
    max_turns: int | None = Field(default=None, gt=0, description="Turn limit; None: the env's paper setting.")


class TextWorldSettings(BaseModel):
    """TextWorldExpress and ScienceWorld (`CRL_ENVS__TEXT_WORLDS__*`): game parameters, the fold unseen tasks come
    from, and whether the prompt lists the valid actions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cookingworld: str = Field(
        default="numLocations=1,numIngredients=2,numDistractorItems=2,includeDoors=0,limitInventorySize=0",
        description="TextWorldExpress CookingWorld's game parameters, in the engine's own `key=value,...` form "
        "(`numLocations`, `numIngredients`, `numDistractorItems`, `includeDoors`, `limitInventorySize`).")
    twc: str = Field(
        default="numLocations=1,numItemsToPutAway=2,includeDoors=0,limitInventorySize=0",
        description="TextWorld Commonsense's game parameters (`numLocations`, `numItemsToPutAway`, `includeDoors`, "
        "`limitInventorySize`).")
    coin: str = Field(
        default="numLocations=4,numDistractorItems=0,includeDoors=0,limitInventorySize=0",
        description="Coin Collector's game parameters (`numLocations` rooms to search, `numDistractorItems`, "
        "`includeDoors`).")
    scienceworld_task: str = Field(
        default="find-living-thing",
        description="The ScienceWorld task type, e.g. find-living-thing, boil, melt (30 in all; an unknown name is an "
        "error that lists them).")
    scienceworld_simplifications: str = Field(
        default="easy", description="ScienceWorld's simplifications, comma-separated ('easy': all of them; '': none).")
    scienceworld_variation: int | None = Field(
        default=None, ge=0,
        description="Play this one variation of the task on every seed; None: each seed draws a variation of its "
        "split (train seeds from the train variations, unseen ones from `eval_fold`'s).")
    eval_fold: Literal["dev", "test"] = Field(
        default="test",
        description="The engines' fold the unseen (eval-pool) tasks come from; train-pool tasks always come from "
        "the train fold, so training never sees an unseen task's game.")
    show_valid_actions: bool = Field(
        default=True,
        description="List the valid actions in every observation (as agent papers list ALFWorld's admissible "
        "commands). Off: the agent must know the command grammar.")
    step_limit: int = Field(
        default=100, gt=0,
        description="The engines' own step limit (an episode past it ends as a truncation); the task's `max_turns` "
        "usually ends it first.")


class SignpostSettings(BaseModel):
    """Signpost corridors (`MiniHack-SignpostCorridor-v0`, `CRL_ENVS__SIGNPOST__*`): which furnishing marks the
    stairs' side, and the flipped-rule control."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    landmark: Literal["altar", "fountain", "sink", "grave", "per-run", "per-task"] = Field(
        default="per-run",
        description="The furnishing that stands on the stairs' side in every corridor of the run; 'per-run' draws "
        "it from `envs.seed`; 'per-task' draws one per corridor, so no rule holds across corridors (a control).")
    flip_unseen: bool = Field(
        default=False,
        description="A control: on unseen corridors (eval pools) the signpost stands on the side away from the "
        "stairs, so a lesson stating the run's rule leads the wrong way there.")


class EnvSettings(BaseModel):
    """What a run plays and how its environments are built: the task mixture, the task pools, and per-environment
    options. Environment: `CRL_ENVS__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tasks: tuple[TaskMix, ...] = Field(
        default=(TaskMix(env_id="MiniHack-Room-Random-5x5-v0"),), min_length=1,
        description="The mixture: each step's groups are drawn from these environments by weight.")
    train_pool_size: int = Field(default=1000, gt=0, description="Train task seeds per environment.")
    eval_tasks_per_env: int = Field(
        default=8, gt=0, description="Eval pool size per environment: tasks never drawn for training.")
    eval_repeats: int = Field(
        default=1, gt=0,
        description="Episodes per eval task and slot kind: each task is played this many times guided and as many "
        "free, so a small pool of recurring tasks still gives an evaluation enough episodes.")
    eval_recurring_per_env: int = Field(
        default=0, ge=0,
        description="Train-pool tasks per environment also evaluated (the first N of the pool; group ids end in "
        "-r<i>): where tasks recur, what the bank remembers of them is what memory is for. At most "
        "train_pool_size.")
    seed: int = Field(default=0, ge=0, description="Seeds the task pools and the draw of each step's tasks.")
    eval_seed: int | None = Field(
        default=None, ge=0,
        description="Seeds the eval pool of unseen tasks (None: `seed`); fixing it while `seed` varies keeps every "
        "run's evaluation on the same tasks. Eval tasks never meet a train pool of any seed.")
    invalid_action: Literal["skip", "end"] = Field(
        default="skip",
        description="A response naming no available action: 'skip' uses up the turn without stepping the "
        "environment (the next observation says it was invalid); 'end' ends the episode as a failure.")
    alfworld_data: Path | None = Field(
        default=None, description="ALFWorld's data directory (alfworld-download); required by the ALFWorld env.")
    webshop_num_products: int = Field(default=1000, gt=0, description="WebShop catalogue size (paper: 1,000).")
    swebench_instances: Path | None = Field(
        default=None, description="SWE-Bench Verified instances as a local JSON list; required by that env.")
    signpost: SignpostSettings = Field(
        default_factory=SignpostSettings, description="Signpost corridors: the run's rule and its flipped control.")
    text_worlds: TextWorldSettings = Field(
        default_factory=TextWorldSettings,
        description="TextWorldExpress (CookingWorld, TextWorld Commonsense, Coin Collector) and ScienceWorld.")

    @model_validator(mode="after")
    def _recurring_within_the_pool(self) -> EnvSettings:
        if self.eval_recurring_per_env > self.train_pool_size:
            raise ValueError(f"eval_recurring_per_env ({self.eval_recurring_per_env}) exceeds train_pool_size "
                             f"({self.train_pool_size}): only train-pool tasks recur")
        return self
