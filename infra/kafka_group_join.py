"""A fix for kafka-python 3.0.12's group join, which throws a finished join away, so a member that polls with short
timeouts never gets its partitions back after a rebalance.

kafka-python runs a member's JoinGroup -> SyncGroup exchange as a task on its IO thread and keeps the task between
polls, so a `poll` whose timeout ends first leaves it in flight for the next `poll` to await. But the next `poll`
tests `self._join_task is None or self._join_task.is_done` (`BaseCoordinator.join_group_async`) and starts a new
JoinGroup when the task has finished: a join that completed between two polls is dropped, its assignment is never
applied, `on_partitions_assigned` never runs, heartbeats stay off, and the new JoinGroup of a group's leader starts
another rebalance. A member polling with `timeout_ms=0` (our rollout worker while episodes are in flight) finishes a
join only when its SyncGroup answer happens to arrive inside one of its polls: the task is nearly always still in
flight when a poll returns, and done at the next. After a broker restart or any rebalance such a member held nothing
while the group's generation climbed (`tests/integration/test_kafka_group_join.py` makes a join finish between two
polls on Apache Kafka and shows it dropped, three times out of three).

A second path leaves a join unapplied without a later poll even looking at it. The consumer's `poll` calls
`ensure_active_group` only while `need_rejoin()` is true, and for a rejoin the group's leader started because the
topics' metadata changed (`assignment_snapshot != metadata_snapshot`: a topic appeared or grew partitions, or the
first join was assigned before the member knew the topic's partitions) `need_rejoin()` turns false the moment the
leader computes the new assignment, inside the join task, before its SyncGroup is answered. When that answer comes
after the poll's timeout, no later poll awaits the task: the member stays REBALANCING with heartbeats off and no
partitions, the coordinator drops it after the session timeout, and nothing tells it (CI saw a consumer that
subscribed right after its topic was created hold nothing for 60 s; 4 rounds in 60 reproduce it with two busy cores
beside, `tests/integration/test_kafka_group_join.py` makes the order certain).

`finish_completed_joins` installs two changes:
- `join_group_async`: when the kept task has finished, its result is applied first, exactly as kafka-python applies a
  join it awaited (state STABLE, heartbeats on, `_on_join_complete_async`, which assigns the partitions and calls the
  listener); a failed task is dropped and its error raised when kafka-python would raise it;
- `need_rejoin`: also true while a join task is kept (in flight or finished, not yet applied), so the next poll
  awaits or applies it: the Java client's `rejoinNeededOrPending()`.
Upstream would need `if self._join_task is None:` in place of that test (the failure branches already clear the
task), `need_rejoin` true while `_join_task` is set, and `rejoin_needed` cleared when JoinGroup succeeds rather than
after SyncGroup, as the Java client does.
"""

from __future__ import annotations

import inspect
import logging

from kafka import errors as Errors
from kafka.coordinator.base import BaseCoordinator, MemberState

log = logging.getLogger(__name__)

_BUGGY_TEST = "if self._join_task is None or self._join_task.is_done:"
_original_join_group_async = BaseCoordinator.join_group_async
_original_need_rejoin = BaseCoordinator.need_rejoin
_RETRIED_AT_ONCE = (Errors.UnknownMemberIdError, Errors.RebalanceInProgressError, Errors.IllegalGenerationError,
                    Errors.MemberIdRequiredError)


def needs_the_fix() -> bool:
    """Whether the installed kafka-python drops finished joins (the test above is in its `join_group_async`)."""
    return _BUGGY_TEST in inspect.getsource(_original_join_group_async)


async def _join_group_async(self: BaseCoordinator, timeout_ms: int | None = None) -> bool:
    task = self._join_task
    if task is not None and task.is_done:
        self._join_task = None
        if task.failed():
            error = task.exception
            # kafka-python retries these kinds (their side effects are already applied) and raises the rest.
            if not isinstance(error, (*_RETRIED_AT_ONCE, Errors.RetriableError)):
                raise error
            log.debug("Join attempt of group %s finished between polls with %r; joining again", self.group_id, error)
        else:
            with self._lock:
                # A heartbeat answered UNKNOWN_MEMBER_ID since (reset_generation) leaves the member UNJOINED: its
                # join is void, as kafka-python treats a JoinGroup answered after such a reset.
                current = self.state is MemberState.REBALANCING
                if current:
                    self.rejoining = False
                    self.rejoin_needed = False
                    self.state = MemberState.STABLE
                    self._enable_heartbeat()
            if current:
                log.debug("Join of group %s finished between polls; applying its assignment", self.group_id)
                generation = self._generation
                await self._on_join_complete_async(generation.generation_id, generation.member_id,
                                                   generation.protocol, task.value)
                if not self.need_rejoin():
                    return True
            else:
                log.debug("Join of group %s finished between polls after the member left its generation; joining "
                          "again", self.group_id)
    result: bool = await _original_join_group_async(self, timeout_ms=timeout_ms)
    return result


def _need_rejoin_or_pending(self: BaseCoordinator) -> bool:
    """kafka-python's `need_rejoin`, or a join task kept and not yet applied (the subclasses' own reasons to rejoin,
    such as the consumer's metadata snapshots, come first and fall through to this)."""
    return bool(_original_need_rejoin(self)) or self._join_task is not None


def finish_completed_joins() -> None:
    """Install the fix (idempotent) where the installed kafka-python needs it; `infra.kafka` calls this on import."""
    if BaseCoordinator.join_group_async is _original_join_group_async and needs_the_fix():
        BaseCoordinator.join_group_async = _join_group_async
        BaseCoordinator.need_rejoin = _need_rejoin_or_pending


def installed() -> bool:
    """Whether consumers created now join through the fix."""
    return (BaseCoordinator.join_group_async is _join_group_async
            and BaseCoordinator.need_rejoin is _need_rejoin_or_pending)
