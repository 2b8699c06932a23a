"""kafka-python's group join against real brokers: a member that polls without waiting (the rollout worker while its
episodes are in flight) gets its partitions back after a rebalance, also when the broker restarts in the middle of
one (`infra/kafka_group_join.py` says what kafka-python 3.0.12 does wrong and what the fix changes).

kafka-python's coordinator logs at DEBUG are captured for each test (`kafka.coordinator`): a failing test shows the
joins it saw.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kafka import ConsumerRebalanceListener, KafkaConsumer
from kafka.admin import NewPartitions, NewTopic
from kafka.coordinator.base import BaseCoordinator

from infra import kafka_group_join
from infra.kafka import KafkaSettings, make_admin, make_consumer, make_producer
from pipeline.errors import GroupMembershipLostError
from pipeline.runtime.transport import KafkaGroupInput
from schemas.topics import TASKS

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def coordinator_debug_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kafka.coordinator")
    caplog.set_level(logging.DEBUG, logger=kafka_group_join.__name__)


class Member(ConsumerRebalanceListener):
    """A group member that keeps what its rebalance listener was told, as our workers do."""

    def __init__(self, bootstrap: str, group: str, topic: str, name: str) -> None:
        self.owned: set[int] = set()
        self.assignments = 0
        self.consumer: KafkaConsumer = make_consumer(KafkaSettings(bootstrap_servers=bootstrap), group_id=group,
                                                     client_id=name)
        self.consumer.subscribe([topic], listener=self)

    def on_partitions_revoked(self, revoked: object) -> None:
        self.owned = set()

    def on_partitions_assigned(self, assigned: list) -> None:  # type: ignore[override]
        self.owned = {tp.partition for tp in assigned}
        self.assignments += 1

    @property
    def generation(self) -> int:
        return int(self.consumer._coordinator._generation.generation_id)

    def poll_until(self, done: Callable[[], bool], timeout_ms: int, within_s: float, pause_s: float = 0.0) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            self.consumer.poll(timeout_ms=timeout_ms)
            if done():
                return True
            time.sleep(pause_s)
        return False


@contextmanager
def _second_member_joining(bootstrap: str, group: str) -> Iterator[tuple[Member, Member]]:
    """Member A, holding every partition once it is in the group, and member B joining beside it and polling with
    200 ms in a thread until the block ends; both are closed then."""
    first = Member(bootstrap, group, TASKS.name, f"{group}-a")
    second: Member | None = None
    stop = threading.Event()
    thread: threading.Thread | None = None
    try:
        assert first.poll_until(lambda: bool(first.owned), timeout_ms=1000, within_s=30), "no first assignment"
        second = Member(bootstrap, group, TASKS.name, f"{group}-b")
        member = second

        def poll_second() -> None:
            while not stop.is_set():
                member.consumer.poll(timeout_ms=200)

        thread = threading.Thread(target=poll_second, daemon=True)
        thread.start()
        yield first, second
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=30)
        first.consumer.close(timeout_ms=1000)
        if second is not None:
            second.consumer.close(timeout_ms=1000)


def _second_member_joins(bootstrap: str, group: str) -> tuple[bool, int, set[int], set[int]]:
    """Member A polls with `timeout_ms=0` and a 50 ms turn between polls while member B joins. Whether within 10 s
    each holds its half (the range assignor), how many generations the group went through meanwhile, and what each
    holds at the end."""
    with _second_member_joining(bootstrap, group) as (first, second):
        before = first.generation
        half = TASKS.partitions // 2
        shared = first.poll_until(lambda: len(first.owned) == half and len(second.owned) == half, timeout_ms=0,
                                  within_s=10, pause_s=0.05)
        return shared, first.generation - before, set(first.owned), set(second.owned)


def test_a_member_polling_without_waiting_gets_its_partitions_after_a_rebalance(kafka_bootstrap, report_measurement):
    assert kafka_group_join.installed(), "infra.kafka installs the join fix on import"
    shared, generations, first, second = _second_member_joins(kafka_bootstrap, "crl-join-fixed")
    assert shared, f"after 10 s: A holds {sorted(first)}, B {sorted(second)}; {generations} generations went by"
    assert first | second == set(range(TASKS.partitions))
    assert generations <= 2, f"{generations} generations for one member joining"
    report_measurement(f"a member joins beside one polling with timeout_ms=0: {generations} generation(s), "
                       "each holds its half")


def _polls_after_finished_joins(bootstrap: str, group: str, rounds: int) -> list[tuple[set[int], int]]:
    """The defect's exact order, without timing left to chance: while member B joins, `rounds` times, the test waits
    until member A's join task has finished *without polling A*, then A polls once with `timeout_ms=0`. Returns what A
    holds and its generation after each of those polls."""
    seen: list[tuple[set[int], int]] = []
    with _second_member_joining(bootstrap, group) as (first, _second):
        coordinator = first.consumer._coordinator
        deadline = time.monotonic() + 30
        while coordinator._join_task is None:  # B's JoinGroup starts a rebalance; A learns it from a heartbeat
            assert time.monotonic() < deadline, "A never began a join"
            first.consumer.poll(timeout_ms=0)
            time.sleep(0.05)
        for _ in range(rounds):
            deadline = time.monotonic() + 30
            while not (coordinator._join_task is not None and coordinator._join_task.is_done):
                assert time.monotonic() < deadline, "A's join task never finished"
                time.sleep(0.05)
            first.consumer.poll(timeout_ms=0)
            seen.append((set(first.owned), first.generation))
    return seen


def test_a_join_that_finished_between_polls_is_applied_at_the_next(kafka_bootstrap):
    assert kafka_group_join.installed(), "infra.kafka installs the join fix on import"
    [(held, _generation)] = _polls_after_finished_joins(kafka_bootstrap, "crl-join-between-polls", rounds=1)
    assert held == set(range(TASKS.partitions // 2)), f"A holds {sorted(held)} after its finished join"


def _leader_after_a_rejoin_for_new_partitions(bootstrap: str, topic: str) -> tuple[Member, list[set[int]]]:
    """The second path, in its exact order: the group's only member (its leader) holds the one partition of `topic`;
    the topic grows a second partition; once the member's metadata says so, a poll with `timeout_ms=0` starts the
    rejoin, the test waits until the join task has finished without polling, then polls three times. What the member
    holds after each of those polls."""
    admin = make_admin(KafkaSettings(bootstrap_servers=bootstrap))
    try:
        admin.create_topics([NewTopic(topic, 1, 1)])
        leader = Member(bootstrap, f"{topic}-group", topic, f"{topic}-leader")
        assert leader.poll_until(lambda: leader.owned == {0}, timeout_ms=1000, within_s=30), "no first assignment"
        admin.create_partitions({topic: NewPartitions(total_count=2)})
    finally:
        admin.close()
    coordinator = leader.consumer._coordinator
    deadline = time.monotonic() + 30
    while coordinator._join_task is None:  # the metadata refresh makes the leader's snapshots differ: a rejoin
        assert time.monotonic() < deadline, "the leader never began a rejoin for the new partition"
        coordinator._cluster.request_update()
        time.sleep(0.2)
        leader.consumer.poll(timeout_ms=0)
    deadline = time.monotonic() + 30
    while not coordinator._join_task.is_done:
        assert time.monotonic() < deadline, "the leader's join task never finished"
        time.sleep(0.05)
    held = []
    for _ in range(3):
        leader.consumer.poll(timeout_ms=0)
        held.append(set(leader.owned))
    return leader, held


@pytest.mark.apache_kafka
def test_a_leaders_rejoin_for_new_partitions_that_finished_between_polls_is_applied(apache_kafka_bootstrap):
    """kafka-python's consumer stops asking to rejoin once the leader has computed the new assignment, inside the join
    task: with the fix the kept task still counts as a rejoin pending, so the next poll applies it. (Apache Kafka
    only: Tansu 0.6 does not answer CreatePartitions; the fix is in the client, whatever the broker.)"""
    assert kafka_group_join.installed(), "infra.kafka installs the join fix on import"
    leader, held = _leader_after_a_rejoin_for_new_partitions(apache_kafka_bootstrap,
                                                             f"crl.grown-{uuid.uuid4().hex[:8]}")
    try:
        assert held[0] == {0, 1}, f"the leader holds {held} after its finished rejoin"
    finally:
        leader.consumer.close(timeout_ms=1000)


@pytest.mark.apache_kafka
def test_kafka_python_without_the_fix_never_applies_a_leaders_rejoin_that_finished_between_polls(
        apache_kafka_bootstrap, monkeypatch):
    """The second path on kafka-python as released (its `need_rejoin`): after the leader's rejoin finished between
    polls no poll looks at it again, so the member holds nothing, its heartbeats stay off and the coordinator will
    drop it; nothing rejoins (what CI saw: a consumer that subscribed right after its topic was made held nothing for
    60 s)."""
    monkeypatch.setattr(BaseCoordinator, "need_rejoin", kafka_group_join._original_need_rejoin)
    leader, held = _leader_after_a_rejoin_for_new_partitions(apache_kafka_bootstrap,
                                                             f"crl.grown-unfixed-{uuid.uuid4().hex[:8]}")
    try:
        assert held == [set(), set(), set()], held
        assert not leader.consumer._coordinator.need_rejoin()
        assert leader.consumer._coordinator._join_task is not None and leader.consumer._coordinator._join_task.is_done
    finally:
        leader.consumer.close(timeout_ms=1000)


@pytest.mark.apache_kafka
def test_kafka_python_without_the_fix_drops_every_finished_join(apache_kafka_bootstrap, monkeypatch,
                                                               report_measurement):
    """The failure the fix removes, on kafka-python as released: a join that finished between two polls is thrown
    away by the next poll, which starts another JoinGroup (another generation) instead, so A holds nothing after each
    (what CI saw after a broker restart: a rollout worker polling with 0 ms holding nothing, its partitions assigned
    to nobody). With real timing such a member gets a join applied only when its SyncGroup answer happens to land
    inside one of its 0-ms polls: now and then, after many generations."""
    assert kafka_group_join.needs_the_fix(), "kafka-python changed its join: check whether the fix is still needed"
    monkeypatch.setattr(BaseCoordinator, "join_group_async", kafka_group_join._original_join_group_async)
    seen = _polls_after_finished_joins(apache_kafka_bootstrap, "crl-join-unfixed", rounds=3)
    assert [held for held, _ in seen] == [set(), set(), set()], seen
    generations = [generation for _, generation in seen]
    assert generations == sorted(set(generations)), f"each dropped join should start a new generation: {generations}"
    report_measurement(f"kafka-python 3.0.12 unfixed: 3 joins that finished between polls dropped, A holding "
                       f"nothing after each (generations {generations})")


@pytest.mark.apache_kafka
def test_members_get_every_partition_back_after_a_broker_restart_during_a_rebalance(kafka_jars, tmp_path: Path,
                                                                                     report_measurement):
    """Three members; one leaves, and the broker stops (SIGTERM) while the other two rejoin, and starts again a
    second later. One member polls as the rollout worker does with episodes in flight (0 ms, a turn between polls),
    one with 200 ms. Within 60 s the two hold all 8 partitions between them, each its half (the range assignor)."""
    from infra.apache_kafka import ApacheKafkaBroker

    topic = "crl.join-restart"
    with ApacheKafkaBroker(data_dir=tmp_path / "kafka", log_path=tmp_path / "broker.log") as broker:
        admin = make_admin(KafkaSettings(bootstrap_servers=broker.bootstrap_servers))
        admin.create_topics([NewTopic(topic, 8, 1)])
        admin.close()
        members = {name: Member(broker.bootstrap_servers, "crl-join-restart", topic, name)
                   for name in ("eager", "patient", "leaving")}
        timeouts = {"eager": 0, "patient": 200, "leaving": 200}
        pauses = {"eager": 0.05, "patient": 0.0, "leaving": 0.0}
        stop = threading.Event()
        leave = threading.Event()
        errors: list[BaseException] = []

        def loop(name: str) -> None:
            member = members[name]
            try:
                while not stop.is_set():
                    if name == "leaving" and leave.is_set():
                        member.consumer.close()
                        return
                    member.consumer.poll(timeout_ms=timeouts[name])
                    time.sleep(pauses[name])
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        threads = [threading.Thread(target=loop, args=(name,), daemon=True) for name in members]
        for thread in threads:
            thread.start()
        try:
            deadline = time.monotonic() + 60
            while sum(len(m.owned) for m in members.values()) != 8 or not all(m.owned for m in members.values()):
                assert time.monotonic() < deadline, {name: m.owned for name, m in members.items()}
                time.sleep(0.1)
            leave.set()  # its LeaveGroup starts a rebalance
            deadline = time.monotonic() + 10
            while members["eager"].owned and time.monotonic() < deadline:  # the revoke: the rebalance is on
                time.sleep(0.01)
            began = time.monotonic()
            broker.stop()
            time.sleep(1.0)
            broker.start()
            stayed = [members["eager"], members["patient"]]
            deadline = time.monotonic() + 60
            while not (sorted(p for m in stayed for p in m.owned) == list(range(8)) and all(
                    len(m.owned) == 4 for m in stayed)):
                assert not errors, errors
                assert time.monotonic() < deadline, (
                    f"after 60 s: eager holds {sorted(members['eager'].owned)}, patient "
                    f"{sorted(members['patient'].owned)} (generations {[m.generation for m in stayed]})")
                time.sleep(0.1)
            recovered_s = time.monotonic() - began
            generation = members["eager"].generation
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
            for name in ("eager", "patient"):
                members[name].consumer.close()
    assert not errors, errors
    report_measurement(f"broker restart during a rebalance: every partition held again {recovered_s:.1f} s after "
                       f"the stop (generation {generation})")


def test_a_member_the_coordinator_no_longer_counts_in_commits_nothing_and_rejoins_at_its_next_poll(kafka_bootstrap):
    """What kafka-python does when a heartbeat is answered UNKNOWN_MEMBER_ID (the coordinator dropped the member,
    as it did to a resumed rollout worker whose first seconds went to loading its policy): it resets the member's
    generation. A commit then raises `GroupMembershipLostError` at once (retrying it without a poll cannot succeed:
    the runner once did so for 5 minutes), and the next polls rejoin: the partitions come back with a new tenure and
    are read again from their last commit."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    topic = f"crl.membership-{uuid.uuid4().hex[:8]}"
    admin = make_admin(kafka)
    admin.create_topics([NewTopic(topic, 2, 1)])
    admin.close()
    producer = make_producer(kafka)
    for n in range(4):
        producer.send(topic, value=f"record {n}".encode(), partition=n % 2)
    producer.flush()
    producer.close()
    group_input = KafkaGroupInput(make_consumer(kafka, group_id=f"{topic}-group", client_id="member-0"), [topic], {})
    try:
        first = _read(group_input, 4)
        tenures = {(r.topic, r.partition): group_input.tenure((r.topic, r.partition)) for r in first}
        group_input.commit({(topic, 0): 1})  # one record of partition 0 done and committed

        group_input.consumer._coordinator.reset_generation()  # the heartbeat's UNKNOWN_MEMBER_ID
        started = time.monotonic()
        with pytest.raises(GroupMembershipLostError, match="offset commit refused"):
            group_input.commit({(topic, 0): 2, (topic, 1): 2})
        assert time.monotonic() - started < 5.0

        again = _read(group_input, 3)  # rejoined: partition 0 from its commit, partition 1 from the beginning
        assert sorted((r.partition, r.offset) for r in again) == [(0, 1), (1, 0), (1, 1)]
        assert all(group_input.tenure(position) != tenure for position, tenure in tenures.items())
        group_input.commit({(topic, 0): 2, (topic, 1): 2})
    finally:
        group_input.close()


def _read(group_input: KafkaGroupInput, count: int, within_s: float = 30.0) -> list:
    records: list = []
    deadline = time.monotonic() + within_s
    while len(records) < count:
        assert time.monotonic() < deadline, f"read {len(records)} of {count} records in {within_s:.0f} s"
        records.extend(group_input.poll(200))
    return records
