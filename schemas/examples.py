"""One valid, realistic example of every event kind.

Used by `crl doctor` (round trip through Kafka) and by the tests; also a quick way to see what an event looks like:
`python -c "from schemas.examples import example_events; print(example_events()[3].model_dump_json(indent=2))"`.
"""

from __future__ import annotations

import hashlib

from schemas.arrays import EmbeddingVector
from schemas.bank import BankSnapshotWritten
from schemas.base import Event, Producer
from schemas.dead_letters import DeadLetter
from schemas.experiences import (
    ExperienceAdded,
    ExperienceMerged,
    ExperienceRefined,
    ExperienceRetired,
    VersionedExperience,
)
from schemas.extractions import ExtractionGenerated
from schemas.runs import MergeRequested, RunFinished, RunResumed, RunStarted, StepSettled, StopRequested
from schemas.tasks import EpisodeAssigned
from schemas.topics import EVENT_TYPES
from schemas.training import PolicyPublished, TrainStepCompleted, WarmStartProgressed
from schemas.trajectories import ExperienceRef, Timings, TrajectoryCompleted, Turn


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def example_events(run_id: str = "example-run") -> list[Event]:
    """Return one example per event kind, in registry order."""
    who = Producer(worker="example", instance="example-0")
    key = EmbeddingVector.from_array("all-MiniLM-L6-v2", [0.25, -0.5, 0.125, 1.0])
    served = ExperienceRef(experience_id="exp-1", version=2, generation_id="gen-7")
    common = {"run_id": run_id, "producer": who}
    events: list[Event] = [
        RunStarted(**common, config={"arm": "complementary", "steps": 3, "env": {"id": "MiniHack-Room-Random-5x5-v0"}},
                   code_version="0.1.0"),
        RunFinished(**common, status="completed", steps_completed=3),
        MergeRequested(**common, merge_id="merge-step-5", step=5, task_families=("minihack-room",)),
        StopRequested(**common, reason="operator pressed Ctrl-C"),
        RunResumed(**common, attempt=1, previous_status="stopped"),
        StepSettled(**common, role="extractor", step=2, extractor_version=1, bank_offset=41,
                    extraction_event_ids=("5d2f4a0c-0000-4000-8000-000000000002",)),
        EpisodeAssigned(**common, step=1, split="train", env_id="MiniHack-Room-Random-5x5-v0",
                        task_family="minihack-room", seed=1234, group_id="step1-task0", slot=2, group_size=4,
                        guided=True, policy_version=1, max_turns=30),
        TrajectoryCompleted(
            **common, trajectory_id="traj-step1-task0-2", assignment_event_id="5d2f4a0c-0000-4000-8000-000000000001",
            step=1, split="train", env_id="MiniHack-Room-Random-5x5-v0", task_family="minihack-room", seed=1234,
            group_id="step1-task0", slot=2, guided=True, goal="Reach the staircase down (>).",
            turns=(
                Turn(observation="You see a staircase down to the south-east.", prompt_token_ids=(5, 17, 300, 2),
                     response_token_ids=(41, 9), sampling_logprobs=(-0.105, -2.5), response_text="southeast",
                     action="southeast", valid=True, reward=0.0),
                Turn(observation="The staircase is south of you.", prompt_token_ids=(5, 17, 301, 2),
                     response_token_ids=(44,), sampling_logprobs=(-0.01,), response_text="south", action="south",
                     valid=True, reward=1.0),
            ),
            reward=1.0, success=True, num_actions=2, invalid_actions=0, truncated=False,
            final_observation="You descend the staircase.", revealed=("staircase down: 1 south, 1 east of the start",),
            retrieved=(served,),
            bank_offset=12, policy_version=1, timings=Timings(generation_s=0.21, env_s=0.003, retrieval_s=0.012),
        ),
        ExtractionGenerated(
            **common, generation_id="gen-7", extractor_version=0, purpose="distill", task_family="minihack-room",
            source_trajectory_ids=("traj-step1-task0-2",), shown=(served,), prompt_token_ids=(1, 2, 3, 4),
            response_token_ids=(7, 8, 9), sampling_logprobs=(-0.5, -0.25, -1.0),
            response_text='<answer>[{"op": "add", "text": "Head diagonally toward the stairs."}]</answer>',
            parse_status="ok", op_ids=("gen-7:0",),
        ),
        ExperienceAdded(**common, op_id="gen-7:0", experience_id="exp-2", task_family="minihack-room",
                        text="Head diagonally toward the stairs; walls stop you, so step around them.", key=key,
                        generation_id="gen-7", extractor_version=0, source_trajectory_ids=("traj-step1-task0-2",)),
        ExperienceRefined(**common, op_id="gen-8:0", experience_id="exp-1", expected_version=2,
                          text="Move toward '>' first; search only if it is not visible.", generation_id="gen-8",
                          extractor_version=1, source_trajectory_ids=("traj-step1-task0-3",)),
        ExperienceMerged(**common, op_id="merge-step-5:minihack-room:0:0", experience_id="exp-9",
                         task_family="minihack-room", text="Locate '>' and walk straight to it.", key=key,
                         sources=(VersionedExperience(experience_id="exp-1", expected_version=3),
                                  VersionedExperience(experience_id="exp-2", expected_version=1)),
                         generation_id="gen-12", extractor_version=1),
        ExperienceRetired(**common, op_id="evict:exp-3", experience_id="exp-3", expected_version=1,
                          reason="capacity"),
        PolicyPublished(**common, role="actor", version=2, step=2, checkpoint_uri="file:///runs/r/checkpoints/actor/2",
                        sha256=_sha("actor-2")),
        TrainStepCompleted(**common, role="actor", step=2, policy_version=2,
                           batch_event_ids=("0b8d4a0c-0000-4000-8000-000000000002",),
                           weight_hash_before=_sha("w1"), weight_hash_after=_sha("w2"), loss=-0.0123, tokens=812,
                           loss_variant="grpo", aggregation="token-mean",
                           metrics={"train/clip_fraction": 0.03, "rollout/success_guided": 0.75}),
        WarmStartProgressed(**common, role="actor", phase="train", done=120, total=250, loss=1.234,
                            elapsed_s=61.5),
        BankSnapshotWritten(**common, next_offset=40, state_hash=_sha("bank-40"), uri="file:///runs/r/bank/snap-40",
                            active_experiences=17, ops_applied=38),
        DeadLetter(**common, source_topic="crl.trajectories", source_partition=3, source_offset=118,
                   source_key_b64="c3RlcDEtdGFzazA=", raw_b64="bm90IGpzb24=", raw_size=8,
                   raw_sha256=hashlib.sha256(b"not json").hexdigest(), error_class="MalformedPayloadError",
                   error_message="not a JSON document: Expecting value: line 1 column 1 (char 0)"),
    ]
    missing = set(EVENT_TYPES) - {event.kind for event in events}
    if missing:
        raise AssertionError(f"examples missing for {sorted(missing)}")
    return events
