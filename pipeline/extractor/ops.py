"""Parsed extractor answers as events: experience ops and the generation record that carries them. Pure functions of
what the extractor was shown and what it answered, with no model, broker or bank: the extractor worker calls them
after it generates, and the tests pin them with hand-worked values.

    author = OpAuthor(run_id="demo", producer=Producer(worker="extractor", instance="extractor-0"), extractor_version=3)
    ops = distill_ops(author, generation_id, trajectory, shown, parse_distill(text, len(shown), ...), key)
    record = generation_record(author, generation_id, "distill", ..., generation, error=None, ops=ops)

Ids derive from the generation id (`pipeline.extractor.protocol`), so a re-processed trajectory or a repeated merge
yields the same events, which the bank and the extractor trainer treat as duplicates.

- distillation: `add` -> `ExperienceAdded` keyed by the trajectory's query embedding; `refine` of alias n ->
  `ExperienceRefined` expecting the version of the n-th experience shown.
- merging: `merge` -> `ExperienceMerged` of the named members (a new experience, version 1, keyed by the
  normalised mean of its sources' keys, `merged_key`, or by its text's embedding); `rewrite` -> `ExperienceRefined`
  (its key kept); `discard` -> `ExperienceRetired` (reason `merge_discard`); `keep` -> nothing. The newest
  experience a chunk produced is what slides into the next chunk, with its key.
- capacity: the oldest active experiences beyond the capacity are retired (reason `capacity`), first in, first out.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from pipeline.errors import InvalidArgumentError
from pipeline.extractor.protocol import (
    DistillOp,
    MergeOp,
    capacity_evictions,
    eviction_op_id,
    new_experience_id,
    op_id,
)
from pipeline.models.base import Generation
from schemas.arrays import EmbeddingVector
from schemas.base import Event, Producer
from schemas.experiences import (
    ExperienceAdded,
    ExperienceMerged,
    ExperienceRefined,
    ExperienceRetired,
    VersionedExperience,
)
from schemas.extractions import ExtractionGenerated
from schemas.trajectories import ExperienceRef, TrajectoryCompleted

_NAMESPACE = uuid.UUID("0f6f3f0e-3b1c-4a0e-9d55-7b0a4c1e2d90")


def generation_event_id(generation_id: str) -> uuid.UUID:
    """Deterministic event id of a generation's `ExtractionGenerated` (a repeat is deduplicated downstream)."""
    return uuid.uuid5(_NAMESPACE, generation_id)


@dataclass(frozen=True)
class Shown:
    """An experience as the extractor is shown it: the bank's current version."""

    experience_id: str
    version: int
    generation_id: str
    text: str
    key: np.ndarray | None = field(default=None, compare=False, repr=False)
    """Its retrieval key (unit float vector), where a merge keyed by its sources needs it."""

    def ref(self) -> ExperienceRef:
        return ExperienceRef(experience_id=self.experience_id, version=self.version, generation_id=self.generation_id)


@dataclass(frozen=True)
class OpAuthor:
    """Who writes the ops: the run, the extractor instance and the extractor version that generated them."""

    run_id: str
    producer: Producer
    extractor_version: int

    def op_fields(self, generation_id: str, index: int) -> dict[str, Any]:
        """The fields every op of a generation shares, with the op id of its `index`-th op."""
        return dict(run_id=self.run_id, producer=self.producer, op_id=op_id(generation_id, index),
                    generation_id=generation_id, extractor_version=self.extractor_version)


def distill_ops(author: OpAuthor, generation_id: str, trajectory: TrajectoryCompleted, shown: Sequence[Shown],
                parsed: Sequence[DistillOp], key: EmbeddingVector | None) -> list[Event]:
    """The ops of one distillation answer. `key` (the trajectory's query embedding) is needed when it adds."""
    ops: list[Event] = []
    sources = (trajectory.trajectory_id,)
    for index, op in enumerate(parsed):
        common = author.op_fields(generation_id, index)
        if op.op == "add":
            if key is None:
                raise InvalidArgumentError(f"{generation_id}: an add needs the trajectory's query embedding as its key")
            ops.append(ExperienceAdded(**common, text=op.text, experience_id=new_experience_id(generation_id, index),
                                       task_family=trajectory.task_family, key=key, source_trajectory_ids=sources))
        else:
            assert op.alias is not None  # `parse_distill` gives every refine the shown experience it rewrites
            target = shown[op.alias - 1]
            ops.append(ExperienceRefined(**common, text=op.text, experience_id=target.experience_id,
                                         expected_version=target.version, source_trajectory_ids=sources))
    return ops


