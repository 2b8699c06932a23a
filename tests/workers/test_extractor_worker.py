"""The extractor worker through the harness: it follows the extractor's published version and the bank, distils
the train trajectories it is handed (showing each the experiences it was served, as the bank holds them now),
skips evaluation episodes, and runs a merge request over the family's active experiences."""

from __future__ import annotations

import numpy as np
from harness_setup import RUN, TINY, publish_policy, settings_for

from pipeline.extractor.ops import generation_event_id
from pipeline.extractor.protocol import distill_generation_id, merge_generation_id
from pipeline.models import build_tiny
from pipeline.rl.synthetic import synthetic_trajectories
from pipeline.runtime.harness import build_worker, run_worker
from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.experiences import ExperienceAdded
from schemas.extractions import ExtractionGenerated
from schemas.runs import MergeRequested
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
