"""The scheduler through the harness: it announces the run, issues steps as versions and episodes come in, closes
the run once every episode is in, and a restarted scheduler publishes only what is missing."""

from __future__ import annotations

import pytest
from harness_setup import RUN, settings_for
from pydantic import ValidationError

from pipeline.actor.schedule import finished_id
from pipeline.runtime.harness import build_worker, run_worker
from schemas.base import Producer
from schemas.examples import example_events
from schemas.runs import RunFinished, RunResumed, RunStarted, StepSettled, StopRequested
from schemas.tasks import EpisodeAssigned
from schemas.training import PolicyPublished
from schemas.trajectories import TrajectoryCompleted
from workers.scheduler import Scheduler

WHO = Producer(worker="actor_trainer", instance="t-0")


def _actor(version: int) -> PolicyPublished:
    return PolicyPublished(run_id=RUN, producer=WHO, role="actor", version=version, step=version,
                           checkpoint_uri="file:///nowhere", sha256="0" * 64)


def _played(assignments: list[EpisodeAssigned]) -> list[TrajectoryCompleted]:
    template = next(e for e in example_events(RUN) if isinstance(e, TrajectoryCompleted))
    return [template.model_copy(update={
        "assignment_event_id": str(a.event_id), "trajectory_id": f"traj-{a.event_id}", "step": a.step,
        "group_id": a.group_id, "slot": a.slot, "split": a.split, "guided": False, "retrieved": ()})
        for a in assignments]


def test_the_scheduler_issues_steps_as_versions_come_and_closes_the_run(tmp_path):
    settings = settings_for(tmp_path, scheduler={"arm": "grpo", "steps": 2, "eval_every": 0, "max_steps_ahead": 0})
    worker, context = build_worker(Scheduler, settings)
    first = run_worker(worker, [_actor(0)], context=context)
    assert isinstance(first.outputs[0], RunStarted) and first.outputs[0].config["scheduler"]["steps"] == 2
    step0 = [e for e in first.outputs if isinstance(e, EpisodeAssigned)]
    assert [(a.step, a.slot) for a in step0] == [(0, 0), (0, 1)]  # step 1 waits for actor v1 and step 0's episodes
    assert not worker.done

    # A restarted scheduler: what it published is on the log; the episodes of step 0 and version 1 come in.
    worker, context = build_worker(Scheduler, settings, log=first.outputs)
    second = run_worker(worker, [_actor(0), *_played(step0), _actor(1)], context=context)
    step1 = [e for e in second.outputs if isinstance(e, EpisodeAssigned)]
    assert [(a.step, a.slot) for a in step1] == [(1, 0), (1, 1)]
    assert not any(isinstance(e, RunStarted) for e in second.outputs)  # published before the restart
    assert not worker.done

    worker, context = build_worker(Scheduler, settings, log=[*first.outputs, *second.outputs])
    third = run_worker(worker, [_actor(0), _actor(1), *_played(step0), *_played(step1)], context=context)
    finished = [e for e in third.outputs if isinstance(e, RunFinished)]
    assert [(e.status, e.steps_completed) for e in finished] == [("completed", 2)]
    assert worker.done and third.runner.stop_reason == "finished"


def test_a_resumed_run_ignores_the_stop_before_its_resume_and_closes_under_a_new_id(tmp_path):
    settings = settings_for(tmp_path, scheduler={"arm": "grpo", "steps": 1, "eval_every": 0, "max_steps_ahead": 0})
    worker, context = build_worker(Scheduler, settings)
    first = run_worker(worker, [_actor(0)], context=context)
    step0 = [e for e in first.outputs if isinstance(e, EpisodeAssigned)]
    stop = StopRequested(run_id=RUN, producer=WHO, reason="interrupted (Ctrl-C)")
    worker, context = build_worker(Scheduler, settings, log=first.outputs)
    stopped = run_worker(worker, [_actor(0), stop], context=context)
    [ended] = [e for e in stopped.outputs if isinstance(e, RunFinished)]
    assert ended.status == "stopped" and ended.event_id == finished_id(RUN, 0)

    # `crl run --resume`: RunResumed follows the stop on crl.control; the stop no longer ends the run.
    resumed = RunResumed(run_id=RUN, producer=WHO, attempt=1, previous_status="stopped")
    log = [*first.outputs, *stopped.outputs, resumed]
    worker, context = build_worker(Scheduler, settings, log=log)
    again = run_worker(worker, [_actor(0), stop, resumed, *_played(step0)], context=context)
    [ended] = [e for e in again.outputs if isinstance(e, RunFinished)]
    assert (ended.status, ended.steps_completed, ended.event_id) == ("completed", 1, finished_id(RUN, 1))
    assert not any(isinstance(e, EpisodeAssigned) for e in again.outputs)  # step 0 was issued before the stop


