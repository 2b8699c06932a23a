"""The trainers' settings: optimiser, loss, batching and warm start of the actor (GRPO) and the extractor (CISPO)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.models.settings import ModelSettings

LossVariant = Literal["grpo", "cispo"]
"""The policy losses (`pipeline.rl.losses.policy_loss`): each trainer's `loss` setting names the one its steps run and
its `TrainStepCompleted` records, which is the one `crl replay train` runs again."""

DEFAULT_REPLAY_RANKS = 8
"""The most local gloo ranks `crl replay train` starts for one data-parallel step unless told otherwise."""


class TrainerSettings(BaseModel):
    """One trainer's optimiser, loss and batching. The actor runs GRPO, the extractor CISPO (docs/design.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSettings = Field(default_factory=ModelSettings, description="The policy this trainer updates.")
    lr: float = Field(default=1e-5, gt=0, description="AdamW learning rate, constant (paper scale: 1e-6).")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient norm clip.")
    eps_low: float = Field(default=0.2, ge=0, lt=1, description="Lower clip of the ratio: 1 - eps_low.")
    eps_high: float = Field(default=0.2, ge=0, description="Upper clip of the ratio: 1 + eps_high.")
    loss: LossVariant = Field(
        default="grpo",
        description="The policy loss every step runs and records: grpo (PPO-clipped ratio, the actor's) or cispo "
        "(clipped importance weight, no gradient through it; the extractor's). See docs/training.md.")
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        default="token-mean",
        description="How token losses reduce to the batch loss, recorded in every train step: token-mean (every "
        "token weighs the same, so long episodes weigh more), seq-mean-token-mean (every episode weighs the same), "
        "seq-mean-token-sum-norm (each episode's token sum over `norm_tokens`: no length in the weight). See "
        "docs/training.md#loss-aggregation.")
    norm_tokens: int = Field(
        default=256, gt=0,
        description="The constant of seq-mean-token-sum-norm (Dr. GRPO uses the generation budget); keep it fixed "
        "for a run. Other aggregations ignore it.")
    micro_batch_size: int = Field(default=8, gt=0, description="Samples per forward/backward pass.")
    threads: int = Field(default=2, gt=0, description="torch CPU threads; recorded, since float sums depend on it.")
    ranks: int = Field(
        default=1, ge=1,
        description="Data-parallel ranks (DDP: each trains a shard of every batch, the gradients are summed). Above "
        "1, `crl run` starts the trainer under torchrun (gloo on CPU, NCCL on CUDA); each rank uses `threads` "
        "threads. See docs/training.md#data-parallel-trainers.")
    rank_timeout_s: float = Field(
        default=600.0, gt=0,
        description="Data parallel: how long a rank waits for the others in one collective (joining, a step, the "
        "next batch) before the trainer fails; rank 0 keeps idle ranks alive at a quarter of it.")


DEFAULT_WARM_START_CACHE = Path.home() / ".cache" / "complementary-rl" / "warm-start"


class WarmStartGate(BaseModel):
    """What a warm start must show on held-out data before its version 0 is trusted (`pipeline.rl.warm_gate`): data
    episodes of tasks from the eval split, which the warm start never trained on, played after every warm start,
    computed or loaded from the cache. A missed gate does not stop the run: the trainer logs it as an error, the live
    view and the report say it in red, and `benchmarks/learning.py` refuses to score the run. Each bound is optional;
    the extractor's bounds apply to the extractor's warm start, the actor's to the actor's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    episodes: int = Field(default=64, gt=0, description="Held-out data episodes (unseen tasks) the gate plays.")
    min_parse_ok: float | None = Field(
        default=None, ge=0, le=1,
        description="Extractor: the least share of its distillations of the held-out episodes that parse.")
    min_states_revealed: float | None = Field(
        default=None, ge=0, le=1,
        description="Extractor: the least share of the held-out episodes that revealed something (where the goal "
        "lies) whose answer holds a lesson that states it word for word.")
    min_success_right: float | None = Field(
        default=None, ge=0, le=1,
        description="Actor: the least success on held-out tasks guided by a right lesson (what a play of the same task "
        "revealed, as the rule-based summariser words it).")
    max_success_wrong: float | None = Field(
        default=None, ge=0, le=1,
        description="Actor: the most success on the same tasks guided by a wrong lesson (the same fact with its "
        "directions reversed): an actor that follows lessons goes the wrong way.")

    def bounds(self, role: str) -> dict[str, float]:
        """The bounds set for `role`'s warm start ("actor" or "extractor"), by name."""
        return {name: value for name in GATE_BOUNDS[role] if (value := getattr(self, name)) is not None}


