"""A trainer's versions after the log is restored from the archive (`pipeline.run.restore.drop_checkpoints_past`): what
`crl run --resume` does for a Tansu run whose broker died between the actor trainer's checkpoint of a step and the
archiving of that step's episodes.

What went wrong before (tests/e2e/test_scenario.py failed once on Tansu with `crl replay train`'s "recomputed
advantages [...] differ from the recorded [...]" at the first step after the resume): the trainer resumed from the
checkpoint of a step whose episodes were gone with the broker and published that checkpoint's `TrainStepCompleted`,
while the rollout workers played the lost episodes again under the same event ids, with other outcomes. The archive
then named, under the step's batch ids, plays the step never trained on.

No broker here: the run is recorded with a real tiny actor (`record_actor_run`), archived as the archiver would have
left it, and the resumed trainer is a `PolicyTrainer` opened on the same checkpoints."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import insert, select

from infra.db import consumer_offsets
from pipeline.audit.archive import archive_root, archive_row, write_segments
from pipeline.audit.training_replay import replay_training
from pipeline.errors import RunFailedError
from pipeline.models.settings import ModelSettings, TinyModelSettings
from pipeline.rl.settings import ActorTrainerSettings
from pipeline.rl.trainer import PolicyTrainer, actor_batch, events_of
from pipeline.rl.versions import checkpoints_root, versions_in
from pipeline.run.restore import drop_checkpoints_past
from pipeline.runtime.offsets import LogPosition, TopicPartition
from schemas.base import Event, Producer
from schemas.topics import TRAJECTORIES, topic_of
from schemas.training import TrainStepCompleted
from schemas.trajectories import TrajectoryCompleted
from workers.actor_trainer import ClosedStep, actor_update

TINY = TinyModelSettings(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         vocab_size=512, corpus_episodes=4)
SETTINGS = ActorTrainerSettings(model=ModelSettings(tiny=TINY), lr=1e-3, threads=1, group_size=4, groups_per_step=2,
                                micro_batch_size=5)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, record_actor_run) -> tuple[Path, list[Event]]:
    """Versions 0, 1 and 2 of a two-step actor run and its events in log order."""
    run_dir = tmp_path_factory.mktemp("recorded")
    return run_dir, record_actor_run(run_dir, SETTINGS)


@pytest.fixture
def run_dir(recorded, tmp_path) -> Path:  # type: ignore[no-untyped-def]
    """A copy of the recorded run's checkpoints (the tests remove some)."""
    source, _ = recorded
    run_dir = tmp_path / "run"
    shutil.copytree(source / "checkpoints", run_dir / "checkpoints")
    return run_dir


@pytest.fixture
def engine(run_dir, sqlite_in):  # type: ignore[no-untyped-def]
    return sqlite_in(run_dir)


