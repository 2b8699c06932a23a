"""Data-parallel training steps: N ranks (torch.distributed; gloo on CPU, NCCL on GPU) take one optimiser step
together on one canonical batch.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m pipeline.cli worker actor_trainer
    # or in a run config: actor_trainer.ranks: 2 (`crl run` starts the trainer under torchrun)

This is DDP (every rank holds the whole model, the gradients are all-reduced), written as one explicit all-reduce per
step instead of torch's `DistributedDataParallel` wrapper: a step accumulates an uneven number of micro-batches per
rank (the wrapper would need `no_sync` and `join`), the loss weights are the whole batch's so the gradients must be
summed, not averaged, and one flat all-reduce in parameter order sums in the same order every time, which the replay
needs to reproduce the weights bit for bit.

Roles: rank 0 is the worker (it alone reads Kafka, checkpoints and publishes). For every step it broadcasts the
canonical batch's samples (`step`); then every rank checks that all hold the same weights, trains its shard
(`pipeline.rl.policy_step.shard_indices`), the gradients are summed (`all_reduce_gradients`), every rank takes the same
AdamW step, and the weight hashes of all ranks are gathered and must be equal: a difference raises
`RankFailedError` on every rank and nothing is published. The other ranks only `follow`: they build the same
`TrainerStep` from the newest checkpoint and serve steps until rank 0 says stop. Between steps rank 0 sends a
keep-alive well inside the collective timeout, so a rank waiting for the next batch never times out, while a rank
that dies or hangs makes every collective fail within `rank_timeout_s` (a killed process closes its connections,
so the others fail at once). Every such failure is a `RankFailedError`: the worker stops without publishing the
step, and a restart resumes from the last checkpoint and positions like any trainer restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipeline.errors import RankFailedError
from pipeline.models.checkpoints import weight_hash
from pipeline.models.transformers_backend import TransformersPolicy
from pipeline.rl.policy_step import GradientGroup, Sample, StepResult

log = logging.getLogger(__name__)


STOP, ALIVE, STEP, STATE = "stop", "alive", "step", "state"
"""Commands rank 0 broadcasts to the other ranks."""


class TrainerStep(Protocol):
    """What a rank trains with: `pipeline.rl.trainer.TrainerStep`, the same on every rank."""

    @property
    def policy(self) -> TransformersPolicy: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def run(self, samples: Sequence[Sample], variant: str, group: GradientGroup | None = None) -> StepResult: ...


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in its group: torchrun's RANK, WORLD_SIZE and LOCAL_RANK, read at the CLI edge."""

    rank: int
    world_size: int
    local_rank: int = 0


def backend_for(device: str) -> str:
    """NCCL for a CUDA model, gloo otherwise (CPU)."""
    return "nccl" if device.startswith("cuda") else "gloo"


