"""`crl replay train` on an extractor step whose batch holds a generation published twice under its id: first with a
parse error, then distilled again with other tokens and parsed. The trainer's join skips the parse error and trains on
the second copy; the replay must rebuild that copy, not the first record of the id (no broker, tiny preset)."""

from __future__ import annotations

from pathlib import Path

from pipeline.audit.archive import archive_root, archive_row, write_segments
from pipeline.audit.training_replay import replay_training
from pipeline.extractor.ops import generation_event_id
from pipeline.models.settings import ModelSettings, TinyModelSettings
from pipeline.rl.batching import ExtractorJoin, trained_copies
from pipeline.rl.settings import ExtractorTrainerSettings
from pipeline.rl.trainer import PolicyTrainer, events_of
from pipeline.rl.versions import checkpoints_root
from schemas.base import Event, Producer
from schemas.extractions import ExtractionGenerated
from schemas.topics import topic_of
from schemas.trajectories import ExperienceRef, Timings, TrajectoryCompleted, Turn

TINY = TinyModelSettings(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         vocab_size=512, corpus_episodes=4)
SETTINGS = ExtractorTrainerSettings(model=ModelSettings(tiny=TINY), lr=1e-3, threads=1, buffer_size=2)
WHO = Producer(worker="test", instance="test-0")


def _generation(generation_id: str, response: tuple[int, ...], status: str = "ok") -> ExtractionGenerated:
    return ExtractionGenerated(
        event_id=generation_event_id(generation_id), run_id="run", producer=WHO, generation_id=generation_id,
        extractor_version=0, purpose="distill",
        task_family="f", prompt_token_ids=(5, 6, 7), response_token_ids=response,
        sampling_logprobs=tuple(-1.0 - 0.1 * i for i in range(len(response))),
        response_text="x", parse_status=status, op_ids=(f"{generation_id}:0",) if status == "ok" else (),
        parse_error="bad" if status == "parse_error" else None)


def _guided(slot: int, success: bool, served: tuple[str, ...]) -> TrajectoryCompleted:
    return TrajectoryCompleted(
        run_id="run", producer=WHO, trajectory_id=f"t-{slot}", assignment_event_id="a", step=1, split="train",
        env_id="e", task_family="f", seed=1, group_id="g", slot=slot, guided=True, goal="g",
        turns=(Turn(observation="o", prompt_token_ids=(1, 2), response_token_ids=(3,), sampling_logprobs=(-1.0,),
                    response_text="x", action="x", valid=True, reward=float(success)),),
        reward=float(success), success=success, num_actions=1, invalid_actions=0, truncated=False,
        retrieved=tuple(ExperienceRef(experience_id=f"x-{g}", version=1, generation_id=g) for g in served),
        bank_offset=0, policy_version=0, timings=Timings(generation_s=0, env_s=0, retrieval_s=0))


def test_the_replay_trains_on_the_copy_the_join_kept(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    trainer = PolicyTrainer("extractor", SETTINGS, checkpoints_root(run_dir, "extractor"), "run",
                            Producer(worker="extractor_trainer", instance="t"))
    # "gb" is distilled twice under the same event id: a parse error first, then parsed with other tokens.
    log: list[Event] = [_generation("ga", (10, 11, 12)), _generation("gb", (20, 21, 22, 23), "parse_error"),
                        _generation("gb", (30, 31)), _guided(0, True, ("ga",)), _guided(1, False, ("gb",))]
    assert log[1].event_id == log[2].event_id
    join = ExtractorJoin()
    for event in log:
        if isinstance(event, ExtractionGenerated):
            join.add_extraction(event)
        elif isinstance(event, TrajectoryCompleted):
            join.add_trajectory(event)
    batch = join.batch(1, SETTINGS.buffer_size, SETTINGS.count_alpha, SETTINGS.count_delta)
    assert batch is not None and str(log[2].event_id) in batch.event_ids
    assert trained_copies(e for e in log if isinstance(e, ExtractionGenerated))[str(log[2].event_id)] is log[2]
    before = trainer.weight_hash
    result = trainer.step(batch.samples)
    recorded = trainer.train_step_event(
        step=1, batch_event_ids=batch.event_ids, weight_hash_before=before, weight_hash_after=trainer.weight_hash,
        loss=result.loss, tokens=result.tokens, metrics={}, rewards=batch.rewards, advantages=batch.advantages,
        outcome_counts=batch.outcome_counts)
    events = [*events_of(trainer.current), *log, *events_of(trainer.save(recorded))]
    rows = [archive_row(event, topic_of(event).name, 0, offset, 0, b"k", log_id="log-1")
            for offset, event in enumerate(events)]
    write_segments(archive_root(run_dir), rows)

    report = replay_training(run_dir, "extractor")
    assert report.ok, report.problem
    assert [(c.step, c.version, c.ok) for c in report.checks] == [(1, 1, True)]
