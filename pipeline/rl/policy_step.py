"""One optimiser step over a batch of samples: the part both trainers and `crl replay train` share, so a replay runs
exactly the code the trainer ran.

A sample is one generated response with the prompt it answered, the log-probs recorded when it was sampled and one
advantage broadcast to its tokens. For the actor a sample is one turn of a trajectory (its prompt already holds the
history); for the extractor it is one generation.

Reproducibility on CPU: `deterministic_torch(threads)` turns on deterministic algorithms and fixes the thread count
(float reductions depend on it), and every step runs the same micro-batches in the same order; the weight hash after
a step is then a pure function of the weights before it, the optimiser state and the batch.

Data parallel (`pipeline.rl.data_parallel`): every rank holds the whole canonical batch and the same weights; the
aggregation weights are computed over the whole batch, each rank runs only its shard (`shard_indices`: every
`world_size`-th trained sample from its rank), and one all-reduce sums the gradients and the statistics before the
clip and the optimiser step. Since the weights are the whole batch's, the summed gradient is the one-rank gradient up
to float summation order, and every rank takes the same optimiser step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pipeline.errors import InvalidArgumentError
from pipeline.models.base import PolicyModel
from pipeline.rl.losses import approx_kl_sum, policy_loss, token_weights


@dataclass(frozen=True)
class Sample:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    """Sampling log-probs recorded with the response; the importance ratio is taken against them."""
    advantage: float
    sequence: int | None = None
    """What the sample weighs as part of under a per-sequence aggregation: its episode's index in the batch for an
    actor turn; None: the sample alone (an extractor generation)."""


@dataclass(frozen=True)
class StepResult:
    loss: float
    """Sum of the micro-batch losses: the batch loss under the aggregation."""
    tokens: int
    """Response tokens of every sample (the token-mean denominator)."""
    trained_tokens: int
    """Tokens that went through the model: samples with a zero advantage carry no gradient and are skipped."""
    sequences: int
    clipped_low: int
    clipped_high: int
    grad_norm: float
    samples: int = 0
    """Samples with tokens (turns for the actor, generations for the extractor)."""
    kl_sum: float = 0.0
    """`approx_kl_sum` over the trained tokens."""
    entropy_sum: float | None = None
    """The policy's entropy summed over the trained tokens (None: the backend does not give it)."""

    @property
    def clip_fraction(self) -> float:
        return (self.clipped_low + self.clipped_high) / self.trained_tokens if self.trained_tokens else 0.0

    def diagnostics(self) -> dict[str, float]:
        """What RL practitioners read beside the loss, as `train/` metrics of the step: the policy's mean entropy and
        the approximate KL to the behaviour policy per trained token (taken before the update, on the gradient's own
        forward pass), the clip fraction, and the mean response length in tokens."""
        out = {"train/clip_fraction": self.clip_fraction,
               "train/response_length": self.tokens / self.samples if self.samples else 0.0}
        if self.trained_tokens:
            out["train/approx_kl"] = self.kl_sum / self.trained_tokens
            if self.entropy_sum is not None:
                out["train/entropy"] = self.entropy_sum / self.trained_tokens
        return out


class GradientGroup(Protocol):
    """The ranks one data-parallel step runs on (`pipeline.rl.data_parallel.DataParallel`)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce_gradients(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks, in place; a parameter no rank has a gradient for keeps
        none (so AdamW skips it, as it would on one rank)."""
        ...

    def all_reduce_sums(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the ranks."""
        ...


def shard_indices(count: int, rank: int, world_size: int) -> list[int]:
    """The indices of a `count`-sample batch that rank `rank` of `world_size` trains: every `world_size`-th from
    `rank` (0, N, 2N, ... on rank 0), so the shards are disjoint, their union is the batch and their sizes differ
    by at most one."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank} of world size {world_size}: need 0 <= rank < world_size")
    return list(range(rank, count, world_size))


def deterministic_torch(threads: int) -> None:
    """Deterministic kernels and a fixed thread count: the same step gives the same bits on the same machine.

    On CUDA, cuBLAS is deterministic only with a fixed workspace configuration (without one, deterministic mode
    refuses every cuBLAS matmul); it is set here unless the environment already sets it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                   eps: float, *, fused: bool = False) -> torch.optim.AdamW:
    """AdamW at a constant learning rate (the paper) over the parameters that train (all of them, or a LoRA adapter's);
    `foreach=False` keeps the update order fixed. `fused`: one kernel per parameter instead of a loop of elementwise
    ops (0.10 s instead of 0.48 s a step over SmolLM2-135M's parameters on 2 cores), with other rounding; bfloat16
    warm starts use it, the trainers keep the loop, whose bits `crl replay train` reproduces for recorded runs."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if fused:
        return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=True)
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, foreach=False)


def _padded(rows: Sequence[Sequence[float]] | Sequence[torch.Tensor], width: int,
            device: torch.device | None = None) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        values = row if isinstance(row, torch.Tensor) else torch.tensor(row, dtype=torch.float32)
        out[i, : len(values)] = values
    return out.to(device) if device is not None else out