def merged_key(model: str, sources: Sequence[np.ndarray | None]) -> EmbeddingVector:
    """The key of an experience merged from `sources` (their unit keys): their mean, renormalised. Its cosine to each
    source key is at least that of any two sources, so a query that found a source finds the merge about as well;
    two identical keys give that key back."""
    if not sources or any(source is None for source in sources):
        raise InvalidArgumentError("a merge keyed by its sources needs every source's key")
    mean = np.mean([np.asarray(source, dtype=np.float64) for source in sources], axis=0)
    norm = float(np.linalg.norm(mean))
    if norm == 0.0:
        raise InvalidArgumentError("the sources' keys cancel out: a merge of opposite keys has no direction")
    return EmbeddingVector.from_array(model, (mean / norm).astype(np.float32))


def merge_ops(author: OpAuthor, generation_id: str, task_family: str, members: Sequence[Shown],
              parsed: Sequence[MergeOp], keys: Sequence[EmbeddingVector]) -> tuple[list[Event], Shown | None]:
    """The ops of one merge answer over `members`, and what slides into the next chunk. `keys` holds the key of
    each `merge` op, in order (`merged_key` of its members, or its text's embedding)."""
    merges = [op for op in parsed if op.op == "merge"]
    if len(keys) != len(merges):
        raise InvalidArgumentError(f"{generation_id}: {len(merges)} merges need as many keys, got {len(keys)}")
    next_key = iter(keys)
    ops: list[Event] = []
    carry: Shown | None = None
    for index, op in enumerate(parsed):
        chosen = [members[alias - 1] for alias in op.aliases]
        common = author.op_fields(generation_id, index)
        if op.op == "merge":
            experience_id = new_experience_id(generation_id, index)
            key = next(next_key)
            ops.append(ExperienceMerged(
                **common, experience_id=experience_id, task_family=task_family, text=op.text, key=key,
                sources=tuple(VersionedExperience(experience_id=m.experience_id, expected_version=m.version)
                              for m in chosen)))
            carry = Shown(experience_id, 1, generation_id, op.text or "", key.to_numpy())
        elif op.op == "rewrite":
            target = chosen[0]
            ops.append(ExperienceRefined(**common, experience_id=target.experience_id,
                                         expected_version=target.version, text=op.text))
            carry = Shown(target.experience_id, target.version + 1, generation_id, op.text or "", target.key)
        elif op.op == "discard":
            ops.append(ExperienceRetired(**common, experience_id=chosen[0].experience_id,
                                         expected_version=chosen[0].version, reason="merge_discard"))
    return ops, carry


class Versioned(Protocol):
    """An experience at a version: a bank entry or a `Shown`."""

    @property
    def experience_id(self) -> str: ...

    @property
    def version(self) -> int: ...


def eviction_ops(author: OpAuthor, generation_id: str, active_oldest_first: Sequence[Versioned], pending_adds: int,
                 capacity: int) -> list[ExperienceRetired]:
    """Retire the oldest experiences while the bank, with `pending_adds` not yet applied, is over `capacity`; the op
    ids derive from `generation_id` (the batch's last generation)."""
    evicted = capacity_evictions(active_oldest_first, pending_adds, capacity)
    return [ExperienceRetired(
        run_id=author.run_id, producer=author.producer, op_id=eviction_op_id(generation_id, index),
        experience_id=experience.experience_id, expected_version=experience.version, reason="capacity",
    ) for index, experience in enumerate(evicted)]


def generation_record(author: OpAuthor, generation_id: str, purpose: Literal["distill", "merge"], task_family: str,
                      step: int, sources: tuple[str, ...], shown: Sequence[Shown], generation: Generation,
                      error: str | None, ops: Sequence[Event]) -> ExtractionGenerated:
    """The `ExtractionGenerated` of one generation: what was shown, the token ids and sampling log-probs the
    extractor trainer learns from, the parse status (`parse_error` with its reason, `ok` with ops, else `no_op`)
    and the ids of its ops."""
    status = "parse_error" if error is not None else "ok" if ops else "no_op"
    return ExtractionGenerated(
        event_id=generation_event_id(generation_id), run_id=author.run_id, producer=author.producer,
        generation_id=generation_id, extractor_version=author.extractor_version, purpose=purpose,
        task_family=task_family, step=step, source_trajectory_ids=sources, shown=tuple(s.ref() for s in shown),
        prompt_token_ids=generation.prompt_token_ids, response_token_ids=generation.token_ids,
        sampling_logprobs=generation.logprobs, response_text=generation.text,
        parse_status=status, parse_error=error, op_ids=tuple(op.op_id for op in ops),  # type: ignore[attr-defined]
    )
