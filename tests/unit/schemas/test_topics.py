"""The topic registry (`schemas/topics.py`): names, partitions, kinds, adapters, keys and retention.

Run: pytest tests/unit/schemas/test_topics.py
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from pydantic import ValidationError

from schemas.base import Event
from schemas.codec import encode
from schemas.examples import example_events
from schemas.topics import (
    BANK_SNAPSHOTS,
    CONTROL,
    DEAD_LETTERS,
    EVENT_TYPES,
    EXPERIENCE_OPS_TOPIC,
    EXTRACTIONS,
    FOREVER,
    POLICY,
    RUNS,
    TASKS,
    TOPIC_OF_KIND,
    TOPICS,
    TOPICS_BY_NAME,
    TRAIN_STEPS,
    TRAJECTORIES,
    WEEK_MS,
    Topic,
    topic_named,
    topic_of,
)

EXAMPLES: dict[str, Event] = {event.kind: event for event in example_events()}


def test_topic_names_are_unique_and_namespaced() -> None:
    names = [topic.name for topic in TOPICS]
    assert len(names) == len(set(names))
    assert all(name.startswith("crl.") for name in names)
    assert set(TOPICS_BY_NAME) == set(names)


def test_registry_holds_the_topics_of_the_design() -> None:
    assert [topic.name for topic in TOPICS] == [
        "crl.runs",
        "crl.control",
        "crl.tasks",
        "crl.trajectories",
        "crl.extractions",
        "crl.experience-ops",
        "crl.policy",
        "crl.train-steps",
        "crl.bank-snapshots",
        "crl.dead-letters",
    ]


def test_experience_ops_has_exactly_one_partition() -> None:
    assert topic_named("crl.experience-ops") is EXPERIENCE_OPS_TOPIC
    assert EXPERIENCE_OPS_TOPIC.partitions == 1


def test_single_partition_topics_of_the_design() -> None:
    for topic in (RUNS, CONTROL, EXPERIENCE_OPS_TOPIC, POLICY, TRAIN_STEPS, BANK_SNAPSHOTS, DEAD_LETTERS):
        assert topic.partitions == 1, topic.name
    for topic in (TASKS, TRAJECTORIES, EXTRACTIONS):
        assert topic.partitions >= 1, topic.name


def test_every_kind_is_carried_by_exactly_one_topic() -> None:
    counts = Counter(kind for topic in TOPICS for kind in topic.kinds)
    assert set(counts) == set(EVENT_TYPES)
    assert {kind: n for kind, n in counts.items() if n != 1} == {}
    for kind, topic in TOPIC_OF_KIND.items():
        assert kind in topic.kinds
        assert EVENT_TYPES[kind].__name__ == kind


def test_kinds_per_topic() -> None:
    assert {topic.name: topic.kinds for topic in TOPICS} == {
        "crl.runs": ("RunStarted", "RunFinished"),
        "crl.control": ("MergeRequested", "StopRequested", "RunResumed"),
        "crl.tasks": ("EpisodeAssigned",),
        "crl.trajectories": ("TrajectoryCompleted",),
        "crl.extractions": ("ExtractionGenerated",),
        "crl.experience-ops": ("ExperienceAdded", "ExperienceRefined", "ExperienceMerged", "ExperienceRetired"),
        "crl.policy": ("PolicyPublished",),
        "crl.train-steps": ("TrainStepCompleted", "WarmStartProgressed", "StepSettled"),
        "crl.bank-snapshots": ("BankSnapshotWritten",),
        "crl.dead-letters": ("DeadLetter",),
    }


@pytest.mark.parametrize("event", example_events(), ids=lambda event: event.kind)
def test_topic_of_an_event_carries_its_kind(event: Event) -> None:
    assert event.kind in topic_of(event).kinds


@pytest.mark.parametrize("topic", TOPICS, ids=lambda topic: topic.name)
def test_adapter_validates_its_own_examples(topic: Topic) -> None:
    for kind in topic.kinds:
        event = EXAMPLES[kind]
        from_python = topic.adapter.validate_python(event.model_dump())
        from_json = topic.adapter.validate_json(encode(event))
        assert from_python == event and type(from_python) is type(event)
        assert from_json == event and type(from_json) is type(event)


@pytest.mark.parametrize("topic", TOPICS, ids=lambda topic: topic.name)
def test_adapter_rejects_kinds_of_other_topics(topic: Topic) -> None:
    foreign = [event for kind, event in EXAMPLES.items() if kind not in topic.kinds]
    assert foreign
    for event in foreign:
        with pytest.raises(ValidationError):
            topic.adapter.validate_python(event.model_dump())
        with pytest.raises(ValidationError):
            topic.adapter.validate_json(encode(event))


@pytest.mark.parametrize(
    ("kind", "key"),
    [
        ("RunStarted", b"example-run"),
        ("RunFinished", b"example-run"),
        ("MergeRequested", b"example-run"),
        ("StopRequested", b"example-run"),
        ("EpisodeAssigned", b"step1-task0"),
        ("TrajectoryCompleted", b"step1-task0"),
        ("ExtractionGenerated", b"gen-7"),
        ("ExperienceAdded", b"exp-2"),
        ("ExperienceRefined", b"exp-1"),
        ("ExperienceMerged", b"exp-9"),
        ("ExperienceRetired", b"exp-3"),
        ("PolicyPublished", b"actor"),
        ("TrainStepCompleted", b"actor"),
        ("BankSnapshotWritten", b"example-run"),
        ("DeadLetter", b"crl.trajectories"),
    ],
)
def test_record_keys(kind: str, key: bytes) -> None:
    event = EXAMPLES[kind]
    assert topic_of(event).key_bytes(event) == key


def test_record_keys_follow_the_key_field_not_a_constant() -> None:
    episode = EXAMPLES["EpisodeAssigned"]
    other_group = type(episode)(**{**episode.model_dump(), "group_id": "step9-task3"})
    assert TASKS.key_bytes(other_group) == b"step9-task3"
    run = EXAMPLES["RunFinished"]
    other_run = type(run)(**{**run.model_dump(), "run_id": "run-\u00e9"})
    assert RUNS.key_bytes(other_run) == "run-\u00e9".encode()
    policy = EXAMPLES["PolicyPublished"]
    assert POLICY.key_bytes(type(policy)(**{**policy.model_dump(), "role": "extractor"})) == b"extractor"


def test_topic_named_returns_registry_entries() -> None:
    for topic in TOPICS:
        assert topic_named(topic.name) is topic


def test_topic_named_lists_known_topics_for_an_unknown_name() -> None:
    with pytest.raises(KeyError) as excinfo:
        topic_named("nope")
    message = excinfo.value.args[0]
    assert message.startswith("unknown topic 'nope'; known topics: ")
    for topic in TOPICS:
        assert topic.name in message


def test_retention_keeps_everything_but_tasks_forever() -> None:
    assert FOREVER == -1
    assert TASKS.retention_ms == WEEK_MS == 604_800_000
    assert {topic.name: topic.retention_ms for topic in TOPICS if topic is not TASKS} == {
        topic.name: -1 for topic in TOPICS if topic is not TASKS
    }


def test_topics_are_frozen_and_described() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        RUNS.partitions = 3  # type: ignore[misc]
    assert all(topic.description for topic in TOPICS)
