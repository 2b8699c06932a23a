"""Consumer-group commits kept in the run's database, beside Kafka's, for carrying a group on over a restored log.

A group worker (rollout, extractor) commits its offsets to Kafka. When the broker is the memory-only Tansu and dies,
those commits die with it; `crl run --resume` restores the log from the archive (`pipeline.run.restore`), and then
needs to know where each group was. Every commit is therefore also written to `group_commits` (`infra.db`), with
what the committing instance had produced by then (`produced_ends`), because a commit is only as good as the outputs
behind it: the archive may end a little before the broker did, and a commit whose outputs lie past that end covers
inputs whose outputs are gone. The restored group starts from its latest commit whose outputs were all restored and
re-reads from there (at least once: the workers' outputs carry ids derived from their inputs, so a re-read that
repeats an output repeats its id).

    commits = GroupCommitLog(engine, group_id="crl-rollout", instance="rollout-0", produced_ends=output.produced_ends)
    commits.record({("crl.tasks", 0): LogPosition(12, "Yx9...")})
    restorable_group_positions(engine, log_ends)   # {"crl-rollout": {("crl.tasks", 0): 12}, ...}
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from sqlalchemy import Engine, insert, select

from infra.db import group_commits, transient_database_errors
from pipeline.runtime.offsets import LogPosition, TopicPartition


def _partition_name(position: TopicPartition) -> str:
    return f"{position[0]}/{position[1]}"


class GroupCommitLog:
    """The commits of one group member, appended to `group_commits`."""

    def __init__(self, engine: Engine, group_id: str, instance: str,
                 produced_ends: Callable[[], Mapping[TopicPartition, int]]) -> None:
        self.engine = engine
        self.group_id = group_id
        self.instance = instance
        self.produced_ends = produced_ends

    def record(self, positions: Mapping[TopicPartition, LogPosition]) -> None:
        """Append one row per committed partition (one transaction). Raises `RetryableError` while the database is
        away."""
        if not positions:
            return
        produced = json.dumps({_partition_name(p): end for p, end in sorted(self.produced_ends().items())})
        now = datetime.now(UTC)
        rows = [{"group_id": self.group_id, "instance": self.instance, "topic": topic, "partition": partition,
                 "next_offset": position.next_offset, "log_id": position.log_id, "produced_ends": produced,
                 "committed_at": now} for (topic, partition), position in sorted(positions.items())]
        with transient_database_errors(f"recording {self.group_id}'s commit"), self.engine.begin() as connection:
            connection.execute(insert(group_commits), rows)


def restorable_group_positions(engine: Engine, log_ends: Mapping[TopicPartition, LogPosition]
                               ) -> dict[str, dict[TopicPartition, int]]:
    """Per group, per input partition: the offset of its latest commit in the restored log (`log_ends`: where each
    partition of it ends, and its log id) whose outputs all lie within it, capped at the partition's end. A
    partition with no such commit is left out (the group reads it from the start)."""
    columns = group_commits.c
    query = select(columns.group_id, columns.topic, columns.partition, columns.next_offset, columns.log_id,
                   columns.produced_ends).order_by(columns.id)
    with transient_database_errors("reading the group commits"), engine.connect() as connection:
        rows = list(connection.execute(query))
    restorable: dict[str, dict[TopicPartition, int]] = {}
    for group_id, topic, partition, next_offset, log_id, produced_ends in rows:
        end = log_ends.get((topic, partition))
        if end is None or end.log_id != log_id:
            continue  # a commit in another log (a topic re-created since) says nothing about this one
        outputs = {_position(name): output_end for name, output_end in json.loads(produced_ends).items()}
        if all(p in log_ends and output_end <= log_ends[p].next_offset for p, output_end in outputs.items()):
            restorable.setdefault(group_id, {})[(topic, partition)] = min(next_offset, end.next_offset)
    return restorable


def _position(name: str) -> TopicPartition:
    topic, _, partition = name.rpartition("/")
    return topic, int(partition)
