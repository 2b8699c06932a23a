"""The experience bank as a pure state machine over `crl.experience-ops`. No I/O, no clocks, no randomness.

    state = BankState(run_id)
    for offset, op in enumerate(ops):
        outcome = state.apply(op, offset)     # Applied | Duplicate | Rejected(reason)
    state.state_hash()                        # equal on every replica that applied the same log

Rules (docs/bank.md; the paper's experience operations, docs/design.md):
- `ExperienceAdded` creates version 1 of a new id; an id that exists (even retired) is rejected.
- `ExperienceRefined` keeps the id and bumps the version; the previous text stays in `history`.
- `ExperienceMerged` creates a new experience whose `parents` are the sources, and retires every source with
  `merged_into` set. All sources must be active, at their expected versions and of the merge's task family, or the
  whole merge is rejected.
- `ExperienceRetired` retires one experience (discarded in a merge, or evicted by the capacity cap).
- Every touched experience must be at the op's `expected_version`; a mismatch, an unknown id or a retired target is
  rejected with a reason. The decision depends only on the state and the op, so every replica decides the same.
- An `op_id` seen before (applied or rejected) is a `Duplicate` and changes nothing: a re-processed trajectory or a
  re-delivered record yields the same op ids.
- Every key vector of a bank comes from one embedding model and dimension; an op with another is rejected.
- A bank belongs to one run: given its `run_id`, an op stamped with another run's is rejected (and its op id is not
  remembered, so it cannot shadow an op of this run). Every consumer of the log (the bank worker, the replicas, both
  replays) passes the run's id, so they decide alike.

Retrieval and training counters come from other topics (`TrajectoryCompleted`, `TrainStepCompleted`) whose
interleaving with the op log differs between consumers, so they are not in the hash. The bank worker counts them
idempotently in SQL (`pipeline.bank.store`); the fields here carry them when a state is loaded from there.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from pipeline.bank.op_records import RECORD_TYPES, KeyRecord, OpRecord, read_canonical
from pipeline.errors import HashMismatchError, InvalidArgumentError
from schemas.arrays import EmbeddingVector, PackedFloats
from schemas.codec import decode
from schemas.experiences import ExperienceAdded, ExperienceMerged, ExperienceRefined, ExperienceRetired
from schemas.topics import EXPERIENCE_OPS_TOPIC

ExperienceOp = ExperienceAdded | ExperienceRefined | ExperienceMerged | ExperienceRetired
BankOp = ExperienceOp | OpRecord
"""An op as a bank applies it: the event, or the bank's own record of it (`read_op`)."""
Status = Literal["active", "retired"]


MOJIBAKE = re.compile("\ufffd|[\u00c2\u00c3][\u0080-\u00bf]|\u00e2\u20ac")
"""What no reader can make sense of: U+FFFD (bytes that decoded to no character, as when a model's answer stops
inside a character) and the marks of UTF-8 read as Latin-1 or cp1252 (an e-acute shown as "\u00c3\u00a9", a right
quote as "\u00e2\u20ac\u2122")."""


def undecodable(text: str) -> bool:
    """Whether an experience's text holds undecodable characters (`MOJIBAKE`)."""
    return MOJIBAKE.search(text) is not None


def decode_op(data: bytes | None) -> ExperienceOp:
    """One record value of the op log, decoded (raises `EventDecodeError` as `decode` does)."""
    op = decode(EXPERIENCE_OPS_TOPIC, data)
    assert isinstance(op, ExperienceOp)  # the topic's registry holds the four op kinds only
    return op


def read_op(data: bytes | None) -> BankOp:
    """One record value of the op log, for applying to a bank: a canonical record as the bank's own lighter record
    (`pipeline.bank.op_records`, about 1.6x faster to read), any other as `decode_op` decodes it (or raises). Both
    apply alike; a consumer that needs the event itself (its pydantic type, `model_dump`) uses `decode_op`."""
    if data is not None:
        op = read_canonical(data)
        if op is not None:
            return op
    return decode_op(data)


@dataclass(frozen=True, slots=True)
class Applied:
    op_id: str
    touched: tuple[str, ...]
    """Experience ids whose state changed (the new one first for adds and merges)."""


@dataclass(frozen=True, slots=True)
class Duplicate:
    op_id: str


@dataclass(frozen=True, slots=True)
class Rejected:
    op_id: str
    reason: str


Outcome = Applied | Duplicate | Rejected


@dataclass(frozen=True, slots=True)
class ExperienceVersion:
    """One version of an experience's text and the op that wrote it."""

    version: int
    text: str
    op_id: str
    op_kind: str
    op_offset: int
    generation_id: str
    extractor_version: int
    source_trajectory_ids: tuple[str, ...]


