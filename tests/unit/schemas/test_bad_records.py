"""The bad-record catalogue itself: at least 30 kinds on every topic, each decoding exactly as it says it will.

Run: pytest tests/unit/schemas/test_bad_records.py
"""

from __future__ import annotations

from collections import Counter

import pytest

from schemas.bad_records import bad_records
from schemas.codec import EventDecodeError, decode
from schemas.topics import TOPICS, topic_named

CATALOGUE = bad_records("catalogue-run")


def test_every_topic_gets_at_least_30_kinds_of_bad_record_with_unique_names() -> None:
    per_topic = Counter(record.topic for record in CATALOGUE)
    assert set(per_topic) == {topic.name for topic in TOPICS}
    assert min(per_topic.values()) >= 30, per_topic
    assert len({record.name for record in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("record", CATALOGUE, ids=[record.name for record in CATALOGUE])
def test_each_record_decodes_as_the_catalogue_says(record) -> None:
    if record.dead_letter:
        with pytest.raises(EventDecodeError) as raised:
            decode(topic_named(record.topic), record.value)
        assert type(raised.value).__name__ == record.expect
    else:
        assert decode(topic_named(record.topic), record.value).run_id in {"catalogue-run", "another-run"}
