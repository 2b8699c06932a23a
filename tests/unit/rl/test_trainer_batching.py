"""How the trainers form batches: the actor's step collector and the extractor's outcome join (no model, no broker)."""

from __future__ import annotations

import pytest

from pipeline.errors import PoisonMessageError
from pipeline.rl.batching import ExtractorJoin, StepCollector
from schemas.base import Producer
from schemas.extractions import ExtractionGenerated
from schemas.training import TrainStepCompleted
from schemas.trajectories import ExperienceRef, Timings, TrajectoryCompleted, Turn

WHO = Producer(worker="test", instance="test-0")
P = ("crl.trajectories", 0)


def trajectory(step: int, group: str, slot: int, *, success: bool = False, guided: bool = False,
               split: str = "train", served: tuple[str, ...] = (), env_error: str | None = None
               ) -> TrajectoryCompleted:
    return TrajectoryCompleted(
        run_id="r", producer=WHO, trajectory_id=f"t-{step}-{group}-{slot}-{split}", assignment_event_id="a", step=step,
        split=split, env_id="e", task_family="f", seed=1, group_id=group, slot=slot, guided=guided, goal="g",
        turns=(Turn(observation="o", prompt_token_ids=(1, 2), response_token_ids=(3,), sampling_logprobs=(-1.0,),
                    response_text="x", action="x", valid=True, reward=float(success)),),
        reward=float(success), success=success, num_actions=1, invalid_actions=0, truncated=False,
        retrieved=tuple(ExperienceRef(experience_id=f"x-{g}", version=1, generation_id=g) for g in served),
        bank_offset=0 if served else None, policy_version=0,
        timings=Timings(generation_s=0, env_s=0, retrieval_s=0), env_error=env_error,
    )


def test_a_step_closes_when_all_its_groups_are_complete_in_canonical_order():
    collector = StepCollector(group_size=2, groups_per_step=2, timeout_s=60, next_step=0)
    arrivals = [("g2", 1), ("g1", 1), ("g2", 0)]
    for offset, (group, slot) in enumerate(arrivals):
        collector.add(trajectory(0, group, slot), P, offset, now=0.0)
    assert collector.close(now=1.0) is None
    collector.add(trajectory(0, "g1", 0), P, 3, now=1.0)
    closed = collector.close(now=1.0)
    assert closed is not None and not closed.timed_out and closed.dropped_event_ids == []
    assert [(t.group_id, t.slot) for t in closed.trajectories] == [("g1", 0), ("g1", 1), ("g2", 0), ("g2", 1)]
    assert collector.next_step == 1 and collector.pending_offsets() == {}


def test_timeout_trains_complete_groups_and_drops_the_rest():
    collector = StepCollector(group_size=2, groups_per_step=2, timeout_s=10, next_step=3)
    collector.add(trajectory(3, "a", 0), P, 10, now=100.0)
    collector.add(trajectory(3, "a", 1), P, 11, now=101.0)
    straggler = trajectory(3, "b", 1)
    collector.add(straggler, P, 12, now=102.0)
    collector.add(trajectory(4, "c", 0), P, 13, now=103.0)
    assert collector.pending_offsets() == {P: 10}
    assert collector.close(now=109.9) is None
    closed = collector.close(now=110.0)
    assert closed is not None and closed.step == 3 and closed.timed_out
    assert [t.group_id for t in closed.trajectories] == ["a", "a"]
    assert closed.dropped_event_ids == [str(straggler.event_id)]
    # the next step is still pending, and a late episode of step 3 is counted, not collected
    assert collector.pending_offsets() == {P: 13}
    collector.add(trajectory(3, "b", 0), P, 14, now=111.0)
    assert collector.late == 1 and collector.pending_offsets() == {P: 13}


def test_warm_up_and_eval_episodes_are_not_collected():
    collector = StepCollector(group_size=2, groups_per_step=1, timeout_s=10, next_step=2)
    collector.add(trajectory(1, "w", 0), P, 0, now=0.0)
    collector.add(trajectory(2, "e", 0, split="eval"), P, 1, now=0.0)
    assert collector.steps == {} and collector.late == 1


def test_a_slot_outside_the_configured_group_is_a_config_error():
    collector = StepCollector(group_size=2, groups_per_step=1, timeout_s=10, next_step=0)
    with pytest.raises(PoisonMessageError, match="group_size is 2"):
        collector.add(trajectory(0, "g", 5), P, 0, now=0.0)