@dataclass(slots=True)
class Experience:
    experience_id: str
    task_family: str
    text: str
    key: np.ndarray = field(repr=False)
    """Key vector, float16, read-only (the embedding of the source query; for a merge, as its op gave it)."""
    version: int
    status: Status
    generation_id: str
    """Generation that wrote the current version (credit for the episodes it guides goes there)."""
    extractor_version: int
    source_trajectory_ids: tuple[str, ...]
    parents: tuple[str, ...] = ()
    """Experiences merged into this one."""
    merged_into: str | None = None
    retired_reason: str | None = None
    op_offsets: list[int] = field(default_factory=list)
    """Offsets in crl.experience-ops of every op that touched this experience."""
    history: list[ExperienceVersion] = field(default_factory=list)
    retrievals: int = 0
    """Times the experience was served to a guided episode (from TrajectoryCompleted)."""
    trainings: int = 0
    """Times a generation that wrote it entered an extractor training step (from TrainStepCompleted)."""
    last_trained_step: int | None = None

    @property
    def active(self) -> bool:
        return self.status == "active"


def _frozen_key(key: EmbeddingVector | KeyRecord) -> np.ndarray:
    if type(key) is KeyRecord:
        return key.float16()  # a read-only view of its decoded bytes
    data: object = key.data
    if type(data) is PackedFloats and data.dtype == "<f2":  # a decoded op: a read-only view of its bytes
        return np.frombuffer(data.packed, dtype="<f2")
    vector = key.float16()
    if vector.flags.writeable:  # a view of the event's bytes is read-only already
        vector = vector.copy()
        vector.setflags(write=False)
    return vector


