"""Which consumer-group commit a restored log carries a group on from: hand-worked cases of
`restorable_group_positions` over commits recorded with `GroupCommitLog` (SQLite in a temporary directory)."""

from __future__ import annotations

import pytest

from pipeline.runtime.group_commits import GroupCommitLog, restorable_group_positions
from pipeline.runtime.offsets import LogPosition

TASKS, TRAJ = "crl.tasks", "crl.trajectories"


@pytest.fixture
def engine(tmp_path, sqlite_in):  # type: ignore[no-untyped-def]
    return sqlite_in(tmp_path)


def test_the_latest_commit_whose_outputs_were_all_restored_wins_per_partition(engine):
    produced: dict = {}
    member = GroupCommitLog(engine, "crl-rollout", "rollout-0", lambda: produced)
    produced.update({(TRAJ, 1): 4})
    member.record({(TASKS, 0): LogPosition(5, "T"), (TASKS, 3): LogPosition(2, "T")})
    produced.update({(TRAJ, 1): 9, (TRAJ, 2): 1})  # written before the next commit
    member.record({(TASKS, 0): LogPosition(11, "T")})
    ends = {(TASKS, 0): LogPosition(20, "T"), (TASKS, 3): LogPosition(20, "T"),
            (TRAJ, 1): LogPosition(9, "J"), (TRAJ, 2): LogPosition(0, "J")}
    # crl.trajectories[2] ends at 0: the second commit's output there is gone, so crl.tasks[0] goes back to 5
    assert restorable_group_positions(engine, ends) == {"crl-rollout": {(TASKS, 0): 5, (TASKS, 3): 2}}
    ends[(TRAJ, 2)] = LogPosition(1, "J")
    assert restorable_group_positions(engine, ends) == {"crl-rollout": {(TASKS, 0): 11, (TASKS, 3): 2}}


def test_a_commit_past_the_restored_end_is_capped_and_one_in_another_log_or_with_outputs_outside_it_is_not_used(
        engine):
    GroupCommitLog(engine, "crl-extractor", "extractor-0", dict).record({(TRAJ, 0): LogPosition(30, "J")})
    GroupCommitLog(engine, "crl-extractor", "extractor-1", dict).record({(TRAJ, 1): LogPosition(8, "old")})
    GroupCommitLog(engine, "crl-rollout", "rollout-0", lambda: {("crl.unknown", 0): 1}).record(
        {(TASKS, 0): LogPosition(3, "T")})
    ends = {(TRAJ, 0): LogPosition(25, "J"), (TRAJ, 1): LogPosition(25, "J"), (TASKS, 0): LogPosition(9, "T")}
    assert restorable_group_positions(engine, ends) == {"crl-extractor": {(TRAJ, 0): 25}}


def test_nothing_is_recorded_for_an_empty_commit(engine):
    GroupCommitLog(engine, "crl-rollout", "rollout-0", dict).record({})
    assert restorable_group_positions(engine, {(TASKS, 0): LogPosition(1, "T")}) == {}
