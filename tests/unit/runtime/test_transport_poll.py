"""A consumer poll that rides through the retriable errors kafka-python raises while a broker restarts."""

from __future__ import annotations

from typing import Any

import pytest
from kafka import TopicPartition
from kafka.errors import KafkaConnectionError, OffsetOutOfRangeError

from pipeline.runtime.transport import poll_through_outages

RECORDS = {TopicPartition("crl.trajectories", 0): ["a record"]}


class Consumer:
    """Answers each poll with the next of `answers`: an exception is raised, anything else returned."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.polls = 0

    def poll(self, timeout_ms: int) -> Any:
        self.polls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_lost_connection_is_answered_with_no_records_and_the_next_poll_reads_on():
    consumer = Consumer(KafkaConnectionError("socket disconnected"), RECORDS)
    assert poll_through_outages(consumer, 10) == {}
    assert poll_through_outages(consumer, 10) == RECORDS
    assert consumer.polls == 2


def test_an_error_that_is_not_retriable_is_raised():
    consumer = Consumer(OffsetOutOfRangeError("past the end"))
    with pytest.raises(OffsetOutOfRangeError):
        poll_through_outages(consumer, 10)