GATE_BOUNDS = {"actor": ("min_success_right", "max_success_wrong"),
               "extractor": ("min_parse_ok", "min_states_revealed")}
"""The gate's bounds of each trainer's warm start."""


class WarmStartSettings(BaseModel):
    """A short supervised warm start of a freshly built policy, before version 0 is published (CPU preset only:
    paper-scale configs start from pretrained models and leave `steps` at 0). The actor is behaviour-cloned from
    scripted solvers; the extractor is fine-tuned on ops a rule-based summariser writes (`pipeline.rl.warm_start`).
    The result is version 0: `crl replay train` starts from it, and `RunStarted` records these settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(default=0, ge=0, description="Optimiser steps of the warm start; 0 turns it off.")
    episodes: int = Field(default=64, gt=0, description="Scripted / rule-based episodes played for its data.")
    batch_size: int = Field(default=16, gt=0, description="Samples per optimiser step.")
    lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate of the warm start.")
    expert_fraction: float = Field(
        default=0.5, ge=0, le=1,
        description="Share of the data episodes played by the scripted solver (the rest act at random), so "
        "successes and failures both occur.")
    plays_per_task: int = Field(
        default=1, ge=1,
        description="Data episodes per task: above 1, tasks recur in the data and the actor is shown lessons that "
        "another play of the same task revealed (memory tasks such as the dark corridors need it).")
    label_noise: float = Field(
        default=0.0, ge=0, lt=1,
        description="Actor only: share of the behaviour-cloning labels replaced by an action drawn at random, so "
        "the actor imitates a noisy solver and starts competent but imperfect however long it trains (RL then has "
        "room to improve it).")
    omit_facts: float = Field(
        default=0.0, ge=0, lt=1,
        description="Extractor only: share of the rule-based lessons of episodes that revealed something written "
        "without it (the outcome sentence alone), so the warm-started extractor states what an episode revealed "
        "only part of the time: a deliberately imperfect start that the outcome reward can correct.")
    rule_share: float = Field(
        default=1.0, ge=0, le=1,
        description="Extractor only: in a family with a rule across tasks (signpost corridors), the share of the "
        "rule-based lessons of revealing episodes that state the rule; the rest state the one task's fact or an "
        "over-general rule, half each. 1/3: an extractor that writes the rule as often as each wrong kind, which "
        "its outcome reward can correct.")
    gate: WarmStartGate | None = Field(
        default=None, description="What the warm-started policy must show on held-out data (None: not checked).")
    seed: int = Field(default=0, ge=0, description="Seeds the data episodes and the sample order.")
    cache_dir: Path | None = Field(
        default=DEFAULT_WARM_START_CACHE,
        description="Warm-started weights are cached here, keyed by a hash of everything that determines them "
        "(None: no cache). A cache hit gives byte-identical weights.")


class ActorTrainerSettings(TrainerSettings):
    """The actor trainer (GRPO with subgroup advantages). Environment: `CRL_ACTOR_TRAINER__<FIELD>`."""

    advantage_norm: Literal["mean_std", "mean"] = Field(
        default="mean_std", description="Subgroup normalisation: (r - mean) / (std + eps), or r - mean.")
    advantage_eps: float = Field(default=1e-6, gt=0, description="eps in the advantage's denominator.")
    group_size: int = Field(default=8, ge=2, description="K: episodes per GRPO group (K/2 guided after warm-up).")
    groups_per_step: int = Field(default=4, gt=0, description="B: task groups per training step.")
    warmup_steps: int = Field(default=5, ge=0, description="Steps 0..warmup-1 only fill the bank: no update.")
    group_timeout_s: float = Field(
        default=600.0, gt=0,
        description="After this long waiting for a step, train its complete groups and drop the incomplete ones.")
    warm_start: WarmStartSettings = Field(
        default_factory=WarmStartSettings,
        description="Behaviour cloning from scripted solvers before version 0 (tiny CPU preset; 0 steps = off).")

    @model_validator(mode="after")
    def _actor_warm_start(self) -> ActorTrainerSettings:
        if (wrong := _other_roles_bound(self.warm_start, "actor", "min_parse_ok", "min_states_revealed")) is not None:
            raise ValueError(wrong)
        if self.warm_start.omit_facts:
            raise ValueError("warm_start.omit_facts applies to the extractor's warm start, not the actor's")
        if self.warm_start.rule_share != 1.0:
            raise ValueError("warm_start.rule_share applies to the extractor's warm start, not the actor's")
        return self


class ExtractorTrainerSettings(TrainerSettings):
    """The extractor trainer (CISPO with Eq. 7 weights). Environment: `CRL_EXTRACTOR_TRAINER__<FIELD>`."""

    loss: LossVariant = Field(default="cispo", description="The policy loss every step runs and records (see the "
                              "actor's); CISPO keeps a gradient on tokens whose ratio is clipped.")
    eps_low: float = Field(default=0.1, ge=0, lt=1, description="CISPO's lower clip of the importance weight.")
    eps_high: float = Field(default=0.1, ge=0, description="CISPO's upper clip of the importance weight.")
    buffer_size: int = Field(default=64, gt=0, description="Rewarded generations per CISPO step (paper 64).")
    count_alpha: float = Field(default=0.5, ge=0, description="Eq. 7: weight (1 + train_count)^(-alpha).")
    count_delta: int = Field(default=1, ge=0, description="Eq. 7: weight 0 if trained less than delta steps ago.")
    parse_error_reward: float | None = Field(
        default=None, ge=-1, le=1,
        description="The reward of an answer the parser rejected, which then joins a batch like any sample (-1: "
        "what a lesson that failed earns). None (the paper): only answers that produced experiences are samples, "
        "so nothing pushes a drifting answer format back.")
    warm_start: WarmStartSettings = Field(
        default_factory=WarmStartSettings,
        description="Fine-tuning on a rule-based summariser's ops before version 0 (tiny CPU preset; 0 steps = off).")

    @model_validator(mode="after")
    def _extractor_warm_start(self) -> ExtractorTrainerSettings:
        if (wrong := _other_roles_bound(self.warm_start, "extractor", "min_success_right",
                                        "max_success_wrong")) is not None:
            raise ValueError(wrong)
        if self.warm_start.label_noise:
            raise ValueError("warm_start.label_noise applies to the actor's warm start, not the extractor's "
                             "(the extractor's imperfection is warm_start.omit_facts)")
        return self


def _other_roles_bound(warm: WarmStartSettings, role: str, *others: str) -> str | None:
    """What is wrong when the gate of `role`'s warm start sets a bound of the other trainer's (a mistake in the
    config, not a check to skip); None when nothing is."""
    wrong = [name for name in others if warm.gate is not None and getattr(warm.gate, name) is not None]
    if not wrong:
        return None
    return (f"warm_start.gate.{wrong[0]} checks the other trainer's warm start; the {role}'s gate takes "
            f"{' and '.join(GATE_BOUNDS[role])}")