class Log:
    """Archives events as the archiver does, one partition per topic, each at the next offset of its topic."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.ends: dict[TopicPartition, LogPosition] = {}

    def archive(self, events: list[Event]) -> None:
        rows = []
        for event in events:
            topic = topic_of(event).name
            end = self.ends.get((topic, 0), LogPosition(0, f"log-{topic}"))
            rows.append(archive_row(event, topic, 0, end.next_offset, 0, b"k", log_id=end.log_id))
            self.ends[(topic, 0)] = LogPosition(end.next_offset + 1, end.log_id)
        write_segments(archive_root(self.run_dir), rows)


def _step_of(events: list[Event], step: int) -> tuple[list[TrajectoryCompleted], list[Event]]:
    """The trajectories of `step` and the events of the version it produced."""
    trajectories = [e for e in events if isinstance(e, TrajectoryCompleted) and e.step == step]
    announced = [e for e in events if getattr(e, "version", getattr(e, "policy_version", None)) == step
                 and e.kind in ("PolicyPublished", "TrainStepCompleted")]
    return trajectories, announced


def _played_again(trajectories: list[TrajectoryCompleted]) -> list[TrajectoryCompleted]:
    """The same assignments played once more, under the same event ids, with the other outcome."""
    return [t.model_copy(update={"reward": 1.0 - t.reward, "success": not t.success, "truncated": t.success})
            for t in trajectories]


def _resumed_trainer(run_dir: Path) -> PolicyTrainer:
    return PolicyTrainer("actor", SETTINGS, checkpoints_root(run_dir, "actor"), "run",
                         Producer(worker="actor_trainer", instance="t"))


def _broker_died_during_step_2(recorded, run_dir: Path) -> tuple[Log, list[TrajectoryCompleted]]:
    """The archive ends after version 1: step 2's episodes and version 2's events went with the broker, version 2's
    checkpoint is on disk. Returns the log and the episodes of step 2 as the resumed run plays them again."""
    _, events = recorded
    lost_trajectories, lost_announcements = _step_of(events, 2)
    lost = {e.event_id for e in [*lost_trajectories, *lost_announcements]}
    log = Log(run_dir)
    log.archive([e for e in events if e.event_id not in lost])
    played_again = _played_again(lost_trajectories)
    recorded_step = next(e for e in lost_announcements if isinstance(e, TrainStepCompleted))
    assert tuple(actor_batch(played_again, SETTINGS)[1].tolist()) != recorded_step.advantages, \
        "the plays again should change the step's advantages"
    return log, played_again


def test_a_checkpoint_kept_over_a_restored_log_publishes_a_step_the_replay_cannot_reproduce(recorded, run_dir):
    """What happened before the fix: the trainer resumes at version 2 and publishes its recorded step, the archive
    holds the plays again under the batch's ids, and the replay fails at that step as CI's did."""
    log, played_again = _broker_died_during_step_2(recorded, run_dir)
    trainer = _resumed_trainer(run_dir)
    assert trainer.current.version == 2
    log.archive([*played_again, *events_of(trainer.current)])
    report = replay_training(run_dir, "actor")
    assert [(c.version, c.ok) for c in report.checks] == [(1, True)]
    assert report.problem is not None and report.problem.startswith(
        "step 2 (version 2): 8 archived batch trajectories are not the plays the step trained on, e.g. ")


def test_a_version_trained_on_episodes_the_restored_log_lost_is_trained_again_and_replays(recorded, run_dir, engine):
    log, played_again = _broker_died_during_step_2(recorded, run_dir)
    with engine.begin() as connection:  # the actor trainer's positions, committed after version 1
        connection.execute(insert(consumer_offsets), [{
            "worker": "actor_trainer", "topic": TRAJECTORIES.name, "partition": 0, "next_offset": 8,
            "log_id": f"log-{TRAJECTORIES.name}", "updated_at": datetime.now(UTC)}])

    assert drop_checkpoints_past(run_dir, engine, log.ends) == {"actor": [2]}

    assert versions_in(checkpoints_root(run_dir, "actor")) == [0, 1]
    with engine.connect() as connection:  # it reads its input from offset 0 again
        assert connection.execute(select(consumer_offsets.c.worker)).all() == []
    trainer = _resumed_trainer(run_dir)
    assert trainer.current.version == 1
    # version 1's events are on the restored log; step 2 trains on the plays the log now holds
    step = actor_update(trainer, SETTINGS, ClosedStep(2, played_again, [], False, 0))
    log.archive([*played_again, *events_of(trainer.save(step))])
    report = replay_training(run_dir, "actor")
    assert report.ok, report.problem
    assert [(c.version, c.ok) for c in report.checks] == [(1, True), (2, True)]


def test_versions_whose_inputs_were_all_archived_stay(recorded, run_dir, engine):
    """The broker died after step 2's episodes were archived but before version 2 was published: the trainer keeps
    version 2 and publishes it on restart (the archive holds exactly what it trained on)."""
    _, events = recorded
    _, announcements = _step_of(events, 2)
    log = Log(run_dir)
    log.archive([e for e in events if e.event_id not in {a.event_id for a in announcements}])
    assert drop_checkpoints_past(run_dir, engine, log.ends) == {}
    assert versions_in(checkpoints_root(run_dir, "actor")) == [0, 1, 2]
    trainer = _resumed_trainer(run_dir)
    log.archive(list(events_of(trainer.current)))
    assert replay_training(run_dir, "actor").ok


def test_inputs_archived_from_an_earlier_log_of_the_topic_count_as_kept(recorded, run_dir, engine):
    """Episodes of a log the topic had before (archived, then the topic re-created) are still on record: the archive,
    which the replay reads, has them; only the restored log's tail past the archiver's position is lost."""
    _, events = recorded
    trajectories, _ = _step_of(events, 2)
    log = Log(run_dir)
    write_segments(archive_root(run_dir), [archive_row(t, TRAJECTORIES.name, 0, offset, 0, b"k", log_id="old-log")
                                           for offset, t in enumerate(trajectories)])
    log.archive([e for e in events if e.event_id not in {t.event_id for t in trajectories}])
    assert drop_checkpoints_past(run_dir, engine, log.ends) == {}
    assert versions_in(checkpoints_root(run_dir, "actor")) == [0, 1, 2]
    assert replay_training(run_dir, "actor").ok


def test_a_version_announced_on_the_restored_log_whose_inputs_are_gone_fails_the_restore(recorded, run_dir, engine):
    _, events = recorded
    lost, _ = _step_of(events, 2)
    log = Log(run_dir)
    log.archive([e for e in events if e.event_id not in {t.event_id for t in lost}])
    with pytest.raises(RunFailedError, match=r"actor version 2 is on the restored log, but version 2 was trained on "
                                             r"crl.trajectories records the archive does not have"):
        drop_checkpoints_past(run_dir, engine, log.ends)
    assert versions_in(checkpoints_root(run_dir, "actor")) == [0, 1, 2]


def test_unpublished_versions_after_the_first_lost_one_go_with_it(recorded, run_dir, engine):
    """Step 1's episodes lost: versions 1 and 2 (trained from version 1) are both removed."""
    _, events = recorded
    lost = {e.event_id for step in (1, 2) for group in _step_of(events, step) for e in group}
    log = Log(run_dir)
    log.archive([e for e in events if e.event_id not in lost])
    assert drop_checkpoints_past(run_dir, engine, log.ends) == {"actor": [1, 2]}
    trainer = _resumed_trainer(run_dir)
    assert trainer.current.version == 0
