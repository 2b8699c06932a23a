"""The tracker's fold (`pipeline.tracking.fold`) on hand-made events: exact values, entries emitted only once what
they are computed from is all in, the same entries whatever order the topics are read in, and a restarted tracker
writing each entry once (read back with TensorBoard's own reader)."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from pipeline.actor.schedule import trajectory_event_id
from pipeline.extractor.ops import generation_event_id
from pipeline.extractor.protocol import distill_generation_id
from pipeline.tracking.backends import TensorBoardBackend
from pipeline.tracking.fold import (
    Histogram,
    RunTracking,
    Scalar,
    Text,
    as_table,
    fold,
    generation_text,
    hparams,
    schedule_from,
)
from pipeline.tracking.readback import tensorboard_entries
from pipeline.tracking.tracker import Tracker
from schemas.base import Producer
from schemas.examples import example_events
from schemas.experiences import ExperienceAdded, ExperienceRetired
from schemas.extractions import ExtractionGenerated
from schemas.runs import RunStarted
from schemas.training import TrainStepCompleted, WarmStartProgressed
from schemas.trajectories import ExperienceRef, TrajectoryCompleted

RUN = "track-run"
WHO = Producer(worker="test", instance="test-0")
T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
CONFIG = {"scheduler": {"steps": 2, "eval_every": 0, "merge_every": 0},
          "actor_trainer": {"group_size": 4, "groups_per_step": 1, "warmup_steps": 1},
          "envs": {"tasks": [{"env_id": "MiniHack-Room-Random-5x5-v0", "max_turns": 6}]}}
EXAMPLES = {event.kind: event for event in example_events(RUN)}


def _started() -> RunStarted:
    return RunStarted(run_id=RUN, producer=WHO, config=CONFIG, code_version="test", occurred_at=T0)


def _episodes(step: int, successes: list[bool], bank_offset: int | None = None,
              served: tuple[ExperienceRef, ...] = ()) -> list[TrajectoryCompleted]:
    """The step's four scheduled episodes (their real ids), slots 0-1 guided from step 1 on."""
    schedule = schedule_from(_started())
    example = EXAMPLES["TrajectoryCompleted"]
    assert isinstance(example, TrajectoryCompleted)
    episodes = []
    for assignment, success in zip(schedule.train_assignments(RUN, WHO, step), successes, strict=True):
        guided = assignment.guided
        episodes.append(example.model_copy(update={
            "event_id": trajectory_event_id(str(assignment.event_id)), "assignment_event_id": str(assignment.event_id),
            "trajectory_id": f"{assignment.group_id}-k{assignment.slot}",
            "step": step, "group_id": assignment.group_id, "slot": assignment.slot, "guided": guided,
            "success": success, "reward": float(success), "occurred_at": T0 + timedelta(seconds=10 * step
                                                                                         + assignment.slot),
            "retrieved": served if guided else (), "bank_offset": bank_offset if guided else None}))
    return episodes


def _added(number: int) -> ExperienceAdded:
    example = EXAMPLES["ExperienceAdded"]
    assert isinstance(example, ExperienceAdded)
    return example.model_copy(update={"event_id": uuid.uuid4(), "op_id": f"gen-{number}:0",
                                      "experience_id": f"exp-{number}", "text": f"lesson {number}"})


def _scalars(entries) -> dict[tuple[str, int], float]:
    return {(e.tag, e.step): e.value for e in entries if isinstance(e, Scalar)}


def test_a_step_is_shown_once_all_its_episodes_are_in_whatever_their_order():
    tracking = RunTracking()
    assert [e.tag for e in tracking.add(_started(), 0)] == ["run/config"]
    episodes = _episodes(0, [True, False, False, False])
    emitted = [tracking.add(episode, offset) for offset, episode in enumerate(reversed(episodes))]
    assert emitted[:3] == [[], [], []], "nothing before the step's last episode"
    assert _scalars(emitted[3]) == {
        ("rollout/episodes", 0): 4.0, ("rollout/success", 0): 0.25, ("rollout/success_free", 0): 0.25,
        ("rollout/reward_mean", 0): 0.25, ("rollout/turns_mean", 0): 2.0, ("rollout/invalid_actions_mean", 0): 0.0}
    [samples] = [e for e in emitted[3] if isinstance(e, Text)]
    assert samples.tag == "rollout/samples" and samples.step == 0
    assert samples.text.count("outcome: ") == 2, "two free episodes (no guided slot in the warm-up step)"
    assert samples.wall_time == (T0 + timedelta(seconds=1)).timestamp(), "the newest shown episode's time"
    assert tracking.add(episodes[0], 9) == [], "an episode played again counts once"


