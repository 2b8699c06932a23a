"""The topic registry: every topic's name, partition count, key, event union and retention, declared once.

Code refers to these objects, never to topic-name strings. Partition counts are final: the embedded broker cannot
add partitions later (see docs/kafka.md), so pick them for the largest scale-out you expect. `crl.experience-ops`
has exactly one partition so every bank replica applies the same ops in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated, Any

from pydantic import ConfigDict, Field, TypeAdapter

from schemas.bank import BankSnapshotWritten
from schemas.base import Event
from schemas.dead_letters import DeadLetter
from schemas.experiences import ExperienceAdded, ExperienceMerged, ExperienceRefined, ExperienceRetired
from schemas.extractions import ExtractionGenerated
from schemas.runs import MergeRequested, RunFinished, RunResumed, RunStarted, StepSettled, StopRequested
from schemas.tasks import EpisodeAssigned
from schemas.training import PolicyPublished, TrainStepCompleted, WarmStartProgressed
from schemas.trajectories import TrajectoryCompleted

FOREVER = -1
WEEK_MS = 7 * 24 * 3600 * 1000

# One discriminated union and one TypeAdapter per topic.
RunEvent = Annotated[RunStarted | RunFinished, Field(discriminator="kind")]
ControlEvent = Annotated[MergeRequested | StopRequested | RunResumed, Field(discriminator="kind")]
TaskEvent = EpisodeAssigned
TrajectoryEvent = TrajectoryCompleted
ExtractionEvent = ExtractionGenerated
ExperienceOp = Annotated[
    ExperienceAdded | ExperienceRefined | ExperienceMerged | ExperienceRetired, Field(discriminator="kind")
]
PolicyEvent = PolicyPublished
TrainStepEvent = Annotated[TrainStepCompleted | WarmStartProgressed | StepSettled, Field(discriminator="kind")]
BankSnapshotEvent = BankSnapshotWritten
DeadLetterEvent = DeadLetter

RUN_EVENTS: TypeAdapter[Any] = TypeAdapter(RunEvent)
CONTROL_EVENTS: TypeAdapter[Any] = TypeAdapter(ControlEvent)
TASK_EVENTS: TypeAdapter[Any] = TypeAdapter(TaskEvent)
TRAJECTORY_EVENTS: TypeAdapter[Any] = TypeAdapter(TrajectoryEvent)
EXTRACTION_EVENTS: TypeAdapter[Any] = TypeAdapter(ExtractionEvent)
# No string cache on the op log: its strings are mostly unique (ids, texts, a 1 KB base64 key per op), so interning
# them cost more than it saved (validate_json 9.4 vs 10.6 us of CPU per ExperienceAdded record of bank_replay's log).
# Speed only: the cache never changes what validates or the values made.
EXPERIENCE_OPS: TypeAdapter[Any] = TypeAdapter(ExperienceOp, config=ConfigDict(cache_strings=False))
POLICY_EVENTS: TypeAdapter[Any] = TypeAdapter(PolicyEvent)
TRAIN_STEP_EVENTS: TypeAdapter[Any] = TypeAdapter(TrainStepEvent)
BANK_SNAPSHOT_EVENTS: TypeAdapter[Any] = TypeAdapter(BankSnapshotEvent)
DEAD_LETTER_EVENTS: TypeAdapter[Any] = TypeAdapter(DeadLetterEvent)


@dataclass(frozen=True)
class Topic:
    """A Kafka topic as this project declares it."""

    name: str
    partitions: int
    events: tuple[type[Event], ...]
    adapter: TypeAdapter[Any] = field(repr=False)
    key: Callable[[Any], str] = field(repr=False)
    retention_ms: int
    description: str

    def key_bytes(self, event: Event) -> bytes:
        return self.key(event).encode("utf-8")

    @cached_property
    def kinds(self) -> tuple[str, ...]:
        """Names of the event kinds this topic carries (computed once: `decode` asks for every record)."""
        return tuple(event.__name__ for event in self.events)


RUNS = Topic(
    name="crl.runs",
    partitions=1,
    events=(RunStarted, RunFinished),
    adapter=RUN_EVENTS,
    key=lambda e: e.run_id,
    retention_ms=FOREVER,
    description="Run lifecycle: resolved config and code version at start, status at the end.",
)
CONTROL = Topic(
    name="crl.control",
    partitions=1,
    events=(MergeRequested, StopRequested, RunResumed),
    adapter=CONTROL_EVENTS,
    key=lambda e: e.run_id,
    retention_ms=FOREVER,
    description="Requests to the run's workers: merge the bank, stop, resume (`crl run --resume`).",
)
TASKS = Topic(
    name="crl.tasks",
    partitions=8,
    events=(EpisodeAssigned,),
    adapter=TASK_EVENTS,
    key=lambda e: e.group_id,
    retention_ms=WEEK_MS,
    description="Episode assignments; a group's slots share a partition. Archived, so a week is enough on Kafka.",
)
TRAJECTORIES = Topic(
    name="crl.trajectories",
    partitions=8,
    events=(TrajectoryCompleted,),
    adapter=TRAJECTORY_EVENTS,
    key=lambda e: e.group_id,
    retention_ms=FOREVER,
    description="Finished episodes with token ids, sampling log-probs, rewards and served experiences.",
)
EXTRACTIONS = Topic(
    name="crl.extractions",
    partitions=8,
    events=(ExtractionGenerated,),
    adapter=EXTRACTION_EVENTS,
    key=lambda e: e.generation_id,
    retention_ms=FOREVER,
    description="Extractor generations: the CISPO samples and the origin of every experience op.",
)
EXPERIENCE_OPS_TOPIC = Topic(
    name="crl.experience-ops",
    partitions=1,
    events=(ExperienceAdded, ExperienceRefined, ExperienceMerged, ExperienceRetired),
    adapter=EXPERIENCE_OPS,
    key=lambda e: e.experience_id,
    retention_ms=FOREVER,
    description="The experience bank's system of record; one partition so every replica sees one order.",
)
POLICY = Topic(
    name="crl.policy",
    partitions=1,
    events=(PolicyPublished,),
    adapter=POLICY_EVENTS,
    key=lambda e: e.role,
    retention_ms=FOREVER,
    description="New actor and extractor checkpoints (uri + sha256).",
)
TRAIN_STEPS = Topic(
    name="crl.train-steps",
    partitions=1,
    events=(TrainStepCompleted, WarmStartProgressed, StepSettled),
    adapter=TRAIN_STEP_EVENTS,
    key=lambda e: e.role,
    retention_ms=FOREVER,
    description="Every optimiser step: its batch in order, weight hashes before/after, metrics; how far each "
    "trainer's warm start has come; in deterministic mode, the steps the extractor trainer and the extractor settled.",
)
BANK_SNAPSHOTS = Topic(
    name="crl.bank-snapshots",
    partitions=1,
    events=(BankSnapshotWritten,),
    adapter=BANK_SNAPSHOT_EVENTS,
    key=lambda e: e.run_id,
    retention_ms=FOREVER,
    description="Durable bank snapshots replicas may start from.",
)
DEAD_LETTERS = Topic(
    name="crl.dead-letters",
    partitions=1,
    events=(DeadLetter,),
    adapter=DEAD_LETTER_EVENTS,
    key=lambda e: e.source_topic,
    retention_ms=FOREVER,
    description="Records a worker could not process, with the reason and the raw bytes.",
)

TOPICS: tuple[Topic, ...] = (
    RUNS,
    CONTROL,
    TASKS,
    TRAJECTORIES,
    EXTRACTIONS,
    EXPERIENCE_OPS_TOPIC,
    POLICY,
    TRAIN_STEPS,
    BANK_SNAPSHOTS,
    DEAD_LETTERS,
)
TOPICS_BY_NAME: dict[str, Topic] = {topic.name: topic for topic in TOPICS}
EVENT_TYPES: dict[str, type[Event]] = {event.__name__: event for topic in TOPICS for event in topic.events}
TOPIC_OF_KIND: dict[str, Topic] = {event.__name__: topic for topic in TOPICS for event in topic.events}


def topic_named(name: str) -> Topic:
    """The registry entry for `name`; a name not in the registry raises `KeyError` listing the known ones."""
    try:
        return TOPICS_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown topic {name!r}; known topics: {', '.join(TOPICS_BY_NAME)}") from None


def topic_of(event: Event) -> Topic:
    """The topic an event is published to (each kind lives on exactly one topic)."""
    return TOPIC_OF_KIND[event.kind]
