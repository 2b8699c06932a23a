"""Event schemas, the topic registry and the codec. Imports nothing from the rest of the repository and does no I/O."""

from schemas.arrays import EmbeddingVector, Float16s, LogProbs, TokenIds
from schemas.bank import BankSnapshotWritten
from schemas.base import Event, Id, Producer
from schemas.codec import EventDecodeError, decode, encode
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
from schemas.topics import EVENT_TYPES, TOPICS, Topic, topic_named, topic_of
from schemas.training import PolicyPublished, TrainStepCompleted, WarmStartProgressed
from schemas.trajectories import ExperienceRef, Timings, TrajectoryCompleted, Turn

__all__ = [
    "EVENT_TYPES", "TOPICS", "BankSnapshotWritten", "DeadLetter", "EmbeddingVector", "EpisodeAssigned", "Event",
    "EventDecodeError", "ExperienceAdded", "ExperienceMerged", "ExperienceRef", "ExperienceRefined",
    "ExperienceRetired", "ExtractionGenerated", "Float16s", "Id", "LogProbs", "MergeRequested", "PolicyPublished",
    "Producer", "RunFinished", "RunResumed", "RunStarted", "StepSettled", "StopRequested", "Timings", "TokenIds",
    "Topic", "TrainStepCompleted", "TrajectoryCompleted", "Turn", "VersionedExperience", "WarmStartProgressed",
    "decode", "encode", "topic_named", "topic_of",
]