def extraction(generation_id: str, status: str = "ok") -> ExtractionGenerated:
    return ExtractionGenerated(
        run_id="r", producer=WHO, generation_id=generation_id, extractor_version=0, purpose="distill",
        task_family="f", prompt_token_ids=(1, 2), response_token_ids=(3, 4), sampling_logprobs=(-1.0, -2.0),
        response_text="<answer>[]</answer>", parse_status=status,
        op_ids=(f"{generation_id}:0",) if status == "ok" else (),
        parse_error="bad" if status == "parse_error" else None,
    )


def test_join_credits_generations_with_mean_outcomes_and_weights_retraining():
    join = ExtractorJoin()
    generations = {g: extraction(g) for g in ("ga", "gb", "gc")}
    for event in generations.values():
        join.add_extraction(event)
    join.add_extraction(extraction("gx", "parse_error"))  # not a sample
    # ga: success + failure -> 0; gb: success -> +1; gc: nothing yet; eval and free episodes give no credit
    join.add_trajectory(trajectory(1, "g", 0, success=True, guided=True, served=("ga", "gb")))
    join.add_trajectory(trajectory(1, "g", 1, success=False, guided=True, served=("ga",)))
    join.add_trajectory(trajectory(1, "h", 0, success=False, guided=True, served=("gc",), split="eval"))
    assert join.ready() == [str(generations["ga"].event_id), str(generations["gb"].event_id)]
    assert join.batch(step=1, size=3, alpha=0.5, delta=1) is None
    batch = join.batch(step=1, size=2, alpha=0.5, delta=1)
    assert batch is not None
    by_id = dict(zip(batch.event_ids, range(2), strict=True))
    a, b = by_id[str(generations["ga"].event_id)], by_id[str(generations["gb"].event_id)]
    # rewards 0 and 1, mean 0.5: advantages -0.5 and +0.5, weights 1 (never trained)
    assert (batch.rewards[a], batch.rewards[b]) == (0.0, 1.0)
    assert (batch.advantages[a], batch.advantages[b]) == (-0.5, 0.5)
    assert (batch.outcome_counts[a], batch.outcome_counts[b]) == (2, 1)
    # the step trains them; gb gets a new outcome and is ready again, weighted (1 + 1)^-0.5
    step = TrainStepCompleted(
        run_id="r", producer=WHO, role="extractor", step=1, policy_version=1, batch_event_ids=batch.event_ids,
        weight_hash_before="0" * 64, weight_hash_after="1" * 64, loss=0.0, tokens=4, loss_variant="cispo",
        aggregation="token-mean", rewards=batch.rewards, advantages=batch.advantages,
        outcome_counts=batch.outcome_counts)
    join.add_train_step(step)
    assert join.ready() == []
    join.add_trajectory(trajectory(2, "g", 2, success=False, guided=True, served=("gb", "gc")))
    assert join.ready() == [str(generations["gb"].event_id), str(generations["gc"].event_id)]
    batch = join.batch(step=2, size=2, alpha=0.5, delta=1)
    assert batch is not None
    by_id = dict(zip(batch.event_ids, range(2), strict=True))
    b, c = by_id[str(generations["gb"].event_id)], by_id[str(generations["gc"].event_id)]
    assert (batch.rewards[b], batch.rewards[c]) == (0.0, -1.0)  # gb: mean(+1, -1); gc: -1
    assert batch.weights[b] == pytest.approx(2 ** -0.5) and batch.weights[c] == 1.0
    assert batch.advantages[b] == pytest.approx(0.5 * 2 ** -0.5) and batch.advantages[c] == -0.5
    # delta 2: gb was trained 1 step ago (< 2), so it carries no advantage
    assert join.batch(step=2, size=2, alpha=0.5, delta=2).weights[b] == 0.0


def test_join_rebuilt_in_another_order_gives_the_same_ready_set():
    events = [extraction("ga"), extraction("gb")]
    trained = TrainStepCompleted(
        run_id="r", producer=WHO, role="extractor", step=1, policy_version=1,
        batch_event_ids=(str(events[0].event_id),), weight_hash_before="0" * 64, weight_hash_after="1" * 64,
        loss=0.0, tokens=2, loss_variant="cispo", aggregation="token-mean", outcome_counts=(1,))
    outcomes = [trajectory(1, "g", 0, success=True, guided=True, served=("ga", "gb"))]
    live, rebuilt = ExtractorJoin(), ExtractorJoin()
    for event in events:
        live.add_extraction(event)
    live.add_trajectory(outcomes[0])
    live.add_train_step(trained)
    # after a restart the train step may be read before the extraction it names
    rebuilt.add_train_step(trained)
    rebuilt.add_trajectory(outcomes[0])
    for event in reversed(events):
        rebuilt.add_extraction(event)
    assert set(live.ready()) == set(rebuilt.ready()) == {str(events[1].event_id)}
    assert rebuilt.generations[str(events[0].event_id)].trainings == {1}


