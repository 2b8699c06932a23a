"""The bad-record catalogue on real brokers (both tiers), produced with a raw Kafka client onto every topic, between
valid events: the archiver (which consumes every topic) and the bank worker each dead-letter every bad record once,
with its class and source coordinates; neither dies; every valid event is archived exactly once; the bank equals a
clean replay of the valid ops. The time from a bad record to its dead letter is measured and reported in the session
summary."""

from __future__ import annotations

import json
import statistics
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from infra.kafka import KafkaSettings
from pipeline.audit.views import Audit
from pipeline.bank.replay import replay
from pipeline.bank.settings import BankSettings
from pipeline.runtime.launch import build_runner
from pipeline.runtime.runner import Limits
from pipeline.runtime.settings import RunnerSettings
from pipeline.settings import Settings
from schemas.bad_records import BadRecord, bad_records
from schemas.base import Event
from schemas.codec import decode, encode
from schemas.dead_letters import DeadLetter
from schemas.examples import example_events
from schemas.topics import DEAD_LETTERS, EXPERIENCE_OPS_TOPIC, TOPICS, topic_of
from workers.archiver import Archiver
from workers.bank import BankProjection

pytestmark = pytest.mark.integration
RUN = "hostile-input"


def test_every_bad_record_on_every_topic_is_dead_lettered_and_every_valid_event_archived_once(
        kafka_bootstrap, tmp_path, report_measurement, request):
    catalogue = bad_records(RUN)
    examples = {topic_of(event).name: event for event in example_events(RUN)}
    # What each worker will read: the catalogue, a valid event after every fourth bad record, and dead letters.
    extra = {bad.topic: 0 for bad in catalogue}
    for index, bad in enumerate(catalogue):
        extra[bad.topic] += 1 + (index % 4 == 0)
    bank_topics = {topic.name for topic in BankProjection.consumes}
    bank_letters = sum(1 for bad in catalogue if bad.topic in bank_topics and bad.dead_letter)
    archiver_letters = sum(1 for bad in catalogue if bad.dead_letter)
    settings = Settings(run_dir=tmp_path, run_id=RUN, kafka=KafkaSettings(bootstrap_servers=kafka_bootstrap),
                        runner=RunnerSettings(poll_timeout_ms=50), bank=BankSettings(snapshot_every=100_000))
    bank = build_runner(BankProjection, settings, instance="bank-0",
                        limits=Limits(max_events=sum(n for t, n in extra.items() if t in bank_topics), timeout_s=180))
    # The archiver reads every record, then the bank's dead letters and its own (all on crl.dead-letters).
    archiver = build_runner(Archiver, settings, instance="archiver-0", limits=Limits(
        max_events=sum(extra.values()) + bank_letters + archiver_letters, timeout_s=240))
    with ThreadPoolExecutor(2) as pool:  # both running while the records arrive, as in a run
        bank_run, archiver_run = pool.submit(bank.run), pool.submit(archiver.run)
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, max_request_size=8 * 1024 * 1024, linger_ms=5)
        sent: dict[tuple[str, int, int], tuple[BadRecord | Event, int]] = {}  # coordinates -> (what, timestamp ms)
        valid_ids: set[str] = set()
        for index, bad in enumerate(catalogue):
            items: list[BadRecord | Event] = [bad]
            if index % 4 == 0:  # a fresh valid event after every fourth bad record
                event = examples[bad.topic].model_copy(update={"event_id": uuid.uuid4()})
                if event.kind == "ExperienceAdded":  # an op of its own, so the bank applies it
                    event = event.model_copy(update={"op_id": f"valid:{index}", "experience_id": f"valid-{index}"})
                valid_ids.add(str(event.event_id))
                items.append(event)
            for item in items:
                if isinstance(item, Event):
                    topic = topic_of(item)
                    future = producer.send(topic.name, key=topic.key_bytes(item), value=encode(item))
                else:
                    future = producer.send(item.topic, key=item.key, value=item.value, headers=list(item.headers))
                metadata = future.get(timeout=30)
                sent[(metadata.topic, metadata.partition, metadata.offset)] = (item, metadata.timestamp)
        producer.close()
        bad_at = {position: item for position, (item, _) in sent.items() if isinstance(item, BadRecord)}
        valid_ids |= {json.loads(bad.value)["event_id"] for bad in catalogue if not bad.dead_letter}

        bank_metrics, archiver_metrics = bank_run.result(), archiver_run.result()
    assert bank_metrics.dead_letters == bank_letters
    assert archiver_metrics.dead_letters == archiver_letters

    with Audit(tmp_path) as audit:
        _, rows = audit.query("SELECT event_id FROM events")
        _, letters = audit.query("SELECT source_topic, source_partition, source_offset, error_class, "
                                 "producer_worker FROM dead_letter")
    archived = [row[0] for row in rows]
    assert sorted(i for i in archived if i in valid_ids) == sorted(valid_ids)  # each valid event exactly once
    # One dead letter per bad record in the audit (the bank's and the archiver's share the id when they agree).
    by_source: dict[tuple[str, int, int], list[str]] = {}
    for topic, partition, offset, error_class, _ in letters:
        if (topic, partition, offset) in bad_at:  # not the catalogue's own valid dead letters (on crl.dead-letters)
            by_source.setdefault((topic, partition, offset), []).append(error_class)
    expected = {position: bad.expect for position, bad in bad_at.items() if bad.dead_letter}
    assert dict(by_source) == {p: [c] for p, c in expected.items()}

    ops = [(offset, item if isinstance(item, Event) else decode(EXPERIENCE_OPS_TOPIC, item.value))
           for (topic, _, offset), (item, _) in sorted(sent.items())
           if topic == EXPERIENCE_OPS_TOPIC.name and (isinstance(item, Event) or not item.dead_letter)]
    latencies = []
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
    consumer.assign([TopicPartition(DEAD_LETTERS.name, 0)])
    consumer.seek_to_beginning()
    seen = 0
    while seen < bank_letters + archiver_letters:
        for records in consumer.poll(timeout_ms=1000).values():
            for record in records:
                if (DEAD_LETTERS.name, record.partition, record.offset) in sent:
                    continue  # what the test produced there, not a worker's dead letter
                seen += 1
                letter = decode(DEAD_LETTERS, record.value)
                assert isinstance(letter, DeadLetter)
                source = (letter.source_topic, letter.source_partition, letter.source_offset)
                if source in sent:
                    latencies.append((record.timestamp - sent[source][1]) / 1000)
    consumer.close()
    clean = replay(ops, run_id=RUN).state
    stored = bank.worker.state  # type: ignore[attr-defined]
    assert stored.state_hash() == clean.state_hash() and stored.rejected == clean.rejected >= 3
    assert "planted" not in stored.experiences  # the other run's op
    tier = request.node.callspec.id
    report_measurement(
        f"bad input ({len(catalogue)} records of {len(TOPICS)} topics, {len(catalogue) - archiver_letters} of them "
        f"valid events with an outcome of their own): {archiver_letters} dead letters from the archiver, "
        f"{bank_letters} from the bank; time to the dead letter median {statistics.median(latencies):.2f} s, "
        f"max {max(latencies):.2f} s ({tier})")
