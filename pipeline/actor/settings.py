"""What a run plays and how rollout workers play it: the scheduler (`CRL_SCHEDULER__*`) and rollout workers
(`CRL_ROLLOUT__*`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.models.settings import GenerationSettings

Arm = Literal["complementary", "grpo", "static_extractor", "exp_only", "frozen"]
"""Which method a run trains (the paper's baselines, docs/running.md): `complementary` trains both models with
guided/free groups; `grpo` trains the actor alone, every slot free, no bank; `static_extractor` freezes the extractor;
`exp_only` freezes the actor and trains only the extractor; `frozen` trains neither (the bank fills from the frozen
extractor: the control of `exp_only`)."""
ARMS_WITH_A_BANK: frozenset[str] = frozenset({"complementary", "static_extractor", "exp_only", "frozen"})
FROZEN_ACTOR_ARMS: frozenset[str] = frozenset({"exp_only", "frozen"})
"""Arms whose actor stays at version 0: it plays every step and is never trained."""
FROZEN_EXTRACTOR_ARMS: frozenset[str] = frozenset({"static_extractor", "grpo", "frozen"})
"""Arms whose extractor stays at version 0 (the extractor workers of an arm with a bank need one)."""
"""Every arm but `grpo` keeps an experience bank (and needs the workers that make and keep it)."""


class SchedulerSettings(BaseModel):
    """When the run plays what (the tasks are the environments' section, `CRL_ENVS__TASKS`). Environment:
    `CRL_SCHEDULER__<FIELD>`. Group size, groups per step and warm-up are the actor trainer's
    (`CRL_ACTOR_TRAINER__GROUP_SIZE`, `__GROUPS_PER_STEP`, `__WARMUP_STEPS`), so the scheduler and the trainer cannot
    disagree."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arm: Arm = Field(default="complementary",
                     description="complementary | grpo | static_extractor | exp_only | frozen.")
    variant: str | None = Field(
        default=None,
        description="A name for this run's variant of its arm (a control, an ablation: `grpo-frozen`); `crl report` "
        "pools runs by it (default: by arm), so runs of one arm with different settings stay apart.")
    steps: int = Field(default=10, gt=0, description="Training steps to schedule (warm-up included).")
    staleness: int = Field(
        default=0, ge=0,
        description="How many actor versions a step may lag: step s is issued once the actor has trained every "
        "step up to s - 1 - staleness (0 = on-policy).")
    max_steps_ahead: int = Field(
        default=1, ge=0,
        description="Step s is issued only after every train episode of step s - 1 - max_steps_ahead finished.")
    merge_every: int = Field(default=5, ge=0, description="MergeRequested after every N steps (paper 5; 0 = never).")
    deterministic: bool = Field(
        default=False,
        description="Run in lock step, so that the run is a function of its config and seeds (docs/determinism.md): "
        "step s is issued once every episode of step s - 1 finished, the actor trained on it, the extractor trainer "
        "trained on its outcomes and the extractor distilled it (in trajectory-id order, with the version the trainer "
        "named) and ran the merge due; its guided episodes are served from the bank as of that point, each episode "
        "generates alone and plays exactly its assigned actor version. Needs staleness 0, max_steps_ahead 0 and one "
        "extractor worker; costs wall time (nothing overlaps across steps). Off: the asynchronous default.")
    eval_every: int = Field(
        default=5, ge=0,
        description="Evaluation episodes on the fixed eval pool every N steps and after the last (0 = never).")


class RolloutSettings(BaseModel):
    """How rollout workers play. Environment: `CRL_ROLLOUT__<FIELD>`; the actor's generation (backend, device,
    sampling, temperature, micro-batch, seed) is `CRL_ROLLOUT__GENERATION__<FIELD>`, which the actor trainer reads
    too: the update recomputes log-probs at its temperature."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    generation: GenerationSettings = Field(
        default_factory=lambda: GenerationSettings(max_new_tokens=8, micro_batch=32),
        description="How the actor generates (one action per turn).")
    max_concurrent_episodes: int = Field(
        default=64, gt=0, description="Episodes played at once; each turn is one batched generation over them.")
    history_turns: int = Field(default=2, ge=0, description="Previous actions (with their results) in the prompt.")
    search_and_ask: bool = Field(
        default=False,
        description="Guided episodes may answer `ask <question>`: the bank is searched with the question and the "
        "experience found is shown next turn (paper's search-and-ask tool).")
    max_ask_calls: int = Field(default=2, ge=1, le=2, description="Most `ask` calls per episode (paper: 2).")
    replica_wait_s: float = Field(
        default=5.0, ge=0, description="At start, how long to wait for the bank replica to catch up (no barrier "
        "after that: each trajectory records the bank offset it was served from).")
    retrieval_wait_s: float = Field(
        default=10.0, gt=0,
        description="How long a guided episode may wait for its experience: its retrieval runs in the background "
        "from admission (an `ask` from when it was asked) while the other episodes keep playing, and the episode "
        "joins the batch as soon as the experience is there. Past this wait it joins with nothing (an `ask` gets "
        "the no-answer reply); a guided trajectory served nothing this way records no refs and `bank_offset` null. "
        "The playing loop itself waits on retrieval only when every episode in flight is waiting, and never longer "
        "than this.")
    metrics_every: int = Field(default=32, gt=0, description="Log rollout metrics every N finished episodes.")