def test_a_guided_step_shows_the_bank_it_was_served_from_once_the_ops_are_read():
    tracking = RunTracking()
    tracking.add(_started(), 0)
    for episode in _episodes(0, [False] * 4):
        tracking.add(episode, 0)
    served = (ExperienceRef(experience_id="exp-1", version=1, generation_id="gen-1"),)
    entries = []
    for episode in _episodes(1, [True, True, False, True], bank_offset=2, served=served):
        entries += tracking.add(episode, 0)
    assert _scalars(entries)[("rollout/success_guided", 1)] == 1.0
    assert _scalars(entries)[("rollout/success_free", 1)] == 0.5
    assert not [e for e in entries if e.tag.startswith("bank/") or e.tag == "rollout/samples"], \
        "the bank as of offset 2 is not known before ops 0 and 1 are read"
    assert tracking.add(_added(1), 0) == []
    entries = tracking.add(_added(2), 1) + tracking.add(_added(3), 2)  # op 2 lies past the step's bank
    assert _scalars(entries) == {("bank/size", 1): 2.0, ("bank/offset", 1): 2.0, ("bank/ops/add", 1): 2.0,
                                 ("bank/ops/refine", 1): 0.0, ("bank/ops/merge", 1): 0.0,
                                 ("bank/ops/retire", 1): 0.0, ("bank/ops/rejected", 1): 0.0}
    texts = {e.tag: e.text for e in entries if isinstance(e, Text)}
    assert texts["bank/written"] == "- add exp-1: lesson 1\n- add exp-2: lesson 2"
    assert "served experience: exp-1 v1: lesson 1" in texts["rollout/samples"]


def test_a_retired_experience_leaves_the_bank_size_and_a_rejected_op_is_counted():
    tracking = RunTracking()
    tracking.add(_started(), 0)
    retire = EXAMPLES["ExperienceRetired"]
    assert isinstance(retire, ExperienceRetired)
    tracking.add(_added(1), 0)
    tracking.add(_added(2), 1)
    tracking.add(retire.model_copy(update={"op_id": "evict:exp-1", "experience_id": "exp-1"}), 2)
    tracking.add(retire.model_copy(update={"op_id": "evict:exp-9", "experience_id": "exp-9"}), 3)  # no such entry
    for episode in _episodes(0, [False] * 4):
        tracking.add(episode, 0)
    entries = []
    for episode in _episodes(1, [False] * 4, bank_offset=4):
        entries += tracking.add(episode, 0)
    scalars = _scalars(entries)
    assert (scalars[("bank/size", 1)], scalars[("bank/ops/add", 1)], scalars[("bank/ops/retire", 1)],
            scalars[("bank/ops/rejected", 1)]) == (1.0, 2.0, 1.0, 1.0)


def test_train_steps_are_shown_under_the_trainer_namespaces():
    tracking = RunTracking()
    tracking.add(_started(), 0)
    step = EXAMPLES["TrainStepCompleted"]
    assert isinstance(step, TrainStepCompleted)
    assert _scalars(tracking.add(step, 0)) == {
        ("train/actor/loss", 2): -0.0123, ("train/actor/tokens", 2): 812.0, ("train/actor/clip_frac", 2): 0.03,
        ("train/actor/batch/success_guided", 2): 0.75}
    assert tracking.add(step, 1) == [], "a step published twice is shown once"