def _extractor(version: int) -> PolicyPublished:
    return _actor(version).model_copy(update={"role": "extractor"})


def test_deterministic_mode_issues_a_step_once_the_one_before_settled_and_serves_it_at_the_settled_offset(tmp_path):
    settings = settings_for(tmp_path, scheduler={
        "arm": "complementary", "steps": 2, "eval_every": 0, "merge_every": 1, "max_steps_ahead": 0,
        "deterministic": True}, actor_trainer={"warmup_steps": 1})
    worker, context = build_worker(Scheduler, settings)
    first = run_worker(worker, [_actor(0), _extractor(0)], context=context)
    step0 = [e for e in first.outputs if isinstance(e, EpisodeAssigned)]
    assert {(a.step, a.bank_position) for a in step0} == {(0, None)}  # step 0: the empty bank

    # Step 0's episodes are in: the merge due after it is requested, but step 1 waits for the extractor.
    worker, context = build_worker(Scheduler, settings, log=first.outputs)
    second = run_worker(worker, [_actor(0), _extractor(0), *_played(step0)], context=context)
    assert [(e.kind, e.step) for e in second.outputs] == [("MergeRequested", 0)]

    settled = StepSettled(run_id=RUN, producer=WHO, role="extractor", step=0, extractor_version=0, bank_offset=17)
    trainer = settled.model_copy(update={"role": "extractor_trainer", "bank_offset": None})
    worker, context = build_worker(Scheduler, settings, log=[*first.outputs, *second.outputs])
    third = run_worker(worker, [_actor(0), _extractor(0), *_played(step0), trainer], context=context)
    assert not any(isinstance(e, EpisodeAssigned) for e in third.outputs), "the trainer's settlement is not enough"
    worker, context = build_worker(Scheduler, settings, log=[*first.outputs, *second.outputs])
    fourth = run_worker(worker, [_actor(0), _extractor(0), *_played(step0), trainer, settled], context=context)
    step1 = [e for e in fourth.outputs if isinstance(e, EpisodeAssigned)]
    assert [(a.step, a.slot, a.guided, a.bank_position) for a in step1] == [(1, 0, True, 17), (1, 1, False, 17)]


def test_deterministic_mode_refuses_settings_that_let_steps_overlap(tmp_path):
    with pytest.raises(ValidationError) as failure:
        settings_for(tmp_path, scheduler={"deterministic": True, "staleness": 1, "max_steps_ahead": 1},
                     launch={"extractor_workers": 2})
    message = str(failure.value)
    for wrong in ("scheduler.staleness is 1, needs 0", "scheduler.max_steps_ahead is 1, needs 0",
                  "launch.extractor_workers is 2, needs 1"):
        assert wrong in message


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_step_0_evaluation_is_played_before_any_train_episode_is_issued(tmp_path, deterministic):
    """The baseline: step 0's evaluation is issued first, and step 0's train groups only once it finished, so no
    actor version but 0 exists and nothing is distilled while it plays, in every mode."""
    settings = settings_for(tmp_path, scheduler={"arm": "complementary", "steps": 2, "eval_every": 1,
                                                 "max_steps_ahead": 0 if deterministic else 1,
                                                 "deterministic": deterministic},
                            actor_trainer={"warmup_steps": 1})
    worker, context = build_worker(Scheduler, settings)
    first = run_worker(worker, [_actor(0), _extractor(0)], context=context)
    issued = [e for e in first.outputs if isinstance(e, EpisodeAssigned)]
    assert issued and {(a.step, a.split, a.policy_version) for a in issued} == {(0, "eval", 0)}
    assert sum(a.guided for a in issued) == len(issued) // 2  # guided slots: served from the empty bank

    worker, context = build_worker(Scheduler, settings, log=first.outputs)
    second = run_worker(worker, [_actor(0), _extractor(0), *_played(issued[:-1])], context=context)
    assert not any(isinstance(e, EpisodeAssigned) for e in second.outputs), "one evaluation episode is still out"

    worker, context = build_worker(Scheduler, settings, log=first.outputs)
    third = run_worker(worker, [_actor(0), _extractor(0), *_played(issued)], context=context)
    later = [e for e in third.outputs if isinstance(e, EpisodeAssigned)]
    assert (0, "train") in {(a.step, a.split) for a in later}
    assert not any(a.step == 0 and a.split == "eval" for a in later), "the evaluation is not issued twice"
