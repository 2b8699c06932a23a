"""LocalBank (state + index under a readers/writer lock) and the lock itself, without a broker."""

from __future__ import annotations

import threading
import time

import numpy as np

from pipeline.bank.replay import replay
from pipeline.bank.replica import LocalBank, ReadWriteLock
from pipeline.bank.synthetic import synthetic_op_log


def _brute_force(bank: LocalBank, query: np.ndarray, family: str, k: int) -> list[str]:
    active = list(bank.state.active(family))
    keys = np.stack([e.key.astype(np.float32) for e in active])
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    scores = keys @ (query / np.linalg.norm(query))
    order = sorted(range(len(active)), key=lambda i: (-scores[i], i))
    return [active[i].experience_id for i in order[:k]]


def test_the_index_follows_every_op_and_search_equals_brute_force():
    ops = synthetic_op_log(1500, seed=5)
    bank = LocalBank()
    for offset, op in enumerate(ops):
        bank.apply(op, offset)
    clean = replay(enumerate(ops)).state
    assert bank.state_hash() == clean.state_hash()
    assert bank.offset == len(ops)
    active_ids = {e.experience_id for e in clean.active()}
    assert {i for i in active_ids if i in bank.index} == active_ids and len(bank.index) == len(active_ids)
    rng = np.random.default_rng(0)
    families = sorted({e.task_family for e in clean.active()})
    queries = rng.standard_normal((len(families), 384)).astype(np.float32)
    results, offset = bank.search_candidates(queries, families, k=5)
    assert offset == len(ops)
    for query, family, found in zip(queries, families, results, strict=True):
        assert [c.experience_id for c in found] == _brute_force(bank, query, family, 5)
        for candidate in found:
            experience = clean.experiences[candidate.experience_id]
            assert (candidate.version, candidate.generation_id, candidate.text, candidate.task_family) == (
                experience.version, experience.generation_id, experience.text, family)


def test_a_bank_restored_from_a_snapshot_state_searches_the_same():
    ops = synthetic_op_log(600, seed=9)
    live = LocalBank()
    for offset, op in enumerate(ops):
        live.apply(op, offset)
    from pipeline.bank.state import BankState

    restored = LocalBank(BankState.from_snapshot(live.state.to_snapshot()))
    query = np.random.default_rng(1).standard_normal((1, 384)).astype(np.float32)
    family = next(live.state.active()).task_family
    assert restored.search_candidates(query, [family], 8) == live.search_candidates(query, [family], 8)


def test_an_empty_bank_returns_no_candidates_with_its_offset():
    bank = LocalBank()
    results, offset = bank.search_candidates(np.ones((2, 4), dtype=np.float32), ["a", "b"], 3)
    assert (results, offset) == ([[], []], 0)


def test_readers_share_the_lock_and_a_writer_waits_for_them():
    lock = ReadWriteLock()
    events: list[str] = []
    lock.acquire_read()
    lock.acquire_read()  # two readers at once

    def write() -> None:
        lock.acquire_write()
        events.append("write")
        lock.release_write()

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.05)
    assert events == []  # blocked by the readers
    blocked_reader_got_in = threading.Event()

    def late_reader() -> None:
        lock.acquire_read()
        blocked_reader_got_in.set()
        lock.release_read()

    reader = threading.Thread(target=late_reader)
    reader.start()
    time.sleep(0.05)
    assert not blocked_reader_got_in.is_set()  # a waiting writer holds off new readers
    lock.release_read()
    lock.release_read()
    writer.join(2)
    reader.join(2)
    assert events == ["write"] and blocked_reader_got_in.is_set()


def test_a_bank_started_from_a_snapshot_uses_its_saved_index(tmp_path):
    from pipeline.bank.snapshots import read_index, read_snapshot, write_snapshot

    log = synthetic_op_log(450, seed=13)
    ops, extra = log[:400], log[400:]
    live = LocalBank()
    for offset, op in enumerate(ops):
        live.apply(op, offset)
    path, _manifest = write_snapshot(tmp_path, live.state, log_id="log-a")
    state, _ = read_snapshot(path)
    index = read_index(path)
    started = LocalBank(state, index=index)
    assert started.index is index and len(index) == sum(1 for _ in live.state.active())
    query = np.random.default_rng(2).standard_normal((1, 384)).astype(np.float32)
    family = next(live.state.active()).task_family
    assert started.search_candidates(query, [family], 8) == live.search_candidates(query, [family], 8)
    # It keeps following the log like any bank.
    for offset, op in enumerate(extra, start=400):
        assert started.apply(op, offset) == live.apply(op, offset)
    assert started.state_hash() == live.state_hash()
