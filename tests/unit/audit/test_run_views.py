"""The run views `trajectories`, `train_steps` and `policy_versions`, over an archive the real Archiver wrote."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

import pytest
from typer.testing import CliRunner

from pipeline.audit.archive import archive_root
from pipeline.audit.views import RUN_VIEWS, Audit
from pipeline.cli import app
from pipeline.runtime.harness import run_worker
from schemas.base import Producer
from schemas.training import PolicyPublished, TrainStepCompleted
from schemas.trajectories import ExperienceRef, Timings, TrajectoryCompleted, Turn
from workers.archiver import Archiver

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
ENV = "MiniHack-Room-Random-5x5-v0"
FAMILY = "minihack-room"


def at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def common(seconds: int, worker: str) -> dict:
    return {"run_id": "views-run", "producer": Producer(worker=worker, instance=f"{worker}-0"),
            "occurred_at": at(seconds)}


def turn(response: tuple[int, ...], valid: bool = True) -> Turn:
    return Turn(observation="You see a staircase.", prompt_token_ids=(5, 17, 300), response_token_ids=response,
                sampling_logprobs=tuple(-0.5 for _ in response), response_text="south", action="south", valid=valid,
                reward=0.0)


GUIDED = TrajectoryCompleted(
    **common(10, "rollout"), trajectory_id="traj-guided", assignment_event_id="assign-1", step=0, split="train",
    env_id=ENV, task_family=FAMILY, seed=7, group_id="s0-g0", slot=1, guided=True, goal="Reach the stairs.",
    turns=(turn((41, 9)), turn((44,))), reward=1.0, success=True, num_actions=2, invalid_actions=0, truncated=False,
    retrieved=(ExperienceRef(experience_id="exp-a", version=2, generation_id="gen-2"),
               ExperienceRef(experience_id="exp-b", version=1, generation_id="gen-1")),
    bank_offset=5, policy_version=0, timings=Timings(generation_s=0.25, env_s=0.5, retrieval_s=0.125),
)
FREE = TrajectoryCompleted(
    **common(20, "rollout"), trajectory_id="traj-free", assignment_event_id="assign-2", step=1, split="eval",
    env_id=ENV, task_family=FAMILY, seed=8, group_id="eval-s1", slot=3, guided=False, goal="Reach the stairs.",
    turns=(turn((), valid=False),), reward=0.0, success=False, num_actions=1, invalid_actions=1, truncated=True,
    policy_version=1, timings=Timings(generation_s=1.5, env_s=0.0, retrieval_s=0.0),
)
ACTOR_STEP = TrainStepCompleted(
    **common(30, "actor-trainer"), role="actor", step=0, policy_version=1, batch_event_ids=("e1", "e2", "e3"),
    dropped_event_ids=("e4",), timed_out=True, weight_hash_before=sha("a0"), weight_hash_after=sha("a1"), loss=-0.5,
    tokens=40, loss_variant="grpo", aggregation="token-mean",
    metrics={"train/clip_fraction": 0.25, "rollout/reward_mean": 0.5, "rollout/success_guided": 0.75,
             "rollout/success_free": 0.25},
)
EXTRACTOR_STEP = TrainStepCompleted(
    **common(31, "extractor-trainer"), role="extractor", step=0, policy_version=1, batch_event_ids=("g1", "g2"),
    weight_hash_before=sha("x0"), weight_hash_after=sha("x1"), loss=0.125, tokens=12, loss_variant="cispo",
    aggregation="seq-mean-token-mean", metrics={"train/clip_fraction": 0.125, "extractor/reward_mean": 0.375},
)


def published(seconds: int, role: str, version: int) -> PolicyPublished:
    return PolicyPublished(**common(seconds, f"{role}-trainer"), role=role, version=version, step=version,
                           checkpoint_uri=f"file:///runs/r/checkpoints/{role}/{version}",
                           sha256=sha(f"{role}-{version}"))


EVENTS = [
    published(0, "actor", 0), published(1, "extractor", 0), GUIDED, GUIDED,  # archived twice: one row
    FREE, ACTOR_STEP, EXTRACTOR_STEP, published(32, "actor", 1), published(33, "extractor", 1),
]


@pytest.fixture
def run_dir(tmp_path):
    run_worker(Archiver(archive_root(tmp_path), flush_rows=3, flush_interval_s=3600), EVENTS)
    return tmp_path


def test_trajectories_has_one_row_per_episode_with_counts_and_timings(run_dir):
    with Audit(run_dir) as audit:
        columns, rows = audit.query("SELECT * FROM trajectories")
    assert columns == [
        "trajectory_id", "step", "split", "env_id", "task_family", "seed", "group_id", "slot", "guided", "success",
        "reward", "num_actions", "invalid_actions", "truncated", "turns", "response_tokens", "policy_version",
        "bank_offset", "served", "generation_s", "env_s", "retrieval_s", "score", "env_error", "occurred_at",
    ]
    assert rows == [
        ("traj-guided", 0, "train", ENV, FAMILY, 7, "s0-g0", 1, True, True, 1.0, 2, 0, False, 2, 3, 0, 5,
         '["exp-a","exp-b"]', 0.25, 0.5, 0.125, None, None, at(10)),
        ("traj-free", 1, "eval", ENV, FAMILY, 8, "eval-s1", 3, False, False, 0.0, 1, 1, True, 1, 0, 1, None, "[]",
         1.5, 0.0, 0.0, None, None, at(20)),
    ]


def test_family_success_counts_each_family_split_and_slot_kind(run_dir):
    with Audit(run_dir) as audit:
        columns, rows = audit.query("SELECT * FROM family_success")
    assert columns == ["step", "split", "task_family", "guided", "episodes", "successes", "success_rate",
                       "mean_score", "engine_failures"]
    assert rows == [(0, "train", FAMILY, True, 1, 1, 1.0, None, 0), (1, "eval", FAMILY, False, 1, 0, 0.0, None, 0)]


def test_train_steps_has_batch_sizes_and_named_metrics(run_dir):
    with Audit(run_dir) as audit:
        columns, rows = audit.query("SELECT * FROM train_steps")
    assert columns == [
        "role", "step", "policy_version", "loss", "tokens", "batch_size", "dropped", "timed_out", "loss_variant",
        "aggregation", "weight_hash_before", "weight_hash_after", "clip_fraction", "reward_mean", "success_guided",
        "success_free", "metrics", "occurred_at",
    ]
    assert rows == [
        ("actor", 0, 1, -0.5, 40, 3, 1, True, "grpo", "token-mean", sha("a0"), sha("a1"), 0.25, 0.5, 0.75, 0.25,
         '{"train/clip_fraction":0.25,"rollout/reward_mean":0.5,"rollout/success_guided":0.75,'
         '"rollout/success_free":0.25}', at(30)),
        ("extractor", 0, 1, 0.125, 12, 2, 0, False, "cispo", "seq-mean-token-mean", sha("x0"), sha("x1"), 0.125,
         0.375, None, None, '{"train/clip_fraction":0.125,"extractor/reward_mean":0.375}', at(31)),
    ]


def test_policy_versions_join_the_step_that_produced_them(run_dir):
    with Audit(run_dir) as audit:
        columns, rows = audit.query("SELECT * FROM policy_versions")
    assert columns == ["role", "version", "step", "checkpoint_uri", "sha256", "published_at", "loss",
                       "weight_hash_after"]
    assert rows == [
        ("actor", 0, 0, "file:///runs/r/checkpoints/actor/0", sha("actor-0"), at(0), None, None),
        ("actor", 1, 1, "file:///runs/r/checkpoints/actor/1", sha("actor-1"), at(32), -0.5, sha("a1")),
        ("extractor", 0, 0, "file:///runs/r/checkpoints/extractor/0", sha("extractor-0"), at(1), None, None),
        ("extractor", 1, 1, "file:///runs/r/checkpoints/extractor/1", sha("extractor-1"), at(33), 0.125, sha("x1")),
    ]


def test_run_views_of_an_empty_archive_are_empty(tmp_path):
    with Audit(tmp_path) as audit:
        counts = [audit.query(f"SELECT count(*) FROM {view}")[1] for view in RUN_VIEWS]
    assert counts == [[(0,)]] * len(RUN_VIEWS)


def test_run_views_do_not_replay_the_bank(run_dir):
    with Audit(run_dir) as audit:
        for view in RUN_VIEWS:
            audit.query(f"SELECT count(*) FROM {view}")
        assert not audit._experience_views_ready


def test_audit_sql_errors_are_one_line_that_says_where_the_views_are_listed(run_dir):
    result = CliRunner().invoke(app, ["audit", "sql", str(run_dir), "SELECT * FROM no_such_view"])
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "no_such_view" in result.output and "SHOW TABLES lists the views" in result.output
    listed = CliRunner().invoke(app, ["audit", "sql", str(run_dir), "SHOW TABLES", "--format", "csv"])
    for view in RUN_VIEWS:
        assert view in listed.output.splitlines()
    ok = CliRunner().invoke(app, ["audit", "sql", str(run_dir), "SELECT role, version, loss FROM policy_versions",
                                  "--format", "csv"])
    assert ok.exit_code == 0, ok.output
    assert ok.output.splitlines() == ["role,version,loss", "actor,0,", "actor,1,-0.5", "extractor,0,",
                                      "extractor,1,0.125"]
