"""Synthetic experience-op logs for tests and benchmarks: a realistic mix, deterministic per seed.

The generator keeps its own model of the bank so that most ops are valid, then mixes in what a real asynchronous
pipeline produces: refines that lost a race (stale `expected_version`), ops on ids retired meanwhile, and
re-published ops (the same `op_id` again, as after an extractor restart). Key vectors are embedding-like (a low-rank
Gaussian plus noise, normalised), not uniform random, so an index built on them behaves as on real embeddings.

    ops = synthetic_op_log(10_000, seed=0)          # list of ExperienceAdded / Refined / Merged / Retired
"""

from __future__ import annotations

import uuid

import numpy as np

from pipeline.bank.state import ExperienceOp
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
    """`count` unit vectors concentrated near a `rank`-dimensional subspace, like sentence embeddings."""
    basis = np.random.default_rng(12345).standard_normal((rank, dim)).astype(np.float32)
    vectors = rng.standard_normal((count, rank)).astype(np.float32) @ basis
    vectors += 0.1 * rng.standard_normal((count, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def synthetic_op_log(count: int, seed: int = 0, dim: int = 384, run_id: str = "synthetic") -> list[ExperienceOp]:
    rng = np.random.default_rng(seed)
    who = Producer(worker="extractor", instance="extractor-synthetic")
    vectors = embedding_like(rng, count, dim)
    kinds = list(MIX)
    weights = np.array([MIX[k] for k in kinds])
    active: dict[str, tuple[str, int]] = {}  # id -> (family, version)
    retired: list[tuple[str, int]] = []
    ops: list[ExperienceOp] = []
    created = 0

    def vector(index: int) -> EmbeddingVector:
        return EmbeddingVector.from_array("all-MiniLM-L6-v2", vectors[index])

    for index in range(count):
        kind = kinds[rng.choice(len(kinds), p=weights)]
        generation = f"gen-{index}"
        common = {"run_id": run_id, "producer": who, "generation_id": generation,
                  "extractor_version": index // 500}
        if kind == "duplicate" and ops:
            # Re-published after an extractor restart: a new event carrying the same deterministic op id.
            again = ops[int(rng.integers(len(ops)))]
            ops.append(again.model_copy(update={"event_id": uuid.UUID(bytes=rng.bytes(16), version=4)}))
            continue
        if kind in ("refine", "retire", "conflict", "merge") and len(active) < 2:
            kind = "add"
        if kind == "add":
            family = FAMILIES[int(rng.integers(len(FAMILIES)))]
            experience_id = f"exp-{created}"
            created += 1
            active[experience_id] = (family, 1)
            ops.append(ExperienceAdded(**common, op_id=f"{generation}:0", experience_id=experience_id,
                                       task_family=family, text=f"Tip {index}: keep walls on your left in {family}.",
                                       key=vector(index), source_trajectory_ids=(f"traj-{index}",)))
        elif kind == "refine":
            experience_id = sorted(active)[int(rng.integers(len(active)))]
            family, version = active[experience_id]
            active[experience_id] = (family, version + 1)
            ops.append(ExperienceRefined(**common, op_id=f"{generation}:0", experience_id=experience_id,
                                         expected_version=version, text=f"Refined tip {index} for {family}.",
                                         source_trajectory_ids=(f"traj-{index}",)))
        elif kind == "conflict":
            if retired and rng.random() < 0.5:
                experience_id, version = retired[int(rng.integers(len(retired)))]
            else:
                experience_id = sorted(active)[int(rng.integers(len(active)))]
                version = max(1, active[experience_id][1] - 1) if active[experience_id][1] > 1 else 7
            ops.append(ExperienceRefined(**common, op_id=f"{generation}:0", experience_id=experience_id,
                                         expected_version=version, text=f"Stale rewrite {index}.",
                                         source_trajectory_ids=(f"traj-{index}",)))
        elif kind == "retire":
            experience_id = sorted(active)[int(rng.integers(len(active)))]
            _family, version = active.pop(experience_id)
            retired.append((experience_id, version))
            ops.append(ExperienceRetired(**common, op_id=f"{generation}:0", experience_id=experience_id,
                                         expected_version=version, reason="capacity"))
        else:
            family = FAMILIES[int(rng.integers(len(FAMILIES)))]
            members = sorted(i for i, (f, _v) in active.items() if f == family)
            if len(members) < 2:
                continue
            chosen = [members[int(i)] for i in rng.choice(len(members), size=min(3, len(members)), replace=False)]
            sources = tuple(VersionedExperience(experience_id=i, expected_version=active[i][1]) for i in chosen)
            for source in chosen:
                retired.append((source, active.pop(source)[1]))
            experience_id = f"exp-{created}"
            created += 1
            active[experience_id] = (family, 1)
            ops.append(ExperienceMerged(**common, op_id=f"{generation}:0", experience_id=experience_id,
                                        task_family=family, text=f"Merged tip {index} for {family}.",
                                        key=vector(index), sources=sources))
    return ops
