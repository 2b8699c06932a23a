"""Bank snapshots: atomic directories, verification, and which one a restart may trust."""

from __future__ import annotations

import json

import pytest

from pipeline.bank.replay import replay
from pipeline.bank.snapshots import (
    SnapshotError,
    newest_snapshot,
    read_snapshot,
    restore_newest,
    write_snapshot,
)
from pipeline.bank.synthetic import synthetic_op_log


@pytest.fixture
def snapshots(tmp_path):
    """Snapshots of one log at offsets 50, 100 and 150, and one of another log at its end."""
    ops = synthetic_op_log(200, seed=17)
    for end in (50, 100, 150):
        write_snapshot(tmp_path, replay(enumerate(ops[:end])).state, log_id="log-a")
    write_snapshot(tmp_path, replay(enumerate(ops)).state, log_id="log-b")
    return tmp_path, ops


def test_a_restart_never_trusts_a_snapshot_ahead_of_sql(snapshots):
    root, ops = snapshots
    path, state = restore_newest(root, "log-a", at_most=120)
    assert (path.name, state.next_offset) == ("000000000100", 100)
    assert state.state_hash() == replay(enumerate(ops[:100])).state.state_hash()
    assert restore_newest(root, "log-a")[0].name == "000000000150"
    assert restore_newest(root, "log-b")[0].name == f"{len(ops):012d}"  # another log's snapshots never mix in
    assert restore_newest(root, "log-c") is None


def test_a_tampered_snapshot_is_skipped_for_the_next_older_one(snapshots):
    root, _ops = snapshots
    state_file = root / "000000000150" / "state.json"
    snapshot = json.loads(state_file.read_text())
    snapshot["experiences"][0]["text"] = "tampered"
    state_file.write_text(json.dumps(snapshot))
    with pytest.raises(SnapshotError, match="does not match its sha256"):
        read_snapshot(root / "000000000150")
    assert restore_newest(root, "log-a")[0].name == "000000000100"
    (root / "000000000100" / "manifest.json").write_text("{not json")
    assert newest_snapshot(root, "log-a", at_most=120).name == "000000000050"
    assert restore_newest(root, "log-a", at_most=120)[0].name == "000000000050"


def test_snapshot_writes_leave_no_temporary_directories(snapshots):
    root, ops = snapshots
    assert sorted(p.name for p in root.iterdir()) == ["000000000050", "000000000100", "000000000150",
                                                       f"{len(ops):012d}"]
