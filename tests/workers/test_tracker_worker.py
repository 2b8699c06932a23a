"""The tracker through the harness, built as `crl worker tracker` builds it: a run's events in, TensorBoard event files
out that hold what the fold computes from them; a restarted tracker folds from the start again and writes nothing
twice; a record it cannot decode is dead-lettered and tracking goes on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from harness_setup import RUN, settings_for

from pipeline.actor.schedule import trajectory_event_id
from pipeline.runtime.harness import RawRecord, build_worker, run_worker
from pipeline.settings import Settings
from pipeline.tracking.fold import as_table, fold
from pipeline.tracking.readback import tensorboard_entries
from schemas.base import Event, Producer
from schemas.examples import example_events
from schemas.runs import RunStarted
from schemas.topics import TRAJECTORIES
from schemas.trajectories import TrajectoryCompleted
from workers.tracker import Tracker

WHO = Producer(worker="scheduler", instance="scheduler-0")
T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def _settings(tmp_path) -> Settings:
    # Warm-up 1: step 0 only fills the bank, so its episodes are free and need no lessons.
    return settings_for(tmp_path, actor_trainer={"warmup_steps": 1, "group_size": 4})


def _step_zero(settings: Settings) -> list[Event]:
    """RunStarted with the run's config, then step 0's four scheduled episodes (their real ids), two of them won."""
    example = next(e for e in example_events(RUN) if isinstance(e, TrajectoryCompleted))
    started = RunStarted(run_id=RUN, producer=WHO, config=settings.run_config(), code_version="test", occurred_at=T0)
    episodes = [example.model_copy(update={
        "event_id": trajectory_event_id(str(a.event_id)), "assignment_event_id": str(a.event_id),
        "trajectory_id": f"{a.group_id}-k{a.slot}", "step": 0, "group_id": a.group_id, "slot": a.slot,
        "guided": False, "retrieved": (), "bank_offset": None, "success": a.slot % 2 == 0,
        "reward": float(a.slot % 2 == 0), "occurred_at": T0 + timedelta(seconds=1 + a.slot)})
        for a in settings.schedule().train_assignments(RUN, WHO, 0)]
    return [started, *episodes]


def test_the_tracker_writes_what_the_fold_computes_and_a_restart_writes_nothing_twice(tmp_path):
    settings = _settings(tmp_path)
    events = _step_zero(settings)
    worker, context = build_worker(Tracker, settings)
    result = run_worker(worker, events, context=context, run_id=RUN)
    assert result.outputs == [] and result.dead_letters == []  # it publishes nothing
    written = tensorboard_entries(tmp_path / "tensorboard")
    # crl.runs and crl.trajectories each from offset 0: the same (event, offset) pairs the fold of `crl track` reads
    expected = as_table(fold([(events[0], 0), *((e, i) for i, e in enumerate(events[1:]))], RUN))
    assert expected, "step 0's episodes make entries"
    assert set(written) == set(expected)
    assert all(written[k] == pytest.approx(v) if isinstance(v, float) else written[k] == v for k, v in expected.items())
    assert any(k.endswith("/success\t0") and v == pytest.approx(0.5) for k, v in written.items()), sorted(written)

    again, context = build_worker(Tracker, settings)  # a restart: the whole run read again from offset 0
    run_worker(again, events, context=context, run_id=RUN)
    assert again.tracker.written == 0
    assert tensorboard_entries(tmp_path / "tensorboard") == written


def test_a_record_the_tracker_cannot_decode_is_dead_lettered_and_tracking_goes_on(tmp_path):
    settings = _settings(tmp_path)
    events = _step_zero(settings)
    worker, context = build_worker(Tracker, settings)
    result = run_worker(worker, [events[0], RawRecord(TRAJECTORIES.name, b"{not json"), *events[1:]],
                        context=context, run_id=RUN)
    assert [letter.error_class for letter in result.dead_letters] == ["MalformedPayloadError"]
    assert any(k.endswith("/success\t0") for k in tensorboard_entries(tmp_path / "tensorboard"))


def test_crl_run_starts_the_tracker_unless_the_settings_turn_it_off(tmp_path):
    assert Tracker.enabled(_settings(tmp_path))
    assert not Tracker.enabled(settings_for(tmp_path, tracker={"enabled": False}))
