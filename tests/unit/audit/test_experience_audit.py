"""The experience audit views and `crl audit experience`, over archives the real Archiver wrote (no broker).

The op log below exercises every bank rule: adds, a refine, a stale refine (version conflict), an op id repeated by
a re-delivered record and by a different op, a merge, a refine of a merged (retired) source, an eviction and a
refine of an unknown id. Only the ops the bank applied may show in the views.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from experience_ops import add, refine
from typer.testing import CliRunner

from pipeline.audit.archive import archive_root, archive_row, write_segments
from pipeline.audit.bank_replay import archived_logs, ops_from_archive
from pipeline.audit.views import EXPERIENCE_VIEWS, Audit
from pipeline.bank.replay import replay
from pipeline.cli import app
from pipeline.errors import AuditQueryError
from pipeline.runtime.harness import MEMORY_LOG_ID, run_worker
from schemas.arrays import EmbeddingVector
from schemas.base import Event, Producer
from schemas.experiences import (
    ExperienceMerged,
    ExperienceRetired,
    VersionedExperience,
)
from schemas.topics import EXPERIENCE_OPS_TOPIC
from schemas.trajectories import ExperienceRef, Timings, TrajectoryCompleted, Turn
from workers.archiver import Archiver

WHO = Producer(worker="extractor", instance="extractor-0")
KEY = EmbeddingVector.from_array("all-MiniLM-L6-v2", [0.25, -0.5, 0.125, 1.0])
T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
FAMILY = "minihack-room"


def at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


def common(seconds: int) -> dict:
    return {"run_id": "exp-audit", "producer": WHO, "occurred_at": at(seconds)}


def added(offset: int, op_id: str, experience_id: str, text: str, generation_id: str, sources: tuple[str, ...]):
    return add(op_id, experience_id, text, FAMILY, KEY, **common(offset), generation_id=generation_id,
               source_trajectory_ids=sources)


def refined(offset: int, op_id: str, experience_id: str, expected: int, text: str, generation_id: str):
    return refine(op_id, experience_id, expected, text, **common(offset), generation_id=generation_id,
                  source_trajectory_ids=(f"traj-{generation_id}",))


ADD_B = added(1, "gen-1:1", "exp-b", "B1: stairs are often in a corner.", "gen-1", ("traj-1",))
OPS: list[Event] = [
    added(0, "gen-1:0", "exp-a", "A1: walk toward '>'.", "gen-1", ("traj-1",)),                   # 0 applied
    ADD_B,                                                                                          # 1 applied
    refined(2, "gen-2:0", "exp-a", 1, "A2: walk diagonally toward '>'.", "gen-2"),                 # 2 applied
    refined(3, "gen-3:0", "exp-a", 1, "A-stale: written against version 1.", "gen-3"),             # 3 conflict
    refined(4, "gen-2:0", "exp-b", 1, "B-dup: a re-processed trajectory's op.", "gen-2"),          # 4 duplicate id
    ADD_B,                                                                                          # 5 re-delivered
    ExperienceMerged(**common(6), op_id="merge-1:0", experience_id="exp-m", task_family=FAMILY,  # 6 applied
                     text="M1: find '>' and walk straight to it.", key=KEY,
                     sources=(VersionedExperience(experience_id="exp-a", expected_version=2),
                              VersionedExperience(experience_id="exp-b", expected_version=1)),
                     generation_id="gen-m", extractor_version=1),
    refined(7, "gen-6:0", "exp-a", 2, "A-late: exp-a is merged away.", "gen-6"),                   # 7 retired target
    added(8, "gen-4:0", "exp-c", "C1: kick doors open.", "gen-4", ("traj-4",)),                    # 8 applied
    ExperienceRetired(**common(9), op_id="evict:exp-c", experience_id="exp-c", expected_version=1,  # 9 applied
                      reason="capacity"),
    refined(10, "gen-7:0", "exp-zzz", 1, "Z: nobody has this id.", "gen-7"),                        # 10 unknown
    refined(11, "gen-5:0", "exp-m", 1, "M2: find '>' first, then walk straight to it.", "gen-5"),  # 11 applied
]


def trajectory(name: str, step: int, served: tuple[tuple[str, int, str], ...], success: bool) -> TrajectoryCompleted:
    reward = 1.0 if success else 0.0
    return TrajectoryCompleted(
        run_id="exp-audit", producer=Producer(worker="rollout", instance="rollout-0"), occurred_at=at(100 + step),
        trajectory_id=name, assignment_event_id=f"assign-{name}", step=step, split="train",
        env_id="MiniHack-Room-Random-5x5-v0", task_family=FAMILY, seed=step, group_id=f"group-{step}", slot=0,
        guided=bool(served), goal="Reach the staircase down (>).",
        turns=(Turn(observation="You see a staircase.", prompt_token_ids=(5, 17), response_token_ids=(41,),
                    sampling_logprobs=(-0.5,), response_text="south", action="south", valid=True, reward=reward),),
        reward=reward, success=success, num_actions=1, invalid_actions=0, truncated=False,
        retrieved=tuple(ExperienceRef(experience_id=e, version=v, generation_id=g) for e, v, g in served),
        bank_offset=step if served else None, policy_version=step, timings=Timings(generation_s=0.1, env_s=0.0,
                                                                                    retrieval_s=0.0),
    )


T1 = trajectory("traj-s1", 1, (("exp-a", 1, "gen-1"),), success=True)
TRAJECTORIES = [
    T1,
    T1,  # archived twice (a producer retry): one event, counted once
    trajectory("traj-s2", 2, (("exp-a", 2, "gen-2"), ("exp-b", 1, "gen-1")), success=False),
    trajectory("traj-s3", 3, (("exp-a", 2, "gen-2"),), success=True),
    trajectory("traj-s4", 4, (("exp-m", 1, "gen-m"),), success=True),
    trajectory("traj-s5", 5, (), success=False),
]


@pytest.fixture
def run_dir(tmp_path):
    """An archive of OPS (offsets 0-11 of crl.experience-ops) and TRAJECTORIES, in 4-event segments."""
    archiver = Archiver(archive_root(tmp_path), flush_rows=4, flush_interval_s=3600)
    run_worker(archiver, [*OPS[:5], *TRAJECTORIES[:3], *OPS[5:], *TRAJECTORIES[3:]])
    return tmp_path


def test_history_has_every_applied_version_and_nothing_rejected_or_repeated(run_dir):
    with Audit(run_dir) as audit:
        columns, rows = audit.query("SELECT * FROM experience_history")
    assert columns == ["experience_id", "version", "text", "op_kind", "op_id", "op_offset", "generation_id",
                       "extractor_version", "source_trajectory_ids", "occurred_at"]
    assert rows == [
        ("exp-a", 1, "A1: walk toward '>'.", "ExperienceAdded", "gen-1:0", 0, "gen-1", 0, '["traj-1"]', at(0)),
        ("exp-b", 1, "B1: stairs are often in a corner.", "ExperienceAdded", "gen-1:1", 1, "gen-1", 0,
         '["traj-1"]', at(1)),
        ("exp-a", 2, "A2: walk diagonally toward '>'.", "ExperienceRefined", "gen-2:0", 2, "gen-2", 1,
         '["traj-gen-2"]', at(2)),
        ("exp-m", 1, "M1: find '>' and walk straight to it.", "ExperienceMerged", "merge-1:0", 6, "gen-m", 1, "[]",
         at(6)),
        ("exp-c", 1, "C1: kick doors open.", "ExperienceAdded", "gen-4:0", 8, "gen-4", 0, '["traj-4"]', at(8)),
        ("exp-m", 2, "M2: find '>' first, then walk straight to it.", "ExperienceRefined", "gen-5:0", 11, "gen-5", 1,
         '["traj-gen-5"]', at(11)),
    ]


def test_experiences_view_is_the_current_state_with_usage_counts(run_dir):
    with Audit(run_dir) as audit:
        columns, rows = audit.query("SELECT * FROM experiences")
    assert columns == ["experience_id", "task_family", "version", "status", "text", "merged_into", "parents",
                       "generation_id", "extractor_version", "retired_reason", "source_trajectory_ids", "retrievals",
                       "guided_successes", "guided_failures", "retired_op_id", "retired_offset"]
    assert rows == [
        ("exp-a", FAMILY, 2, "retired", "A2: walk diagonally toward '>'.", "exp-m", "[]", "gen-2", 1, "merged",
         '["traj-1","traj-gen-2"]', 3, 2, 1, "merge-1:0", 6),
        ("exp-b", FAMILY, 1, "retired", "B1: stairs are often in a corner.", "exp-m", "[]", "gen-1", 0, "merged",
         '["traj-1"]', 1, 0, 1, "merge-1:0", 6),
        ("exp-c", FAMILY, 1, "retired", "C1: kick doors open.", None, "[]", "gen-4", 0, "capacity", '["traj-4"]',
         0, 0, 0, "evict:exp-c", 9),
        ("exp-m", FAMILY, 2, "active", "M2: find '>' first, then walk straight to it.", None,
         '["exp-a","exp-b"]', "gen-5", 1, None, '["traj-gen-5"]', 1, 1, 0, None, None),
    ]


def test_experiences_agree_with_the_bank_replay(run_dir):
    log_id = archived_logs(run_dir)[0][0]
    state = replay(ops_from_archive(run_dir, log_id)).state
    assert (state.applied, state.rejected, state.duplicates) == (7, 3, 2)
    with Audit(run_dir) as audit:
        assert audit.op_log_id == log_id == MEMORY_LOG_ID
        _, rows = audit.query("SELECT experience_id, status, version, text, merged_into, retired_reason "
                              "FROM experiences")
        _, history = audit.query("SELECT experience_id, version, text, op_id FROM experience_history")
    assert rows == [(e.experience_id, e.status, e.version, e.text, e.merged_into, e.retired_reason)
                    for _, e in sorted(state.experiences.items())]
    assert sorted(history) == sorted((e.experience_id, v.version, v.text, v.op_id)
                                     for e in state.experiences.values() for v in e.history)


def test_lineage_has_one_edge_per_merged_source(run_dir):
    with Audit(run_dir) as audit:
        columns, rows = audit.query("SELECT * FROM experience_lineage")
    assert columns == ["source_id", "merged_id", "source_version", "op_id", "op_offset"]
    assert rows == [("exp-a", "exp-m", 2, "merge-1:0", 6), ("exp-b", "exp-m", 1, "merge-1:0", 6)]


def test_usage_has_one_row_per_trajectory_and_served_experience(run_dir):
    with Audit(run_dir) as audit:
        columns, rows = audit.query("SELECT * FROM experience_usage")
    assert columns == ["trajectory_id", "experience_id", "version", "generation_id", "bank_offset", "step", "env_id",
                       "task_family", "success", "reward", "num_actions", "policy_version", "occurred_at"]
    env = "MiniHack-Room-Random-5x5-v0"
    assert rows == [
        ("traj-s1", "exp-a", 1, "gen-1", 1, 1, env, FAMILY, True, 1.0, 1, 1, at(101)),
        ("traj-s2", "exp-a", 2, "gen-2", 2, 2, env, FAMILY, False, 0.0, 1, 2, at(102)),
        ("traj-s2", "exp-b", 1, "gen-1", 2, 2, env, FAMILY, False, 0.0, 1, 2, at(102)),
        ("traj-s3", "exp-a", 2, "gen-2", 3, 3, env, FAMILY, True, 1.0, 1, 3, at(103)),
        ("traj-s4", "exp-m", 1, "gen-m", 4, 4, env, FAMILY, True, 1.0, 1, 4, at(104)),
    ]


def test_views_replay_the_most_recently_written_op_log(run_dir):
    """A restarted embedded broker starts a new op log; the views follow the newest, like `crl replay bank`."""
    old = added(0, "old:0", "exp-old", "From a log before the restart.", "old", ("traj-old",))
    write_segments(archive_root(run_dir),
                   [archive_row(old, EXPERIENCE_OPS_TOPIC.name, 0, 0, 1_600_000_000_000, b"k", "old-log")])
    with Audit(run_dir) as audit:
        _, logs = audit.query("SELECT DISTINCT log_id FROM events WHERE topic = ? ORDER BY 1",
                              [EXPERIENCE_OPS_TOPIC.name])
        _, ids = audit.query("SELECT experience_id FROM experiences")
        assert audit.op_log_id == MEMORY_LOG_ID
    assert logs == [(MEMORY_LOG_ID,), ("old-log",)]
    assert ids == [("exp-a",), ("exp-b",), ("exp-c",), ("exp-m",)]


def test_empty_archive_has_empty_experience_views(tmp_path):
    with Audit(tmp_path) as audit:
        assert audit.op_log_id is None
        counts = [audit.query(f"SELECT count(*) FROM {view}")[1] for view in EXPERIENCE_VIEWS]
    assert counts == [[(0,)]] * len(EXPERIENCE_VIEWS)


def test_experience_views_are_read_only(run_dir):
    with Audit(run_dir) as audit:
        with pytest.raises(AuditQueryError, match="only SELECT / EXPLAIN"):
            audit.query("DELETE FROM replayed_bank.experiences")
        with pytest.raises(AuditQueryError, match="only SELECT / EXPLAIN"):
            audit.query("DROP VIEW experiences")
        assert audit.query("SELECT count(*) FROM experiences")[1] == [(4,)]


# -- crl audit experience ---------------------------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(app, ["audit", "experience", *args])


def test_cli_prints_the_history_merge_and_outcomes(run_dir):
    result = invoke(str(run_dir), "exp-a")
    assert result.exit_code == 0, result.output
    output = result.output
    assert "exp-a  family minihack-room  version 2  retired: merged into exp-m at version 2 by merge-1:0" in output
    assert "A1: walk toward '>'." in output
    assert "A2: walk diagonally toward '>'." in output
    assert "v2  ExperienceRefined gen-2:0 at offset 2  generation gen-2 (extractor 1)  sources traj-gen-2" in output
    assert "served 3 times: 2 succeeded, 1 failed (success rate 66.7%), mean reward 0.667" in output
    assert "v1 served 1 times, success rate 100.0%" in output
    assert "v2 served 2 times, success rate 50.0%" in output
    for trajectory_id in ("traj-s1", "traj-s2", "traj-s3"):
        assert trajectory_id in output
    for rejected in ("A-stale", "A-late", "B-dup"):
        assert rejected not in output


def test_cli_shows_merge_parents_and_retire_reason(run_dir):
    merged = invoke(str(run_dir), "exp-m")
    assert merged.exit_code == 0, merged.output
    assert "merged from exp-a v2, exp-b v1 by merge-1:0 at offset 6" in merged.output
    assert "M1: find '>' and walk straight to it." in merged.output
    assert "M2: find '>' first, then walk straight to it." in merged.output
    assert "served 1 times: 1 succeeded, 0 failed (success rate 100.0%)" in merged.output
    evicted = invoke(str(run_dir), "exp-c")
    assert evicted.exit_code == 0, evicted.output
    assert "retired: capacity, by evict:exp-c at offset 9" in evicted.output
    assert "never served" in evicted.output


def test_cli_rejects_an_unknown_id_and_a_missing_run_dir(run_dir, tmp_path):
    unknown = invoke(str(run_dir), "exp-zzz")
    assert unknown.exit_code == 1
    assert "no experience exp-zzz" in unknown.output
    missing = invoke(str(tmp_path / "nope"), "exp-a")
    assert missing.exit_code == 2
    assert "no run directory" in missing.output