def test_a_canonical_join_takes_the_oldest_by_step_and_generation_id_whatever_the_arrival_order():
    generations = [extraction(g).model_copy(update={"step": step})
                   for g, step in (("r-s2-b", 2), ("r-s1-z", 1), ("r-s2-a", 2), ("r-s1-y", 1))]
    outcomes = [trajectory(3, "g", slot, success=slot % 2 == 0, guided=True, served=(g.generation_id,))
                for slot, g in enumerate(generations)]
    batches = []
    for order in (generations, list(reversed(generations))):
        join = ExtractorJoin(canonical=True)
        for event in order:
            join.add_extraction(event)
        for outcome in outcomes:
            join.add_trajectory(outcome)
        batch = join.batch(step=1, size=3, alpha=0.5, delta=1)
        assert batch is not None
        batches.append(batch)
    # the oldest three by (step, generation id): r-s1-y, r-s1-z, r-s2-a, in that order (not in event-id order)
    expected = tuple(str(g.event_id) for g in sorted(generations, key=lambda g: (g.step, g.generation_id))[:3])
    assert batches[0].event_ids == batches[1].event_ids == expected
    assert batches[0].advantages == batches[1].advantages


def test_an_episode_its_engine_failed_gets_no_advantage_and_stays_out_of_its_subgroup():
    """Free subgroup of g1: rewards 1, 0, 0 and a crashed 0. Without the crash: mean 1/3, sample std sqrt(1/3), so
    the advantages are (2/3) / 0.57735 = 1.1547 and (-1/3) / 0.57735 = -0.57735; the crashed one gets 0. The guided
    subgroup is left as it was."""
    from pipeline.rl.settings import ActorTrainerSettings
    from pipeline.rl.trainer import actor_advantages

    batch = [trajectory(0, "g1", 0, success=True), trajectory(0, "g1", 1), trajectory(0, "g1", 2),
             trajectory(0, "g1", 3, env_error="textworld-express: stepJSON failed"),
             trajectory(0, "g1", 4, guided=True, success=True), trajectory(0, "g1", 5, guided=True)]
    advantages = actor_advantages(batch, ActorTrainerSettings()).tolist()
    assert advantages[:4] == pytest.approx([1.1547005, -0.5773503, -0.5773503, 0.0], abs=1e-5)  # eps 1e-6
    assert advantages[4:] == pytest.approx([0.7071068, -0.7071068], abs=1e-5)


def test_the_extractor_is_not_credited_by_an_episode_its_engine_failed():
    join = ExtractorJoin()
    join.add_trajectory(trajectory(0, "g1", 0, guided=True, served=("gen-a",), env_error="scienceworld: step failed"))
    join.add_trajectory(trajectory(0, "g1", 1, guided=True, served=("gen-b",)))
    assert join.outcomes == {"gen-b": {"t-0-g1-1-train": -1.0}}


def test_an_engine_failure_cannot_be_a_success():
    with pytest.raises(ValueError, match="engine failed cannot be a success"):
        trajectory(0, "g1", 0, success=True, env_error="boom")


def test_a_refined_lessons_outcomes_go_to_the_generation_that_wrote_the_version_served():
    """Experience x: added by generation g-add (version 1), refined by g-refine (version 2). An episode served
    version 1 credits g-add, one served version 2 credits g-refine; the adder is not credited for what its lesson
    became, the refiner not for what it replaced. Worked by hand: g-add has outcomes +1 (t1) and -1 (t2), reward 0;
    g-refine has -1 (t3) and -1 (t4), reward -1; mean -0.5, advantages +0.5 and -0.5."""
    def served(step: int, slot: int, version: int, generation: str, success: bool) -> TrajectoryCompleted:
        episode = trajectory(step, "g", slot, success=success, guided=True)
        return episode.model_copy(update={"retrieved": (
            ExperienceRef(experience_id="x", version=version, generation_id=generation),)})

    join = ExtractorJoin(canonical=True)
    for generation in ("g-add", "g-refine"):
        join.add_extraction(extraction(generation))
    join.add_trajectory(served(1, 0, 1, "g-add", True))
    join.add_trajectory(served(1, 1, 1, "g-add", False))
    assert join.ready() == [str(join.generations[join.by_generation_id["g-add"]].event.event_id)], \
        "the refine's generation has no outcome until its version is served"
    join.add_trajectory(served(2, 0, 2, "g-refine", False))
    join.add_trajectory(served(2, 1, 2, "g-refine", False))
    batch = join.batch(step=1, size=2, alpha=0.5, delta=1)
    assert batch is not None
    rewards = dict(zip((join.generations[e].event.generation_id for e in batch.event_ids), batch.rewards, strict=True))
    advantages = dict(zip((join.generations[e].event.generation_id for e in batch.event_ids), batch.advantages,
                          strict=True))
    assert rewards == {"g-add": 0.0, "g-refine": -1.0}
    assert advantages == {"g-add": 0.5, "g-refine": -0.5}
    assert batch.outcome_counts == (2, 2)
    # An episode served two lessons of one generation credits it once; an evaluation episode credits nothing.
    join.add_trajectory(trajectory(3, "h", 0, success=True, guided=True, served=("g-add", "g-add")))
    join.add_trajectory(trajectory(3, "h", 1, success=True, guided=True, served=("g-refine",), split="eval"))
    assert {g: len(o) for g, o in join.outcomes.items()} == {"g-add": 3, "g-refine": 2}