def test_the_extractor_trainer_step_is_shown_under_its_namespaces():
    tracking = RunTracking()
    tracking.add(_started(), 0)
    step = TrainStepCompleted(
        run_id=RUN, producer=WHO, role="extractor", step=1, policy_version=1, batch_event_ids=("g",),
        weight_hash_before="a" * 64, weight_hash_after="b" * 64, loss=0.5, tokens=10, loss_variant="cispo",
        aggregation="token-mean", metrics={"extractor/reward_mean": 0.25, "train/clip_fraction": 0.0})
    assert _scalars(tracking.add(step, 0)) == {("train/extractor/loss", 1): 0.5, ("train/extractor/tokens", 1): 10.0,
                                                ("train/extractor/reward", 1): 0.25,
                                                ("train/extractor/clip_frac", 1): 0.0}


def test_a_train_step_shows_its_advantages_and_rewards_as_histograms_and_its_diagnostics():
    tracking = RunTracking()
    tracking.add(_started(), 0)
    step = TrainStepCompleted(
        run_id=RUN, producer=WHO, role="actor", step=3, policy_version=3, batch_event_ids=("a", "b", "c"),
        weight_hash_before="a" * 64, weight_hash_after="b" * 64, loss=0.5, tokens=10, loss_variant="grpo",
        aggregation="token-mean", rewards=(1.0, 0.0, 0.0), advantages=(1.25, -0.5, -0.75),
        metrics={"train/entropy": 1.5, "train/approx_kl": 0.01, "train/clip_fraction": 0.1,
                 "train/response_length": 6.0})
    entries = tracking.add(step, 0)
    histograms = {(e.tag, e.step): e for e in entries if isinstance(e, Histogram)}
    assert set(histograms) == {("train/actor/advantages", 3), ("train/actor/rewards", 3)}
    assert histograms[("train/actor/advantages", 3)].summary() == (3.0, 0.0, -0.75, 1.25)
    assert histograms[("train/actor/rewards", 3)].summary() == (3.0, 1.0, 0.0, 1.0)
    assert {tag: value for (tag, _), value in _scalars(entries).items()}.items() >= {
        "train/actor/entropy": 1.5, "train/actor/approx_kl": 0.01, "train/actor/clip_frac": 0.1,
        "train/actor/response_length": 6.0}.items()


def test_hparams_are_the_settings_of_what_was_run_flattened():
    config = {"scheduler": {"arm": "grpo", "steps": 10, "deterministic": False},
              "envs": {"tasks": [{"env_id": "E", "weight": 1.0}]}, "actor_trainer": {"lr": 1e-5, "lora": None},
              "kafka": {"bootstrap_servers": "x:9092"}, "run_dir": "runs/a"}
    assert hparams(config) == {"scheduler.arm": "grpo", "scheduler.steps": 10.0, "scheduler.deterministic": False,
                               "envs.tasks": '[{"env_id": "E", "weight": 1.0}]', "actor_trainer.lr": 1e-5,
                               "actor_trainer.lora": "none"}


def test_a_generation_is_shown_with_its_prompt_digest_answer_ops_and_parse_status():
    example = EXAMPLES["ExtractionGenerated"]
    assert isinstance(example, ExtractionGenerated)
    failed = example.model_copy(update={"parse_status": "parse_error", "parse_error": "no <answer>", "op_ids": ()})
    text = generation_text(failed)
    assert f"**{failed.generation_id}** (distill" in text
    assert "prompt sha256 " in text and f"{len(failed.prompt_token_ids)} tokens" in text
    assert f"```\n{failed.response_text}\n```" in text
    assert text.endswith("ops: -\n\nparse: parse_error: no <answer>")
    assert generation_text(example).endswith(f"ops: {', '.join(example.op_ids)}\n\nparse: ok")


def _distillation(episode: TrajectoryCompleted, status: str) -> ExtractionGenerated:
    example = EXAMPLES["ExtractionGenerated"]
    assert isinstance(example, ExtractionGenerated)
    generation_id = distill_generation_id(RUN, episode.trajectory_id)
    update: dict = {"event_id": generation_event_id(generation_id), "generation_id": generation_id,
                    "parse_status": status}
    if status != "ok":
        update |= {"op_ids": (), "parse_error": "no <answer>" if status == "parse_error" else None}
    return example.model_copy(update=update)


