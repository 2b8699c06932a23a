"""Synthetic experience-op logs for tests and benchmarks: a realistic mix, deterministic per seed.

The generator keeps its own model of the bank so that most ops are valid, then mixes in what a real asynchronous
pipeline produces: refines that lost a race (stale `expected_version`), ops on ids retired meanwhile, and
re-published ops (the same `op_id` again, as after an extractor restart). Key vectors are embedding-like (a low-rank
Gaussian plus noise, normalised), not uniform random, so an index built on them behaves as on real embeddings.

    ops = synthetic_op_log(10_000, seed=0)          # list of ExperienceAdded / Refined / Merged / Retired
    for op in iter_synthetic_ops(1_000_000): ...    # the same, lazily, for logs too large for memory
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterator

import numpy as np

from pipeline.bank.replica import LocalBank
from pipeline.bank.state import BankState, Experience, ExperienceOp
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.experiences import (
    ExperienceAdded,
    ExperienceMerged,
    ExperienceRefined,
    ExperienceRetired,
    VersionedExperience,
)

FAMILIES = ("minihack-room", "minihack-maze", "minihack-keyroom", "sokoban")
MIX = {"add": 0.45, "refine": 0.25, "merge": 0.08, "retire": 0.07, "conflict": 0.08, "duplicate": 0.07}
"""Share of each kind of op in a generated log."""


def embedding_like(rng: np.random.Generator, count: int, dim: int = 384, rank: int = 32) -> np.ndarray:
    """`count` unit vectors concentrated near a `rank`-dimensional subspace, like sentence embeddings. Computed in
    float64 and rounded to float32 at the end: a float32 product's rounding depends on the BLAS kernel the CPU
    dispatches to, so float16 keys made from it differed between machines (and so did pinned bank hashes)."""
    basis = np.random.default_rng(12345).standard_normal((rank, dim))
    vectors = rng.standard_normal((count, rank)) @ basis
    vectors += 0.1 * rng.standard_normal((count, dim))
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def synthetic_bank(size: int, task_family: str, dim: int = 384, key_model: str = "all-MiniLM-L6-v2",
                   text: str = "Tip {i}: keep to the walls until you see >.") -> LocalBank:
    """A bank of `size` active experiences of one family with embedding-like keys, built from its state directly
    (not from `size` ops): for benchmarks of what reads the bank."""
    keys = embedding_like(np.random.default_rng(size), size, dim).astype("<f2")
    keys.setflags(write=False)
    state = BankState()
    state.key_model, state.key_dim = key_model, dim
    for i in range(size):
        experience_id = f"exp-{i:06d}"
        state.experiences[experience_id] = Experience(
            experience_id=experience_id, task_family=task_family, text=text.format(i=i), key=keys[i], version=1,
            status="active", generation_id=f"gen-{i}", extractor_version=0, source_trajectory_ids=(f"traj-{i}",))
    state.next_offset = state.applied = size
    return LocalBank(state)


def synthetic_op_log(count: int, seed: int = 0, dim: int = 384, run_id: str = "synthetic") -> list[ExperienceOp]:
    """A whole log in memory (see `iter_synthetic_ops` for logs too large for that)."""
    return list(iter_synthetic_ops(count, seed, dim, run_id))


def iter_synthetic_ops(count: int, seed: int = 0, dim: int = 384, run_id: str = "synthetic",
                       chunk: int = 10_000) -> Iterator[ExperienceOp]:
    """Up to `count` ops, generated lazily (vectors in chunks; re-publications drawn from the last 2,000 ops)."""
    rng = np.random.default_rng(seed)
    who = Producer(worker="extractor", instance="extractor-synthetic")
    kinds = list(MIX)
    weights = np.array([MIX[k] for k in kinds])
    active: dict[str, tuple[str, int]] = {}  # id -> (family, version)
    active_ids: list[str] = []  # ids leave lazily (checked against `active`), swapped with the last
    retired: list[tuple[str, int]] = []
    recent: deque[ExperienceOp] = deque(maxlen=2000)
    created = 0
    vectors = np.empty((0, dim), dtype=np.float32)

    def pick_active() -> str:
        while True:
            position = int(rng.integers(len(active_ids)))
            candidate = active_ids[position]
            if candidate in active:
                return candidate
            # Drop the stale id in O(1) (with list.remove a 1M-op log took 20+ minutes to generate).
            active_ids[position] = active_ids[-1]
            active_ids.pop()

    for index in range(count):
        if index % chunk == 0:
            vectors = embedding_like(rng, min(chunk, count - index), dim)
        vector = EmbeddingVector.from_array("all-MiniLM-L6-v2", vectors[index % chunk])
        kind = kinds[rng.choice(len(kinds), p=weights)]
        generation = f"gen-{index}"
        common = {"run_id": run_id, "producer": who, "generation_id": generation,
                  "extractor_version": index // 500}
        op: ExperienceOp
        if kind == "duplicate":
            if recent:
                # Re-published after an extractor restart: a new event carrying the same deterministic op id.
                again = recent[int(rng.integers(len(recent)))]
                yield again.model_copy(update={"event_id": uuid.UUID(bytes=rng.bytes(16), version=4)})
                continue
            kind = "add"  # nothing to re-publish yet
        if kind in ("refine", "retire", "conflict", "merge") and len(active) < 2:
            kind = "add"
        if kind == "add":
            family = FAMILIES[int(rng.integers(len(FAMILIES)))]
            experience_id = f"exp-{created}"
            created += 1
            active[experience_id] = (family, 1)
            active_ids.append(experience_id)
            op = ExperienceAdded(**common, op_id=f"{generation}:0", experience_id=experience_id, task_family=family,
                                 text=f"Tip {index}: keep walls on your left in {family}.", key=vector,
                                 source_trajectory_ids=(f"traj-{index}",))
        elif kind == "refine":
            experience_id = pick_active()
            family, version = active[experience_id]
            active[experience_id] = (family, version + 1)
            op = ExperienceRefined(**common, op_id=f"{generation}:0", experience_id=experience_id,
                                   expected_version=version, text=f"Refined tip {index} for {family}.",
                                   source_trajectory_ids=(f"traj-{index}",))
        elif kind == "conflict":
            if retired and rng.random() < 0.5:
                experience_id, version = retired[int(rng.integers(len(retired)))]
            else:
                experience_id = pick_active()
                version = active[experience_id][1] - 1 if active[experience_id][1] > 1 else 7
            op = ExperienceRefined(**common, op_id=f"{generation}:0", experience_id=experience_id,
                                   expected_version=version, text=f"Stale rewrite {index}.",
                                   source_trajectory_ids=(f"traj-{index}",))
        elif kind == "retire":
            experience_id = pick_active()
            _family, version = active.pop(experience_id)
            retired.append((experience_id, version))
            op = ExperienceRetired(**common, op_id=f"{generation}:0", experience_id=experience_id,
                                   expected_version=version, reason="capacity")
        else:
            family = FAMILIES[int(rng.integers(len(FAMILIES)))]
            members = [pick_active() for _ in range(12)]
            members = sorted({m for m in members if active[m][0] == family})
            if len(members) < 2:
                continue
            chosen = members[:3]
            sources = tuple(VersionedExperience(experience_id=i, expected_version=active[i][1]) for i in chosen)
            for source in chosen:
                retired.append((source, active.pop(source)[1]))
            experience_id = f"exp-{created}"
            created += 1
            active[experience_id] = (family, 1)
            active_ids.append(experience_id)
            op = ExperienceMerged(**common, op_id=f"{generation}:0", experience_id=experience_id, task_family=family,
                                  text=f"Merged tip {index} for {family}.", key=vector, sources=sources)
        recent.append(op)
        yield op
