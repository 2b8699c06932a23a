"""`crl replay train` on an archive written here (no broker): a real actor step on the tiny preset replays to the same
weight hash, and a tampered record makes it exit 1 naming the step."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.audit.archive import archive_root, archive_row, write_segments
from pipeline.audit.training_replay import replay_training
from pipeline.cli import app
from pipeline.models.settings import ModelSettings, TinyModelSettings
from pipeline.rl.settings import ActorTrainerSettings
from schemas.base import Event
from schemas.topics import topic_of

TINY = TinyModelSettings(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         vocab_size=512, corpus_episodes=4)
SETTINGS = ActorTrainerSettings(model=ModelSettings(tiny=TINY), lr=1e-3, threads=1, group_size=4, groups_per_step=2,
                                micro_batch_size=5)


def _archive(run_dir: Path, events: list[Event]) -> None:
    rows = [archive_row(event, topic_of(event).name, 0, offset, 0, b"k", log_id="log-1")
            for offset, event in enumerate(events)]
    write_segments(archive_root(run_dir), rows)


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory, record_actor_run) -> tuple[Path, list[Event]]:
    run_dir = tmp_path_factory.mktemp("run")
    return run_dir, record_actor_run(run_dir, SETTINGS)


def test_replay_reproduces_every_recorded_step(recorded_run):
    run_dir, events = recorded_run
    _archive(run_dir, events)
    report = replay_training(run_dir, "actor")
    assert report.ok, report.problem
    assert [(c.step, c.version, c.ok) for c in report.checks] == [(1, 1, True), (2, 2, True)]
    result = CliRunner().invoke(app, ["replay", "train", str(run_dir), "--role", "actor"])
    assert result.exit_code == 0, result.output
    assert "actor: 2 steps replayed, every weight hash matches" in result.output


def test_a_tampered_step_fails_naming_it(recorded_run, tmp_path):
    run_dir, events = recorded_run
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "checkpoints").symlink_to(run_dir / "checkpoints")
    tampered = []
    for event in events:
        if event.kind == "TrainStepCompleted" and event.policy_version == 2:
            event = event.model_copy(update={"weight_hash_after": "f" * 64})
        tampered.append(event)
    _archive(copy, tampered)
    report = replay_training(copy, "actor")
    assert not report.ok and [c.ok for c in report.checks] == [True, False]
    assert report.problem.startswith("step 2 (version 2): weight hash after the step")
    result = CliRunner().invoke(app, ["replay", "train", str(copy), "--role", "actor"])
    assert result.exit_code == 1
    assert "step 2 (version 2)" in result.output


def test_changed_advantages_are_caught_before_the_update(recorded_run, tmp_path):
    _run_dir, events = recorded_run
    copy = tmp_path / "copy"
    copy.mkdir()
    changed = []
    for event in events:
        if event.kind == "TrainStepCompleted" and event.policy_version == 1:
            event = event.model_copy(update={"advantages": tuple(a + 1.0 for a in event.advantages)})
        changed.append(event)
    _archive(copy, changed)
    report = replay_training(copy, "actor")
    assert report.problem is not None and report.problem.startswith("step 1 (version 1): recomputed advantages")


def test_a_step_of_more_ranks_than_the_replay_may_start_is_reported_as_not_replayable(recorded_run, tmp_path):
    """Version 2 recorded as taken by two data-parallel ranks; with --max-ranks 1 the replay says it cannot reproduce
    it (exit 2), after checking version 1, and reports no mismatch."""
    _run_dir, events = recorded_run
    copy = tmp_path / "copy"
    copy.mkdir()
    _archive(copy, [e.model_copy(update={"world_size": 2}) if e.kind == "TrainStepCompleted"
                    and e.policy_version == 2 else e for e in events])
    report = replay_training(copy, "actor", max_ranks=1)
    assert [(c.version, c.ok, c.world_size) for c in report.checks] == [(1, True, 1)]
    assert report.unavailable == report.problem == (
        "step 2 (version 2) was taken by 2 data-parallel ranks; this replay may start at most 1 (--max-ranks), so it "
        "cannot reproduce the step's summation order")
    result = CliRunner().invoke(app, ["replay", "train", str(copy), "--role", "actor", "--max-ranks", "1"])
    assert result.exit_code == 2, result.output
    assert "cannot replay here after 1 matching steps" in result.output
    assert "weight hash after" not in result.output


def test_a_run_of_the_actor_on_the_cispo_loss_records_it_and_replays_it(tmp_path, record_actor_run):
    """The loss is a setting: the step runs it, `TrainStepCompleted` records it, and the replay runs the recorded one
    (replayed with the actor's default, GRPO, the weights would differ at step 1). Off-policy: every token's
    importance ratio exp(-0.5) lies below both losses' clip ranges, where GRPO's clipped tokens pass no gradient and
    CISPO's clipped weights still do; on-policy the two are the same update up to rounding."""
    events = record_actor_run(tmp_path, SETTINGS.model_copy(update={"loss": "cispo"}), behaviour_shift=0.5)
    assert {e.loss_variant for e in events if e.kind == "TrainStepCompleted"} == {"cispo"}
    _archive(tmp_path, events)
    report = replay_training(tmp_path, "actor")
    assert report.ok, report.problem
    assert [c.step for c in report.checks] == [1, 2]
    relabelled = tmp_path / "relabelled"
    relabelled.mkdir()
    (relabelled / "checkpoints").symlink_to(tmp_path / "checkpoints")
    _archive(relabelled, [e.model_copy(update={"loss_variant": "grpo"}) if e.kind == "TrainStepCompleted" else e
                          for e in events])
    report = replay_training(relabelled, "actor")
    assert report.problem is not None and report.problem.startswith("step 1 (version 1): weight hash after the step")