def test_a_step_shows_how_many_of_its_distillations_parsed_once_all_are_read():
    tracking = RunTracking()
    tracking.add(_started(), 0)
    episodes = _episodes(0, [False] * 4)
    statuses = ["ok", "parse_error", "no_op", "ok"]
    entries = [e for episode in episodes for e in tracking.add(episode, 0)]
    assert not [e for e in entries if e.tag.startswith("extractor/")], "no distillation read yet"
    generations = [_distillation(episode, status) for episode, status in zip(episodes, statuses, strict=True)]
    assert _scalars(tracking.add(generations[0], 0) + tracking.add(generations[1], 1)
                    + tracking.add(generations[2], 2)) == {}
    again = generations[1].model_copy(update={"parse_status": "ok", "parse_error": None, "op_ids": ("x-op0",)})
    assert tracking.add(again, 3) == [], "the first copy of a generation distilled again counts"
    assert _scalars(tracking.add(generations[3], 4)) == {
        ("extractor/parse_ok", 0): 0.75, ("extractor/parse_error", 0): 0.25, ("extractor/no_op", 0): 0.25}


def _run_by_topic() -> dict[str, list]:
    served = (ExperienceRef(experience_id="exp-1", version=1, generation_id="gen-1"),)
    episodes = [*_episodes(0, [True, False, False, True]),
                *_episodes(1, [True, True, False, False], bank_offset=1, served=served)]
    return {
        "runs": [_started()],
        "trajectories": episodes,
        "ops": [_added(1), _added(2)],
        "extractions": [_distillation(episode, "parse_error" if i % 3 == 0 else "ok")
                        for i, episode in enumerate(episodes)],
    }


@pytest.mark.parametrize("seed", range(5))
def test_the_entries_do_not_depend_on_the_order_across_topics(seed):
    topics = _run_by_topic()
    in_order = fold((event, offset) for events in topics.values() for offset, event in enumerate(events))
    rng = random.Random(seed)
    queues = {name: list(enumerate(events)) for name, events in topics.items()}
    interleaved = []
    while any(queues.values()):  # each topic keeps its own order, as a consumer reading partitions sees
        name = rng.choice([n for n, queue in queues.items() if queue])
        offset, event = queues[name].pop(0)
        interleaved.append((event, offset))
    assert as_table(fold(interleaved)) == as_table(in_order)
    # config; per step 7 scalars, samples, 3 parse shares and the generations; the bank: 7 scalars and the ops written
    assert len(as_table(in_order)) == 32


def test_a_restarted_tracker_writes_each_entry_once(tmp_path):
    topics = _run_by_topic()
    events = [(event, offset) for topic in topics.values() for offset, event in enumerate(topic)]
    first = Tracker([TensorBoardBackend(tmp_path / "tensorboard")], tmp_path, RUN)
    for event, offset in events[:4]:
        first.add(event, offset)
    first.close()
    second = Tracker([TensorBoardBackend(tmp_path / "tensorboard")], tmp_path, RUN)  # folds from offset 0 again
    for event, offset in events:
        second.add(event, offset)
    second.close()
    assert (first.written, second.written) == (1, 31)  # the first saw only RunStarted of what it shows
    written = tensorboard_entries(tmp_path / "tensorboard")
    expected = as_table(fold(events))
    assert set(written) == set(expected)
    assert all(written[key] == pytest.approx(value, rel=1e-6) if isinstance(value, float) else written[key] == value
               for key, value in expected.items())
    [scalar_file, *_] = sorted((tmp_path / "tensorboard").iterdir())
    assert scalar_file.name.startswith("events.out.tfevents.")


def test_the_warm_start_loss_is_shown_against_its_own_steps_once_each():
    tracking = RunTracking()
    tracking.add(_started(), 0)

    def progress(phase: str, done: int, loss: float | None) -> WarmStartProgressed:
        return WarmStartProgressed(run_id=RUN, producer=WHO, role="actor", phase=phase, done=done, total=250,
                                   loss=loss, elapsed_s=1.0)

    entries = [entry for event in (progress("data", 10, None), progress("train", 1, 2.5), progress("train", 250, 0.75),
                                   progress("done", 250, 0.75), progress("train", 1, 2.5))
               for entry in tracking.add(event, 0)]
    assert _scalars(entries) == {("warm_start/actor/loss", 1): 2.5, ("warm_start/actor/loss", 250): 0.75}
