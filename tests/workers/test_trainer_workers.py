"""Both trainers through the harness: version 0 published at start, one GRPO step on a complete step's groups, one
CISPO step once enough generations are credited; each step's batch and hashes recorded."""

from __future__ import annotations

import pytest
from harness_setup import RUN, settings_for
from tiny_models import TINY

from pipeline.models import build_tiny
from pipeline.rl.synthetic import synthetic_extractions, synthetic_trajectories
from pipeline.runtime.harness import build_worker, run_worker
from schemas.base import Producer
from schemas.runs import StepSettled
from schemas.training import PolicyPublished, TrainStepCompleted
from workers.actor_trainer import ActorTrainer
from workers.extractor_trainer import ExtractorTrainer


def test_the_actor_trainer_publishes_version_0_then_trains_a_complete_step(tmp_path):
    settings = settings_for(tmp_path, actor_trainer={"group_size": 4})
    trajectories = synthetic_trajectories(build_tiny(TINY), run_id=RUN, step=0, groups=1, group_size=4, seed=0)
    by_slot = sorted(trajectories, key=lambda t: t.slot)
    assert [t.reward for t in by_slot] == [1.0, 0.0, 1.0, 1.0]  # the guided half (slots 0, 1) carries a signal
    worker, context = build_worker(ActorTrainer, settings)
    result = run_worker(worker, list(reversed(trajectories)), context=context)
    published = [e for e in result.outputs if isinstance(e, PolicyPublished)]
    steps = [e for e in result.outputs if isinstance(e, TrainStepCompleted)]
    assert [p.version for p in published] == [0, 1] and all(p.role == "actor" for p in published)
    assert [(s.step, s.policy_version) for s in steps] == [(0, 1)]
    assert steps[0].batch_event_ids == tuple(str(t.event_id) for t in by_slot)
    # normalised per half with the sample std: (r - 0.5) / 0.7071 in the guided half; the free half has no spread
    assert steps[0].advantages == pytest.approx((0.70711, -0.70711, 0.0, 0.0), abs=1e-4)
    assert steps[0].weight_hash_before != steps[0].weight_hash_after
    assert result.committed == {("crl.trajectories", 0): 4}


def _generations_and_the_episodes_they_guided() -> tuple[list, list]:
    """Two extractor generations, and four guided episodes of step 1 that were served their lessons."""
    generations = synthetic_extractions(build_tiny(TINY.model_copy(update={"seed": 1})), run_id=RUN, count=2,
                                        seed=2)
    guided = synthetic_trajectories(build_tiny(TINY), run_id=RUN, step=1, groups=1, group_size=4, seed=3,
                                    served_generations=[g.generation_id for g in generations])
    return generations, guided


def test_the_extractor_trainer_trains_once_its_buffer_holds_credited_generations(tmp_path):
    settings = settings_for(tmp_path)
    generations, guided = _generations_and_the_episodes_they_guided()
    worker, context = build_worker(ExtractorTrainer, settings)
    result = run_worker(worker, [*generations, *guided], context=context)
    published = [e for e in result.outputs if isinstance(e, PolicyPublished)]
    steps = [e for e in result.outputs if isinstance(e, TrainStepCompleted)]
    assert [p.version for p in published] == [0, 1] and all(p.role == "extractor" for p in published)
    assert len(steps) == 1 and steps[0].loss_variant == "cispo"
    assert sorted(steps[0].batch_event_ids) == sorted(str(g.event_id) for g in generations)
    assert len(steps[0].rewards) == len(steps[0].advantages) == 2


def test_trainers_never_take_another_runs_events_into_a_batch(tmp_path):
    # A planted copy of each event under another run's id (new event ids, same step and groups) is ignored: the step
    # trains on this run's four episodes only, and the extractor's buffer holds only this run's generations.
    settings = settings_for(tmp_path, actor_trainer={"group_size": 4})
    ours = synthetic_trajectories(build_tiny(TINY), run_id=RUN, step=0, groups=1, group_size=4, seed=0)
    planted = synthetic_trajectories(build_tiny(TINY), run_id="another-run", step=0, groups=1, group_size=4, seed=0)
    worker, context = build_worker(ActorTrainer, settings)
    result = run_worker(worker, [*planted, *ours], context=context)
    [step] = [e for e in result.outputs if isinstance(e, TrainStepCompleted)]
    assert sorted(step.batch_event_ids) == sorted(str(t.event_id) for t in ours)

    generations = synthetic_extractions(build_tiny(TINY.model_copy(update={"seed": 1})), run_id=RUN, count=2, seed=2)
    foreign = synthetic_extractions(build_tiny(TINY.model_copy(update={"seed": 1})), run_id="another-run", count=2,
                                    seed=5)
    guided = synthetic_trajectories(build_tiny(TINY), run_id=RUN, step=1, groups=1, group_size=4, seed=3,
                                    served_generations=[g.generation_id for g in generations])
    foreign_guided = synthetic_trajectories(build_tiny(TINY), run_id="another-run", step=1, groups=1, group_size=4,
                                            seed=3, served_generations=[g.generation_id for g in foreign])
    worker, context = build_worker(ExtractorTrainer, settings_for(tmp_path / "extractor"))
    result = run_worker(worker, [*foreign, *foreign_guided, *generations, *guided], context=context)
    steps = [e for e in result.outputs if isinstance(e, TrainStepCompleted)]
    assert [sorted(s.batch_event_ids) for s in steps] == [sorted(str(g.event_id) for g in generations)]


