"""Read replicas of the experience bank for the workers that search it (rollout, extractor).

    replica = BankReplica(context.follow, log_id, run_dir).start()  # newest snapshot, then follows the op log
    replica.wait_caught_up(timeout_s=10)
    candidates, bank_offset = replica.search_candidates(query_vectors, ["minihack-room"], k=16)

`LocalBank` is the part without Kafka: the state machine plus its index, with a writer lock for applying ops and
shared reader locks for searching (docs/bank.md), usable directly in tests and benchmarks. `BankReplica` adds the
follower (`pipeline.runtime.log`): it starts from the newest snapshot of the current log (or offset 0), applies every
op in the follower's thread, and knows it is caught up when it has applied everything up to the partition's high
watermark.

A replica decides every op exactly as the bank worker does (same state machine, same log order), so its
`state_hash()` equals the bank's at the same offset. Records that do not decode are skipped here: the bank worker
dead-letters them, and a replica must not write.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.bank.index import (
    DEFAULT_CONNECTIVITY,
    DEFAULT_EXPANSION_ADD,
    DEFAULT_EXPANSION_SEARCH,
    ExperienceIndex,
    HnswOptions,
)
from pipeline.bank.snapshots import read_index, restore_newest, snapshots_root
from pipeline.bank.state import Applied, BankOp, BankState, Experience, Outcome, read_op
from pipeline.errors import InvalidStateError
from pipeline.runtime.log import Follow, FollowedView, Follower
from pipeline.runtime.transport import Record
from schemas.codec import EventDecodeError
from schemas.topics import EXPERIENCE_OPS_TOPIC

log = logging.getLogger(__name__)


class ReadWriteLock:
    """Many readers or one writer; a waiting writer holds off new readers, so a stream of searches cannot starve
    the op tail."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    def acquire_read(self) -> None:
        with self._condition:
            while self._writing or self._writers_waiting:
                self._condition.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._condition:
            self._readers -= 1
            if not self._readers:
                self._condition.notify_all()

    def acquire_write(self) -> None:
        with self._condition:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._condition.wait()
            self._writers_waiting -= 1
            self._writing = True

    def release_write(self) -> None:
        with self._condition:
            self._writing = False
            self._condition.notify_all()


@dataclass(frozen=True)
class Candidate:
    """An experience as a search found it, with what ranking and credit need."""

    experience_id: str
    task_family: str
    version: int
    generation_id: str
    text: str
    score: float
    """Cosine similarity between the query and the experience's key."""