def weighted_samples(samples: Sequence[Sample], aggregation: str, norm_tokens: int | None = None
                     ) -> list[tuple[Sample, float]]:
    """The samples that carry a gradient (tokens and a non-zero advantage), each with its aggregation weight; the
    weights are taken over every sample with tokens, those with a zero advantage included."""
    samples = [s for s in samples if s.response_ids]
    sequences = [s.sequence if s.sequence is not None else -1 - i for i, s in enumerate(samples)]
    weight_of = token_weights(aggregation, [len(s.response_ids) for s in samples], sequences, norm_tokens)
    return [(s, w) for s, w in zip(samples, weight_of, strict=True) if s.advantage != 0.0]


@dataclass
class Accumulated:
    """What `accumulate_gradients` adds up besides the gradients."""

    loss: float = 0.0
    clipped_low: int = 0
    clipped_high: int = 0
    kl_sum: float = 0.0
    entropy_sum: float | None = 0.0
    """None once a micro-batch came back without entropies."""


def accumulate_gradients(policy: PolicyModel, trained: Sequence[tuple[Sample, float]], *, variant: str,
                         aggregation: str, eps_low: float, eps_high: float, temperature: float,
                         micro_batch_size: int) -> Accumulated:
    """Backward the weighted loss of `trained` in micro-batches, adding to the gradients already there; returns the
    loss, the clipped-low / clipped-high token counts and the diagnostics' sums."""
    total = Accumulated()
    for start in range(0, len(trained), micro_batch_size):
        chunk = [s for s, _weight in trained[start : start + micro_batch_size]]
        weights = torch.tensor([w for _s, w in trained[start : start + micro_batch_size]], dtype=torch.float32)
        scored = policy.score([s.prompt_ids for s in chunk], [s.response_ids for s in chunk], temperature)
        logps = scored.logprobs
        device = logps[0].device  # where the model ran: the loss is taken there too
        width = max(len(s.response_ids) for s in chunk)
        logp = torch.zeros(len(chunk), width, device=device)  # (b, T), padding 0 keeps gradients finite
        mask = torch.zeros(len(chunk), width)  # (b, T)
        for i, row in enumerate(logps):
            logp = logp.index_put((torch.tensor([i], device=device), torch.arange(len(row), device=device)), row)
            mask[i, : len(row)] = 1.0
        mask = mask.to(device)
        behaviour = _padded([s.behaviour_logprobs for s in chunk], width, device)
        out = policy_loss(
            variant, logp, behaviour,
            torch.tensor([s.advantage for s in chunk], dtype=torch.float32, device=device), mask,
            eps_low=eps_low, eps_high=eps_high, aggregation=aggregation, weights=weights.to(device),
        )
        out.loss.backward()
        total.loss += out.loss.item()
        total.clipped_low += out.clipped_low
        total.clipped_high += out.clipped_high
        total.kl_sum += approx_kl_sum(logp, behaviour, mask)
        if scored.entropies is None or total.entropy_sum is None:
            total.entropy_sum = None
        else:
            total.entropy_sum += float(sum(float(row.sum()) for row in scored.entropies))
    return total


def policy_step(
    policy: PolicyModel,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    *,
    variant: str,
    aggregation: str,
    eps_low: float,
    eps_high: float,
    temperature: float,
    micro_batch_size: int,
    max_grad_norm: float,
    norm_tokens: int | None = None,
    group: GradientGroup | None = None,
) -> StepResult:
    """Accumulate the loss of `samples` over micro-batches, clip the gradient norm, take one optimiser step.

    The aggregation's weights are taken over every sample with tokens, those with a zero advantage included (they
    carry no gradient and are not run through the model). With a `group`, this rank runs only its shard of the
    trained samples and the gradients and statistics are summed over the ranks before the clip; the returned result
    is the whole batch's on every rank."""
    samples = [s for s in samples if s.response_ids]
    total_tokens = sum(len(s.response_ids) for s in samples)
    sequences = [s.sequence if s.sequence is not None else -1 - i for i, s in enumerate(samples)]
    trained = weighted_samples(samples, aggregation, norm_tokens)
    mine = trained if group is None else [trained[i] for i in shard_indices(len(trained), group.rank,
                                                                           group.world_size)]
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = accumulate_gradients(
        policy, mine, variant=variant, aggregation=aggregation, eps_low=eps_low, eps_high=eps_high,
        temperature=temperature, micro_batch_size=micro_batch_size)
    loss_sum, clipped_low, clipped_high = total.loss, total.clipped_low, total.clipped_high
    kl_sum, entropy_sum = total.kl_sum, total.entropy_sum
    grad_norm = 0.0
    # Over what the optimiser updates: a LoRA adapter's norm is its own, whatever the frozen base holds.
    trainable = [p for param_group in optimizer.param_groups for p in param_group["params"]]
    if group is not None and trained:
        group.all_reduce_gradients(trainable)
        loss_sum, low, high, kl_sum, entropy = group.all_reduce_sums(
            [loss_sum, float(clipped_low), float(clipped_high), kl_sum, entropy_sum or 0.0])
        clipped_low, clipped_high = round(low), round(high)
        entropy_sum = entropy if entropy_sum is not None else None
    if trained:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm))
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    trained_tokens = sum(len(s.response_ids) for s, _weight in trained)
    return StepResult(loss=loss_sum, tokens=total_tokens, trained_tokens=trained_tokens, sequences=len(set(sequences)),
                      clipped_low=clipped_low, clipped_high=clipped_high, grad_norm=grad_norm, samples=len(samples),
                      kl_sum=kl_sum, entropy_sum=entropy_sum)