class BankState:
    """Experiences by id, plus the op ids seen and the position in the op log."""

    def __init__(self, run_id: str | None = None) -> None:
        self.run_id = run_id
        """The run whose ops this bank applies; None applies any run's (synthetic banks, benchmarks)."""
        self.experiences: dict[str, Experience] = {}
        self.seen_op_ids: set[str] = set()
        self.key_model: str | None = None
        self.key_dim: int | None = None
        self.next_offset = 0
        """First op offset not yet applied."""
        self.applied = 0
        self.duplicates = 0
        self.rejected = 0

    # -- applying ops ---------------------------------------------------------------------------------------------

    def apply(self, op: BankOp, offset: int) -> Outcome:
        """Apply `op`, read at `offset` of the op log."""
        if offset >= self.next_offset:
            self.next_offset = offset + 1
        if self.run_id is not None and op.run_id != self.run_id:
            self.rejected += 1
            return Rejected(op.op_id, f"op of run {op.run_id}, but this bank belongs to run {self.run_id}")
        op_id = op.op_id
        if op_id in self.seen_op_ids:
            self.duplicates += 1
            return Duplicate(op_id)
        self.seen_op_ids.add(op_id)
        # One look-up by the op's class instead of chains of isinstance checks (up to 7 per op, each through
        # pydantic's ABCMeta); a subclass of an op kind falls back to the checks (`_kind_of`).
        check, change = _BY_KIND.get(type(op)) or _kind_of(op)
        reason = check(self, op)
        if reason is not None:
            self.rejected += 1
            return Rejected(op_id, reason)
        touched = change(self, op, offset)
        self.applied += 1
        return Applied(op_id, touched)

    def _check_key(self, key: EmbeddingVector | KeyRecord | None) -> str | None:
        if key is None or self.key_model is None:
            return None
        if key.model != self.key_model or key.dim != self.key_dim:
            return (f"key from {key.model} ({key.dim}-d), but the bank's keys come from {self.key_model}"
                    f" ({self.key_dim}-d)")
        return None

    def _check_target(self, experience_id: str, expected_version: int) -> str | None:
        experience = self.experiences.get(experience_id)
        if experience is None:
            return f"unknown experience {experience_id}"
        if experience.status != "active":
            into = f", merged into {experience.merged_into}" if experience.merged_into else ""
            return f"experience {experience_id} is retired ({experience.retired_reason}{into})"
        if experience.version != expected_version:
            return (f"version conflict on {experience_id}: the op expects version {expected_version},"
                    f" the bank has version {experience.version}")
        return None

    def _check_added(self, op: ExperienceAdded) -> str | None:
        if op.experience_id in self.experiences:
            return f"experience {op.experience_id} already exists"
        return self._check_key(op.key)

    def _check_refined(self, op: ExperienceRefined) -> str | None:
        return self._check_target(op.experience_id, op.expected_version) or self._check_key(op.key)

    def _check_merged(self, op: ExperienceMerged) -> str | None:
        if op.experience_id in self.experiences:
            return f"experience {op.experience_id} already exists"
        for source in op.sources:
            reason = self._check_target(source.experience_id, source.expected_version)
            if reason is not None:
                return f"merge source: {reason}"
            family = self.experiences[source.experience_id].task_family
            if family != op.task_family:
                return (f"merge source {source.experience_id} belongs to task family {family},"
                        f" not {op.task_family}")
        return self._check_key(op.key)

    def _check_retired(self, op: ExperienceRetired) -> str | None:
        return self._check_target(op.experience_id, op.expected_version)

    def _remember_key_space(self, key: EmbeddingVector | KeyRecord) -> None:
        if self.key_model is None:
            self.key_model, self.key_dim = key.model, key.dim

    def _create(self, op: ExperienceAdded | ExperienceMerged, offset: int, parents: tuple[str, ...],
                sources: tuple[str, ...]) -> None:
        if self.key_model is None:
            self._remember_key_space(op.key)
        self.experiences[op.experience_id] = Experience(
            experience_id=op.experience_id,
            task_family=op.task_family,
            text=op.text,
            key=_frozen_key(op.key),
            version=1,
            status="active",
            generation_id=op.generation_id,
            extractor_version=op.extractor_version,
            source_trajectory_ids=sources,
            parents=parents,
            op_offsets=[offset],
            history=[ExperienceVersion(1, op.text, op.op_id, op.kind, offset, op.generation_id,
                                       op.extractor_version, sources)],
        )

    def _change_added(self, op: ExperienceAdded, offset: int) -> tuple[str, ...]:
        self._create(op, offset, (), op.source_trajectory_ids)
        return (op.experience_id,)

    def _change_merged(self, op: ExperienceMerged, offset: int) -> tuple[str, ...]:
        parents = tuple(s.experience_id for s in op.sources)
        self._create(op, offset, parents, ())
        for parent in parents:
            self._retire(parent, "merged", offset, merged_into=op.experience_id)
        return (op.experience_id, *parents)

    def _change_refined(self, op: ExperienceRefined, offset: int) -> tuple[str, ...]:
        experience = self.experiences[op.experience_id]
        experience.version += 1
        experience.text = op.text
        if op.key is not None:
            self._remember_key_space(op.key)
            experience.key = _frozen_key(op.key)
        experience.generation_id = op.generation_id
        experience.extractor_version = op.extractor_version
        experience.source_trajectory_ids = tuple(
            dict.fromkeys(experience.source_trajectory_ids + op.source_trajectory_ids)
        )
        experience.op_offsets.append(offset)
        experience.history.append(ExperienceVersion(experience.version, op.text, op.op_id, op.kind, offset,
                                                    op.generation_id, op.extractor_version,
                                                    op.source_trajectory_ids))
        return (op.experience_id,)

    def _change_retired(self, op: ExperienceRetired, offset: int) -> tuple[str, ...]:
        self._retire(op.experience_id, op.reason, offset)
        return (op.experience_id,)

    def _retire(self, experience_id: str, reason: str, offset: int, merged_into: str | None = None) -> None:
        experience = self.experiences[experience_id]
        experience.status = "retired"
        experience.retired_reason = reason
        experience.merged_into = merged_into
        experience.op_offsets.append(offset)

    # -- reading --------------------------------------------------------------------------------------------------

    def active(self, task_family: str | None = None) -> Iterator[Experience]:
        """Active experiences in canonical (id) order, optionally of one task family."""
        for experience_id in sorted(self.experiences):
            experience = self.experiences[experience_id]
            if experience.active and (task_family is None or experience.task_family == task_family):
                yield experience

    def state_hash(self, run_id: str | None = None) -> str:
        """sha256 over the canonical, id-sorted content: id, family, version, status, text, lineage, credit
        (generation, extractor version, source trajectories), every version's text and op, and the key bytes.

        A content hash: log offsets are not in it (the history keeps them for audit), nor wall time or counters, so a
        log with a re-published op (a producer retry lands it twice, the second a duplicate) hashes like the same log
        without it.

        run_id: leave this run id out of every id (experience, generation and op ids begin with it), so two runs of one
        config compare by content (`pipeline.audit.fingerprint`).
        """
        digest = hashlib.sha256()
        digest.update(json.dumps({"key_model": self.key_model, "key_dim": self.key_dim}).encode())
        for experience_id in sorted(self.experiences):
            experience = self.experiences[experience_id]
            record = [
                experience.experience_id, experience.task_family, experience.version, experience.status,
                experience.text, experience.merged_into, list(experience.parents), experience.retired_reason,
                # Credit and lineage too: a replay must agree on who wrote what, not only on the current text.
                experience.generation_id, experience.extractor_version, list(experience.source_trajectory_ids),
                [[v.version, v.text, v.op_id, v.op_kind, v.generation_id, v.extractor_version,
                  list(v.source_trajectory_ids)] for v in experience.history],
            ]
            text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
            line = (text.replace(json.dumps(run_id + "-")[1:-1], "") if run_id else text).encode()
            digest.update(len(line).to_bytes(8, "little"))
            digest.update(line)
            digest.update(experience.key.astype("<f2").tobytes())
        return digest.hexdigest()

    # -- snapshots ------------------------------------------------------------------------------------------------

    def to_snapshot(self) -> dict[str, Any]:
        """Everything needed to continue from `next_offset` (JSON-serialisable; keys as base64 float16)."""
        experiences = []
        for experience_id in sorted(self.experiences):
            record = asdict(self.experiences[experience_id])
            record["key"] = base64.b64encode(self.experiences[experience_id].key.astype("<f2").tobytes()).decode()
            experiences.append(record)
        return {
            "format": 1,
            "next_offset": self.next_offset,
            "counts": {"applied": self.applied, "duplicates": self.duplicates, "rejected": self.rejected},
            "key_model": self.key_model,
            "key_dim": self.key_dim,
            "seen_op_ids": sorted(self.seen_op_ids),
            "experiences": experiences,
            "state_hash": self.state_hash(),
        }

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any]) -> BankState:
        """Restore a state written by `to_snapshot`; raises ValueError if its recorded hash does not match."""
        if snapshot.get("format") != 1:
            raise InvalidArgumentError(f"unknown bank snapshot format {snapshot.get('format')!r}")
        state = cls()
        state.next_offset = snapshot["next_offset"]
        state.applied = snapshot["counts"]["applied"]
        state.duplicates = snapshot["counts"]["duplicates"]
        state.rejected = snapshot["counts"]["rejected"]
        state.key_model = snapshot["key_model"]
        state.key_dim = snapshot["key_dim"]
        state.seen_op_ids = set(snapshot["seen_op_ids"])
        for record in snapshot["experiences"]:
            record = dict(record)
            key = np.frombuffer(base64.b64decode(record.pop("key")), dtype="<f2").copy()
            key.setflags(write=False)
            record["history"] = [ExperienceVersion(**{**version, "source_trajectory_ids":
                                                      tuple(version["source_trajectory_ids"])})
                                 for version in record["history"]]
            record["parents"] = tuple(record["parents"])
            record["source_trajectory_ids"] = tuple(record["source_trajectory_ids"])
            state.experiences[record["experience_id"]] = Experience(key=key, **record)
        if state.state_hash() != snapshot["state_hash"]:
            raise HashMismatchError("bank snapshot is corrupt: its state does not match its recorded hash")
        return state

    def summary(self) -> dict[str, object]:
        return {
            "next_offset": self.next_offset,
            "applied": self.applied,
            "duplicates": self.duplicates,
            "rejected": self.rejected,
            "experiences": len(self.experiences),
            "active": sum(1 for e in self.experiences.values() if e.active),
            "state_hash": self.state_hash(),
        }


_Check = Callable[[BankState, Any], "str | None"]
_Change = Callable[[BankState, Any, int], tuple[str, ...]]

_BY_KIND: dict[type, tuple[_Check, _Change]] = {
    ExperienceAdded: (BankState._check_added, BankState._change_added),
    ExperienceRefined: (BankState._check_refined, BankState._change_refined),
    ExperienceMerged: (BankState._check_merged, BankState._change_merged),
    ExperienceRetired: (BankState._check_retired, BankState._change_retired),
}
_BY_KIND.update({record: _BY_KIND[next(kind for kind in _BY_KIND if kind.__name__ == record.kind)]
                 for record in RECORD_TYPES})
"""How `BankState.apply` checks and changes the state for each op kind (an event or the bank's own record of it)."""


def _kind_of(op: BankOp) -> tuple[_Check, _Change]:
    """The handlers for an instance of a subclass of an op kind (not in `_BY_KIND` by its own class)."""
    for kind, handlers in _BY_KIND.items():
        if isinstance(op, kind):
            return handlers
    raise InvalidArgumentError(f"not an experience op: {type(op).__name__}")
