"""Replaying an op log into a fresh bank, pure: apply `(offset, op)` pairs in order and take the state hash at the
offsets where the live bank recorded one. `crl replay bank` (`pipeline.audit.bank_replay`) feeds it ops from the
archive or from Kafka; the audit's experience views replay the archived log through it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pipeline.bank.state import BankOp, BankState


@dataclass(frozen=True)
class Checkpoint:
    """A hash the live bank recorded at `next_offset` (all ops before it applied)."""

    name: str
    next_offset: int
    state_hash: str


@dataclass
class ReplayResult:
    state: BankState
    ops: int = 0
    hashes: dict[str, str | None] = field(default_factory=dict)
    """Checkpoint name -> the replay's hash at that offset (None: the log ended before it)."""

    def mismatches(self, checkpoints: Iterable[Checkpoint]) -> list[str]:
        problems = []
        for checkpoint in checkpoints:
            replayed = self.hashes.get(checkpoint.name)
            if replayed is None:
                problems.append(f"{checkpoint.name}: the log ended before offset {checkpoint.next_offset}")
            elif replayed != checkpoint.state_hash:
                problems.append(f"{checkpoint.name} at offset {checkpoint.next_offset}: recorded "
                                f"{checkpoint.state_hash}, replay {replayed}")
        return problems


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a bulk replay, then back as it was.

    Decoding and applying an op log allocates millions of container objects while the bank state grows; the
    collector's repeated passes over that growing state were half the replay's time (an 8,000-op log: decode ~55
    -> ~28 us per op). Ops and bank state hold no reference cycles, so reference counting frees what the replay drops.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def replay(ops: Iterable[tuple[int, BankOp]], checkpoints: Iterable[Checkpoint] = (),
           run_id: str | None = None) -> ReplayResult:
    """Apply `(offset, op)` pairs in order to a bank of run `run_id`, taking the hash wherever a checkpoint's offset
    is reached.

    Runs with the garbage collector paused (`collector_paused`); `ops` may decode lazily inside it."""
    with collector_paused():
        return _replay(ops, checkpoints, run_id)


def _replay(ops: Iterable[tuple[int, BankOp]], checkpoints: Iterable[Checkpoint],
            run_id: str | None) -> ReplayResult:
    pending = sorted(checkpoints, key=lambda c: c.next_offset)
    result = ReplayResult(BankState(run_id))
    result.hashes = {checkpoint.name: None for checkpoint in pending}

    def take_due() -> None:
        while pending and pending[0].next_offset <= result.state.next_offset:
            checkpoint = pending.pop(0)
            if checkpoint.next_offset == result.state.next_offset:
                result.hashes[checkpoint.name] = result.state.state_hash()

    take_due()
    for offset, op in ops:
        while pending and pending[0].next_offset <= offset:
            # The checkpoint lies between two archived ops (a gap): the state now is the state at that offset.
            checkpoint = pending.pop(0)
            result.hashes[checkpoint.name] = result.state.state_hash()
        result.state.apply(op, offset)
        result.ops += 1
        take_due()
    return result