class LocalBank:
    """The bank state and its index in one process, guarded by a readers/writer lock."""

    def __init__(self, state: BankState | None = None, exact_threshold: int = 10_000,
                 index: ExperienceIndex | None = None, hnsw: HnswOptions | None = None) -> None:
        """`index`, when given, must hold exactly the active experiences of `state` (a snapshot's index).

        `hnsw`: the graph settings (`BankSettings.hnsw_options()`; a setting left out takes `ExperienceIndex`'s
        default). A given index built with other settings than these is not used: it is rebuilt from `state` (logged
        as a warning; the index is derived state, and a graph grown with another connectivity or expansion_add cannot
        be changed in place), so a replica always searches with what it is configured with. This costs a graph
        build (~40 s per 100k vectors of a family on a 2-core machine) once, when the settings changed between
        the snapshot and the start. A differing expansion_search alone is adopted without a rebuild.
        """
        self.state = state if state is not None else BankState()
        self.exact_threshold = exact_threshold
        self.hnsw: HnswOptions = {"connectivity": DEFAULT_CONNECTIVITY, "expansion_add": DEFAULT_EXPANSION_ADD,
                                  "expansion_search": DEFAULT_EXPANSION_SEARCH, **(hnsw or {})}
        self.lock = ReadWriteLock()
        if index is not None:
            differ = index.mismatches(exact_threshold, **self.hnsw)
            if differ:
                log.warning("the given index was built with %s; configured: %s. Rebuilding it from the bank state",
                            ", ".join(f"{name}={was}" for name, (was, _) in differ.items()),
                            ", ".join(f"{name}={wanted}" for name, (_, wanted) in differ.items()))
                index = None
            else:
                index.set_expansion_search(self.hnsw["expansion_search"])
        self.index = index
        if self.index is None and self.state.key_dim is not None:
            self.index = ExperienceIndex.build(
                ((e.experience_id, e.task_family, e.key) for e in self.state.active()),
                dim=self.state.key_dim, exact_threshold=exact_threshold, **self.hnsw,
            )

    def apply(self, op: BankOp, offset: int) -> Outcome:
        """Apply one op (writer lock) and bring the index in line with the experiences it touched."""
        self.lock.acquire_write()
        try:
            outcome = self.state.apply(op, offset)
            if isinstance(outcome, Applied):
                if self.index is None and self.state.key_dim is not None:
                    self.index = ExperienceIndex(self.state.key_dim, self.exact_threshold, **self.hnsw)
                for experience_id in outcome.touched:
                    self._reindex(self.state.experiences[experience_id])
            return outcome
        finally:
            self.lock.release_write()

    def _reindex(self, experience: Experience) -> None:
        assert self.index is not None
        if experience.active:
            self.index.add(experience.experience_id, experience.task_family, experience.key)
        elif experience.experience_id in self.index:
            self.index.remove(experience.experience_id)

    @property
    def offset(self) -> int:
        """The next op offset not yet applied: the bank version every search result is served from."""
        self.lock.acquire_read()
        try:
            return self.state.next_offset
        finally:
            self.lock.release_read()

    def experience(self, experience_id: str) -> Experience | None:
        """The experience as this replica holds it now (None: never seen)."""
        self.lock.acquire_read()
        try:
            return self.state.experiences.get(experience_id)
        finally:
            self.lock.release_read()

    def active_experiences(self, task_family: str | None = None) -> list[Experience]:
        """The active experiences (of one family), oldest first: by the offset of the op that created them."""
        self.lock.acquire_read()
        try:
            return sorted(self.state.active(task_family), key=lambda e: (e.op_offsets[0], e.experience_id))
        finally:
            self.lock.release_read()

    def state_hash(self) -> str:
        self.lock.acquire_read()
        try:
            return self.state.state_hash()
        finally:
            self.lock.release_read()

    def search_candidates(
        self, queries: np.ndarray, task_families: Sequence[str], k: int
    ) -> tuple[list[list[Candidate]], int]:
        """Up to `k` candidates per query (best first, within its family) and the offset they were served from."""
        self.lock.acquire_read()
        try:
            if self.index is None:
                return [[] for _ in task_families], self.state.next_offset
            found = self.index.search(queries, task_families, k)
            results = []
            for hits in found:
                candidates = []
                for experience_id, score in hits:
                    experience = self.state.experiences[experience_id]
                    candidates.append(Candidate(experience_id, experience.task_family, experience.version,
                                                experience.generation_id, experience.text, float(score)))
                results.append(candidates)
            return results, self.state.next_offset
        finally:
            self.lock.release_read()


class BankReplica(LocalBank, FollowedView):
    """A `LocalBank` that follows `crl.experience-ops` from the newest snapshot of log `log_id`."""

    def __init__(self, follow: Follow, log_id: str, run_dir: Path | None = None, exact_threshold: int = 10_000,
                 run_id: str | None = None, hnsw: HnswOptions | None = None) -> None:
        """`exact_threshold` and `hnsw` as for `LocalBank`: a snapshot whose index was built with other settings is
        restored, and its index rebuilt from the snapshot's state."""
        self.log_id = log_id
        self.run_dir = run_dir
        self.skipped = 0
        """Records that did not decode (the bank worker dead-letters them)."""
        state, index = None, None
        restored = (restore_newest(snapshots_root(run_dir), self.log_id, run_id=run_id) if run_dir is not None
                    else None)
        if restored is not None:
            snapshot, state = restored
            index = read_index(snapshot)  # saved with the state: no rebuild of a large HNSW graph
            log.info("replica starts from snapshot %s", snapshot.name)
        super().__init__(state if state is not None else BankState(run_id), exact_threshold, index, hnsw)
        self.follower: Follower = follow([EXPERIENCE_OPS_TOPIC], self._on_record,
                                         start={(EXPERIENCE_OPS_TOPIC.name, 0): self.state.next_offset},
                                         name="bank-replica")

    def _on_record(self, record: Record) -> None:
        try:
            op = read_op(record.value)
        except EventDecodeError:
            self.skipped += 1
        else:
            self.apply(op, record.offset)

    def caught_up(self) -> bool:
        """True once every op up to the high watermark last seen is applied."""
        return self.follower.caught_up()

    def wait_for_offset(self, offset: int, timeout_s: float) -> bool:
        """Wait until every op before `offset` is applied (read your own writes: pass the log's end after a flush)."""
        if self.failure is not None:
            raise InvalidStateError(f"the bank replica stopped: {self.failure}") from self.failure
        return self.follower.wait_for({(EXPERIENCE_OPS_TOPIC.name, 0): offset}, timeout_s)

    def wait_caught_up(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.caught_up():
                return True
            time.sleep(0.02)
        return self.caught_up()
