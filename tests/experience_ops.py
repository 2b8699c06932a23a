"""Experience ops for tests, one factory per op kind: `add`, `refine`, `merge`, `retire`, and `key` for their
embedding keys. Each takes the op's identity and what the test varies; the rest gets a fixed value (run "r", the
extractor's producer, a generation id and a source trajectory named after the op id). `**envelope` overrides any
other field (`run_id`, `occurred_at`, `producer`, `extractor_version`, ...).

    from experience_ops import add, key, merge, refine, retire
    ops = [add("o1", "e1"), refine("o2", "e1", 1, "walk diagonally"), retire("o3", "e1", 2)]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from schemas.arrays import EmbeddingVector
from schemas.base import Producer
from schemas.experiences import (
    ExperienceAdded,
    ExperienceMerged,
    ExperienceRefined,
    ExperienceRetired,
    VersionedExperience,
)

WHO = Producer(worker="extractor", instance="extractor-0")
MODEL = "all-MiniLM-L6-v2"


def key(*values: float, model: str = MODEL) -> EmbeddingVector:
    """An embedding key of these values (default: the unit vector (1, 0, 0, 0))."""
    return EmbeddingVector.from_array(model, np.array(values or (1.0, 0.0, 0.0, 0.0)))


def _envelope(op_id: str, envelope: dict[str, Any]) -> dict[str, Any]:
    return {"run_id": "r", "producer": WHO, "op_id": op_id, "generation_id": f"gen-{op_id}", **envelope}


def add(op_id: str, experience_id: str, text: str = "go to the stairs", family: str = "room",
        vector: EmbeddingVector | None = None, **envelope: Any) -> ExperienceAdded:
    fields = {"extractor_version": 0, "source_trajectory_ids": (f"traj-{op_id}",), **envelope}
    return ExperienceAdded(**_envelope(op_id, fields), experience_id=experience_id, task_family=family, text=text,
                           key=vector or key())


def refine(op_id: str, experience_id: str, expected: int, text: str, **envelope: Any) -> ExperienceRefined:
    fields = {"extractor_version": 1, "source_trajectory_ids": (f"traj-{op_id}",), **envelope}
    return ExperienceRefined(**_envelope(op_id, fields), experience_id=experience_id, expected_version=expected,
                             text=text)


def merge(op_id: str, experience_id: str, sources: dict[str, int], family: str = "room", **envelope: Any
          ) -> ExperienceMerged:
    """Merges `sources` (experience id -> the version it is expected at) into `experience_id`."""
    fields = {"extractor_version": 1, "text": f"merged {'+'.join(sources)}", "key": key(0.0, 1.0, 0.0, 0.0),
              **envelope}
    return ExperienceMerged(**_envelope(op_id, fields), experience_id=experience_id, task_family=family,
                            sources=tuple(VersionedExperience(experience_id=i, expected_version=v)
                                          for i, v in sources.items()))


def retire(op_id: str, experience_id: str, expected: int, reason: str = "capacity", **envelope: Any
           ) -> ExperienceRetired:
    fields = _envelope(op_id, envelope)
    del fields["generation_id"]  # a retire is the bank's, not a generation's
    return ExperienceRetired(**fields, experience_id=experience_id, expected_version=expected, reason=reason)