def test_a_rejected_answer_is_a_sample_of_the_parse_error_reward_when_one_is_set():
    """gx's answer was rejected (parse_error); ga guided a success (+1), gb a failure (-1). With parse_error_reward -1,
    gx is ready at once with reward -1 from its one outcome: rewards (+1, -1, -1), mean -1/3, advantages +4/3, -2/3,
    -2/3. It is trained once: no episode can ever credit it again. Without the setting it never joins (the paper)."""
    events = {g: extraction(g) for g in ("ga", "gb")} | {"gx": extraction("gx", "parse_error")}
    join = ExtractorJoin(parse_error_reward=-1.0)
    for event in events.values():
        join.add_extraction(event)
    assert join.ready() == [str(events["gx"].event_id)]
    join.add_trajectory(trajectory(1, "g", 0, success=True, guided=True, served=("ga",)))
    join.add_trajectory(trajectory(1, "g", 1, success=False, guided=True, served=("gb",)))
    batch = join.batch(step=1, size=3, alpha=0.5, delta=1)
    assert batch is not None
    by_generation = {join.generations[e].event.generation_id: i for i, e in enumerate(batch.event_ids)}
    assert [batch.rewards[by_generation[g]] for g in ("ga", "gb", "gx")] == [1.0, -1.0, -1.0]
    assert [batch.advantages[by_generation[g]] for g in ("ga", "gb", "gx")] == pytest.approx([4 / 3, -2 / 3, -2 / 3])
    assert batch.outcome_counts[by_generation["gx"]] == 1
    join.add_train_step(TrainStepCompleted(
        run_id="r", producer=WHO, role="extractor", step=1, policy_version=1, batch_event_ids=batch.event_ids,
        weight_hash_before="0" * 64, weight_hash_after="1" * 64, loss=0.0, tokens=6, loss_variant="cispo",
        aggregation="token-mean", rewards=batch.rewards, advantages=batch.advantages,
        outcome_counts=batch.outcome_counts))
    assert join.ready() == []
    paper = ExtractorJoin()
    paper.add_extraction(events["gx"])
    assert paper.generations == {} and paper.ready() == []


def test_a_rejected_answer_counts_from_the_step_after_the_one_it_distilled_in_a_canonical_join():
    """Deterministic mode settles step s once it has read every generation of step s - 1: a rejected answer of a
    step-2 trajectory counts from step 3 on, so which batch takes it does not depend on when it was read."""
    join = ExtractorJoin(canonical=True, parse_error_reward=-1.0)
    rejected = extraction("r-s2-x", "parse_error").model_copy(update={"step": 2})
    join.add_extraction(rejected)
    assert join.ready(through=2) == [] and join.ready(through=3) == [str(rejected.event_id)]


def test_the_replay_keeps_the_copy_the_join_kept_with_or_without_the_parse_error_reward():
    from pipeline.rl.batching import trained_copies

    ok = extraction("ga")
    # a generation distilled again is published again under its id, with what it sampled then
    rejected = extraction("ga", "parse_error").model_copy(update={"event_id": ok.event_id})
    assert trained_copies([rejected, ok])[str(ok.event_id)] is ok
    assert trained_copies([rejected, ok], parse_errors=True)[str(ok.event_id)] is rejected
    join = ExtractorJoin(parse_error_reward=-1.0)
    join.add_extraction(rejected)
    join.add_extraction(ok)
    assert join.generations[str(ok.event_id)].event is rejected
    # the later copy's lessons were applied under the same generation id: episodes they guide never credit the
    # rejected tokens the join keeps
    join.add_trajectory(trajectory(1, "g", 0, success=True, guided=True, served=("ga",)))
    batch = join.batch(step=1, size=1, alpha=0.5, delta=1)
    assert batch is not None and batch.rewards == (-1.0,) and batch.outcome_counts == (1,)