class DataParallel:
    """One process's membership of a data-parallel group and the step protocol all ranks follow."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, device: torch.device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.device = device
        """Where collective tensors live (the rank's CUDA device under NCCL)."""
        self._last_sent = time.monotonic()

    # -- joining ------------------------------------------------------------------------------------------------

    @classmethod
    def join(cls, info: RankInfo, *, device: str, timeout_s: float) -> DataParallel:
        """Join the group torchrun set up (MASTER_ADDR / MASTER_PORT in the environment); waits up to `timeout_s`
        for every rank."""
        backend = backend_for(device)
        target = torch.device("cpu")
        if backend == "nccl":
            target = torch.device("cuda", info.local_rank)
            torch.cuda.set_device(target)
        _guard("joining the group", info.world_size, lambda: dist.init_process_group(
            backend, init_method="env://", rank=info.rank, world_size=info.world_size,
            timeout=timedelta(seconds=timeout_s)))
        return cls(info.rank, info.world_size, timeout_s, target)

    @classmethod
    def over_file(cls, store: Path, rank: int, world_size: int, timeout_s: float) -> DataParallel:
        """Join a gloo group that meets in the file `store` (the replay's local ranks)."""
        _guard("joining the group", world_size, lambda: dist.init_process_group(
            "gloo", init_method=store.resolve().as_uri(), rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s)))
        return cls(rank, world_size, timeout_s, torch.device("cpu"))

    def barrier(self, what: str) -> None:
        """Wait until every rank gets here (up to the timeout)."""
        self.agree("here", what)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- the step protocol --------------------------------------------------------------------------------------

    def step(self, update: TrainerStep, samples: Sequence[Sample], variant: str, what: str) -> StepResult:
        """Rank 0: have every rank take the step on `samples`; returns the whole batch's result once every rank
        holds the same weights after it."""
        self._send((STEP, list(samples), variant, what))
        return self._take_step(update, samples, variant, what)

    def keep_alive(self) -> None:
        """Rank 0, between steps: tell the waiting ranks it is still there (at a quarter of the timeout)."""
        if time.monotonic() - self._last_sent >= self.timeout_s / 4:
            self._send((ALIVE,))

    def share_state(self, update: TrainerStep) -> None:
        """Rank 0: give every rank this rank's weights and optimiser state (the replay, whose ranks start from the
        weights the replay has reached)."""
        from pipeline.models.checkpoints import optimizer_tensors

        tensors, groups = optimizer_tensors(update.optimizer)
        self._send((STATE, update.policy.model.state_dict(), tensors, groups))

    def finish(self) -> None:
        """Rank 0, stopping cleanly: release the other ranks, then leave the group."""
        try:
            self._send((STOP,))
        finally:
            self.close()

    def follow(self, update: TrainerStep) -> int:
        """Ranks above 0: serve rank 0's commands until it says stop; returns the number of steps taken."""
        from pipeline.models.checkpoints import load_optimizer_tensors

        steps = 0
        while True:
            command = self._receive()
            if command[0] == STOP:
                return steps
            if command[0] == STEP:
                _, samples, variant, what = command
                self._take_step(update, samples, variant, what)
                steps += 1
            elif command[0] == STATE:
                _, state, tensors, groups = command
                update.policy.model.load_state_dict(state)
                load_optimizer_tensors(update.optimizer, tensors, groups)

    def _take_step(self, update: TrainerStep, samples: Sequence[Sample], variant: str, what: str) -> StepResult:
        self.agree(weight_hash(update.policy.model), f"{what}: the weights before the step")
        result = _guard(what, self.world_size, lambda: update.run(samples, variant, group=self))
        self.agree(weight_hash(update.policy.model), f"{what}: the weights after the step")
        return result

    def agree(self, value: str, what: str) -> None:
        """Gather `value` from every rank; raise `RankFailedError` on every rank unless all are equal."""
        gathered: list[Any] = [None] * self.world_size
        _guard(what, self.world_size, lambda: dist.all_gather_object(gathered, value))
        if len(set(gathered)) != 1:
            listing = ", ".join(f"rank {rank} {found[:16]}" for rank, found in enumerate(gathered))
            failure = RankFailedError(f"{what}: the {self.world_size} ranks hold different weights ({listing}); the "
                                      "step is not published")
            log.error("RankFailedError: %s", failure)
            raise failure

    # -- collectives (`pipeline.rl.policy_step.GradientGroup`) -------------------------------------------------------

    def all_reduce_gradients(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        present = torch.tensor([p.grad is not None for p in parameters], dtype=torch.int32, device=self.device)
        _guard("summing gradients", self.world_size, lambda: dist.all_reduce(present))
        summed = [p for p, count in zip(parameters, present.tolist(), strict=True) if count]
        for p, count in zip(parameters, present.tolist(), strict=True):
            if not count:
                p.grad = None
        if not summed:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in summed])
        _guard("summing gradients", self.world_size, lambda: dist.all_reduce(flat))
        offset = 0
        for p in summed:
            p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def all_reduce_sums(self, values: Sequence[float]) -> list[float]:
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        _guard("summing step statistics", self.world_size, lambda: dist.all_reduce(tensor))
        return [float(v) for v in tensor.tolist()]

    # -- commands -----------------------------------------------------------------------------------------------

    def _send(self, command: tuple[Any, ...]) -> None:
        _guard(f"sending {command[0]!r} to the other ranks", self.world_size,
               lambda: dist.broadcast_object_list([command], src=0, device=self.device))
        self._last_sent = time.monotonic()

    def _receive(self) -> tuple[Any, ...]:
        box: list[Any] = [None]
        _guard("waiting for rank 0", self.world_size,
               lambda: dist.broadcast_object_list(box, src=0, device=self.device))
        return tuple(box[0])


def _guard(what: str, world_size: int, action: Any) -> Any:
    """Run a collective (or a step made of them); a lost rank or a timeout becomes `RankFailedError`."""
    try:
        return action()
    except RankFailedError:
        raise
    except (RuntimeError, ValueError) as exc:  # DistBackendError, DistNetworkError, gloo's timeouts: RuntimeErrors
        failure = RankFailedError(f"{what}: a rank of the {world_size}-rank group failed, was killed or timed out "
                                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); nothing "
                                  "of this step is published")
        # Logged here as well: torchrun may stop this process before the error reaches the CLI that reports it.
        log.error("RankFailedError: %s", failure)
        raise failure from exc