def test_in_deterministic_mode_the_extractor_trainer_trains_at_step_boundaries_and_names_its_version(tmp_path):
    settings = settings_for(tmp_path, scheduler={"deterministic": True, "max_steps_ahead": 0, "steps": 2,
                                                 "eval_every": 0, "merge_every": 0},
                            actor_trainer={"group_size": 4})
    generations = [g.model_copy(update={"step": 0}) for g in synthetic_extractions(
        build_tiny(TINY.model_copy(update={"seed": 1})), run_id=RUN, count=2, seed=2)]

    def step(s: int, served: list[str]) -> list:
        played = synthetic_trajectories(build_tiny(TINY), run_id=RUN, step=s, groups=1, group_size=4, seed=3 + s,
                                        served_generations=served)
        return [t.model_copy(update={"trajectory_id": f"s{s:06d}-g000-k{t.slot}", "group_id": f"s{s:06d}-g000"})
                for t in played]

    step0, step1 = step(0, []), step(1, [g.generation_id for g in generations])
    extractor = StepSettled(run_id=RUN, producer=Producer(worker="extractor", instance="x-0"), role="extractor",
                            step=0, extractor_version=0, bank_offset=2,
                            extraction_event_ids=tuple(str(g.event_id) for g in generations))

    def settled(result) -> list[tuple[int, int]]:
        return [(e.step, e.extractor_version) for e in result.outputs if isinstance(e, StepSettled)]

    worker, context = build_worker(ExtractorTrainer, settings)
    early = run_worker(worker, [*step0, *generations, *step1], context=context)
    # step 0 has no outcomes to train on: version 0 distils it; step 1 waits for the extractor's settlement of step 0
    assert settled(early) == [(0, 0)]
    assert not any(isinstance(e, TrainStepCompleted) for e in early.outputs)

    worker, context = build_worker(ExtractorTrainer, settings)
    result = run_worker(worker, [*step0, *generations, *step1, extractor], context=context)
    steps = [e for e in result.outputs if isinstance(e, TrainStepCompleted)]
    assert settled(result) == [(0, 0), (1, 1)]
    # the batch in (step, generation id) order, not in event-id order
    assert [len(s.batch_event_ids) for s in steps] == [2]
    by_id = {str(g.event_id): g.generation_id for g in generations}
    assert [by_id[i] for i in steps[0].batch_event_ids] == sorted(g.generation_id for g in generations)


def test_in_the_frozen_arm_neither_trainer_trains(tmp_path):
    """`frozen`, the control of `exp_only`: both trainers publish version 0 and train nothing, given the same
    episodes and generations that train them in the other arms."""
    settings = settings_for(tmp_path, scheduler={"arm": "frozen"}, actor_trainer={"group_size": 4})
    trajectories = synthetic_trajectories(build_tiny(TINY), run_id=RUN, step=0, groups=1, group_size=4, seed=0)
    actor, context = build_worker(ActorTrainer, settings)
    played = run_worker(actor, trajectories, context=context)
    assert [(e.kind, e.version) for e in played.outputs if isinstance(e, PolicyPublished)] == [("PolicyPublished", 0)]
    assert not any(isinstance(e, TrainStepCompleted) for e in played.outputs)

    generations, guided = _generations_and_the_episodes_they_guided()
    extractor, context = build_worker(ExtractorTrainer, settings)
    credited = run_worker(extractor, [*generations, *guided], context=context)
    assert [e.version for e in credited.outputs if isinstance(e, PolicyPublished)] == [0]
    assert not any(isinstance(e, TrainStepCompleted) for e in credited.outputs)
