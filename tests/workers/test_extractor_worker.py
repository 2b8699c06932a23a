"""The extractor worker through the harness: it follows the extractor's published version and the bank, distils
the train trajectories it is handed (showing each the experiences it was served, as the bank holds them now),
skips evaluation episodes, and runs a merge request over the family's active experiences."""

from __future__ import annotations

import numpy as np
from harness_setup import RUN, publish_policy, settings_for
from tiny_models import TINY

from pipeline.extractor.ops import generation_event_id
from pipeline.extractor.protocol import distill_generation_id, merge_generation_id
from pipeline.models import build_tiny
from pipeline.rl.synthetic import synthetic_trajectories
from pipeline.runtime.harness import build_worker, run_worker
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.experiences import ExperienceAdded, ExperienceRefined, ExperienceRetired
from schemas.extractions import ExtractionGenerated
from schemas.runs import MergeRequested, StepSettled
from schemas.trajectories import ExperienceRef
from workers.extractor import Extractor


def _lesson(settings, experience_id: str, text: str, seed: int) -> ExperienceAdded:
    vector = np.random.default_rng(seed).normal(size=384).astype(np.float32)
    return ExperienceAdded(
        run_id=RUN, producer=Producer(worker="extractor", instance="x-0"), op_id=f"op-{experience_id}",
        experience_id=experience_id, task_family="synthetic", text=text, generation_id=f"gen-{experience_id}",
        extractor_version=0, key=EmbeddingVector.from_array(settings.embedding.model, vector / np.linalg.norm(vector)),
        source_trajectory_ids=("t0",))


def test_the_extractor_distils_train_trajectories_and_merges_what_the_bank_holds(tmp_path):
    settings = settings_for(tmp_path)
    lessons = [_lesson(settings, "exp-g1", "Walk diagonally toward the >.", 1),
               _lesson(settings, "exp-g2", "Avoid walls; they waste a turn.", 2)]
    actor = build_tiny(TINY)
    train = synthetic_trajectories(actor, run_id=RUN, step=0, groups=1, group_size=2, seed=3,
                                   served_generations=["g1"])
    evaluation = synthetic_trajectories(actor, run_id=RUN, step=0, groups=1, group_size=2, seed=3, split="eval")
    merge = MergeRequested(run_id=RUN, producer=Producer(worker="scheduler", instance="scheduler-0"),
                           merge_id="merge-s000001", step=1, task_families=("synthetic",))
    worker, context = build_worker(Extractor, settings, log=[publish_policy(tmp_path, "extractor"), *lessons])
    result = run_worker(worker, [*train, *evaluation, merge], context=context)

    generations = [e for e in result.outputs if isinstance(e, ExtractionGenerated)]
    distilled = [g for g in generations if g.purpose == "distill"]
    assert sorted(g.generation_id for g in distilled) == sorted(
        distill_generation_id(RUN, t.trajectory_id) for t in train)  # evaluation episodes are not distilled
    assert all(g.event_id == generation_event_id(g.generation_id) and g.extractor_version == 0 for g in generations)
    guided = next(g for g in distilled if g.source_trajectory_ids == (train[0].trajectory_id,))
    assert guided.shown == (ExperienceRef(experience_id="exp-g1", version=1, generation_id="gen-exp-g1"),)
    free = next(g for g in distilled if g.source_trajectory_ids == (train[1].trajectory_id,))
    assert free.shown == ()
    merged = [g for g in generations if g.purpose == "merge"]
    # both active experiences in one chunk, unless a distillation added to the family first
    assert merged and merged[0].generation_id == merge_generation_id("merge-s000001", "synthetic", 0)
    assert {ref.experience_id for ref in merged[0].shown} >= {"exp-g1", "exp-g2"}
    for generation in generations:  # a random tiny model rarely answers well: every answer is recorded anyway
        assert generation.parse_status in ("ok", "no_op", "parse_error")
        assert (generation.parse_error is not None) == (generation.parse_status == "parse_error")
        assert len(generation.sampling_logprobs) == len(generation.response_token_ids) > 0
    assert result.dead_letters == []
    positions = {position[0] for position in result.committed}
    assert positions == {"crl.trajectories", "crl.control"}
    assert result.committed[("crl.trajectories", 0)] == 4 and result.committed[("crl.control", 0)] == 1


def test_in_deterministic_mode_the_extractor_distils_a_whole_step_in_trajectory_order_once_its_trainer_settled(
        tmp_path):
    settings = settings_for(tmp_path, scheduler={"deterministic": True, "max_steps_ahead": 0, "steps": 2,
                                                 "eval_every": 0, "merge_every": 0})
    actor = build_tiny(TINY)
    played = synthetic_trajectories(actor, run_id=RUN, step=0, groups=1, group_size=2, seed=3)
    # the schedule's identities: step 0 is one group of two slots
    step0 = [t.model_copy(update={"trajectory_id": f"s000000-g000-k{slot}", "group_id": "s000000-g000",
                                  "slot": slot}) for slot, t in enumerate(played)]
    who = Producer(worker="extractor_trainer", instance="t-0")
    settled = StepSettled(run_id=RUN, producer=who, role="extractor_trainer", step=0, extractor_version=0)
    policy = publish_policy(tmp_path, "extractor")

    worker, context = build_worker(Extractor, settings, log=[policy])
    waiting = run_worker(worker, list(reversed(step0)), context=context)
    assert waiting.outputs == [], "nothing is distilled before the extractor trainer settled the step"
    assert waiting.committed.get(("crl.trajectories", 0), 0) == 0, "the step's positions are held"

    worker, context = build_worker(Extractor, settings, log=[policy, settled])
    half = run_worker(worker, step0[1:], context=context)
    assert half.outputs == [], "nor before every episode of the step is in"

    worker, context = build_worker(Extractor, settings, log=[policy, settled])
    result = run_worker(worker, list(reversed(step0)), context=context)
    generations = [e for e in result.outputs if isinstance(e, ExtractionGenerated)]
    assert [g.source_trajectory_ids for g in generations] == [("s000000-g000-k0",), ("s000000-g000-k1",)]
    (done,) = [e for e in result.outputs if isinstance(e, StepSettled)]
    assert (done.role, done.step, done.extractor_version) == ("extractor", 0, 0)
    assert done.extraction_event_ids == tuple(str(g.event_id) for g in generations)
    ops = sum(isinstance(e, ExperienceAdded | ExperienceRefined | ExperienceRetired) for e in result.outputs)
    assert done.bank_offset == ops, "the op log ends after the step's ops (it began empty)"
    assert result.outputs[-1] is done and result.committed[("crl.trajectories", 0)] == 2
