"""Advantages for both trainers, and the extractor's training-count weights (docs/design.md, "The actor" and
"Extractor update").

- Actor (GRPO with subgroup advantages): a task's K rollouts split into a guided and a free subgroup; each reward is
  normalised inside its own subgroup only. Normalising across the whole group made training collapse in the paper.
- Extractor (CISPO): `A_i = r_i - mean(r)` over the training batch, no std, multiplied by `w(m)` (Eq. 7).
"""

from __future__ import annotations

import math

import torch

from pipeline.errors import InvalidArgumentError

ADVANTAGE_NORMS = ("mean_std", "mean")
"""`mean_std`: (r - mean_c) / (std_c + eps), the paper's formula. `mean`: r - mean_c, what the reference code runs."""


def check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    """Raise `ValueError` naming the valid values when `value` is not one of them."""
    if value not in valid:
        raise InvalidArgumentError(f"unknown {name} {value!r}; valid values: {', '.join(valid)}")


def subgroup_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, guided: torch.Tensor, norm: str = "mean_std", eps: float = 1e-6
) -> torch.Tensor:
    """Advantage of every episode, normalised inside its (group, guided) subgroup.

    rewards   # (N,) float: outcome reward of each episode
    group_ids # (N,) int: which GRPO group (task) the episode belongs to
    guided    # (N,) bool: guided by a retrieved experience, or free
    returns   # (N,) float32

    `std` is the unbiased sample std (as TRL and the reference code compute it). A subgroup whose rewards are all
    equal (including a subgroup of one) carries no signal: its advantages are exactly 0, not 0 / eps.
    """
    check_choice("advantage_norm", norm, ADVANTAGE_NORMS)
    rewards = rewards.to(torch.float32)
    advantages = torch.zeros_like(rewards)
    keys = torch.stack([group_ids.to(torch.int64), guided.to(torch.int64)], dim=1)  # (N, 2)
    for key in torch.unique(keys, dim=0):
        members = (keys == key).all(dim=1)  # (N,) bool
        subgroup = rewards[members]  # (n_c,)
        if subgroup.numel() < 2 or bool((subgroup == subgroup[0]).all()):
            continue  # zero variance: no signal
        centred = subgroup - subgroup.mean()
        if norm == "mean_std":
            centred = centred / (subgroup.std() + eps)
        advantages[members] = centred
    return advantages


def batch_mean_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """The extractor's advantage: reward minus the batch mean, no std (the paper's CISPO; docs/design.md).

    rewards # (N,) float
    returns # (N,) float32
    """
    rewards = rewards.to(torch.float32)
    return rewards - rewards.mean()


def training_count_weights(
    train_counts: torch.Tensor, steps_since_trained: torch.Tensor, alpha: float = 0.5, delta: int = 1
) -> torch.Tensor:
    """Eq. 7: `w(m) = 0` if the sample was trained less than `delta` steps ago, else `(1 + train_count)^(-alpha)`.

    train_counts        # (N,) int: extractor steps that already trained on the sample
    steps_since_trained # (N,) float: current step minus the step that last trained it; `inf` when never trained
    returns             # (N,) float32, multiplies the advantage
    """
    weights = (1.0 + train_counts.to(torch.float32)) ** (-alpha)
    recent = steps_since_trained.to(torch.float32) < delta
    return torch.where(recent, torch.zeros_like(weights), weights)


NEVER_TRAINED = math.inf
"""`steps_since_trained` of a sample no step has trained yet."""
