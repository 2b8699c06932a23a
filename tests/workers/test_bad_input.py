"""The bad-record catalogue (`schemas/bad_records.py`, 40+ kinds per topic) fed to every worker kind through the
harness, on every topic it consumes: each bad record ends as exactly one dead letter with its class and source
coordinates, each valid one as its documented outcome; no worker dies. The same catalogue on real brokers, produced
with a raw Kafka client, is `tests/integration/test_bad_input_on_a_broker.py`."""

from __future__ import annotations

import json

import pytest
from harness_setup import RUN, publish_policy, settings_for

from pipeline.audit.views import Audit
from pipeline.bank.replay import replay
from pipeline.runtime.harness import RawRecord, build_worker, run_worker
from schemas.bad_records import BANK_REJECTS, DUPLICATE, bad_records
from schemas.codec import decode
from schemas.topics import EXPERIENCE_OPS_TOPIC, topic_named
from workers import WORKERS


def _coordinates(records) -> list[tuple[str, int, int]]:
    offsets: dict[str, int] = {}
    coordinates = []
    for record in records:
        coordinates.append((record.topic, 0, offsets.get(record.topic, 0)))
        offsets[record.topic] = offsets.get(record.topic, 0) + 1
    return coordinates


@pytest.mark.parametrize("kind", sorted(WORKERS))
def test_every_worker_kind_dead_letters_each_bad_record_once_and_keeps_going(kind, tmp_path):
    worker_class = WORKERS[kind]
    catalogue = bad_records(RUN, topics=worker_class.consumes)
    settings = settings_for(tmp_path, actor_trainer={"group_size": 4})  # the examples' groups hold 4 episodes
    log = [publish_policy(tmp_path, "actor"), publish_policy(tmp_path, "extractor")]
    worker, context = build_worker(worker_class, settings, log=log)
    records = [RawRecord(bad.topic, bad.value, key=bad.key, headers=bad.headers) for bad in catalogue]
    result = run_worker(worker, records, context=context, blobs=context.blobs)  # raises if the worker dies

    where = dict(zip(_coordinates(records), catalogue, strict=True))
    letters = {(d.source_topic, d.source_partition, d.source_offset): d for d in result.dead_letters}
    assert len(letters) == len(result.dead_letters), "one dead letter per bad record"
    expected = {position: bad for position, bad in where.items() if bad.dead_letter}
    assert sorted(letters) == sorted(expected), sorted(set(letters) ^ set(expected))
    wrong = {bad.name: letters[p].error_class for p, bad in expected.items() if letters[p].error_class != bad.expect}
    assert not wrong, wrong
    for position, letter in letters.items():
        assert letter.error_message and letter.raw_size == len(where[position].value or b"")
    if kind == "archiver":
        kept = [bad for bad in catalogue if not bad.dead_letter]
        distinct = {json.loads(bad.value)["event_id"] for bad in kept}
        assert len(distinct) == len(kept) - sum(bad.expect == DUPLICATE for bad in kept)
        with Audit(tmp_path) as audit:
            _, rows = audit.query("SELECT event_id FROM events")
        archived = [row[0] for row in rows]
        assert sorted(i for i in archived if i in distinct) == sorted(distinct)  # every valid event, each once
    if kind == "bank":
        ops = [(offset, decode(EXPERIENCE_OPS_TOPIC, bad.value)) for (topic, _, offset), bad in where.items()
               if topic == EXPERIENCE_OPS_TOPIC.name and not bad.dead_letter]
        clean = replay(ops, run_id=RUN).state
        assert worker.state.state_hash() == clean.state_hash()
        assert worker.state.rejected == sum(bad.expect == BANK_REJECTS for bad in catalogue) == 3
        assert "planted" not in worker.state.experiences
    assert all(topic_named(t) for t, _ in result.committed)


@pytest.mark.parametrize("kind", sorted(k for k, w in WORKERS.items() if any(t.name == "crl.train-steps"
                                                                             for t in w.consumes)))
def test_every_reader_of_the_train_steps_takes_each_kind_the_topic_carries(kind, tmp_path):
    """`crl.train-steps` carries the warm starts' progress and deterministic mode's `StepSettled` beside the steps: no
    consumer may choke on them."""
    from schemas.examples import example_events
    from schemas.topics import TRAIN_STEPS

    settings = settings_for(tmp_path, actor_trainer={"group_size": 4})
    log = [publish_policy(tmp_path, "actor"), publish_policy(tmp_path, "extractor")]
    worker, context = build_worker(WORKERS[kind], settings, log=log)
    events = [e for e in example_events(RUN) if e.kind in TRAIN_STEPS.kinds]
    assert len(events) == len(TRAIN_STEPS.kinds) == 3
    result = run_worker(worker, events, context=context, blobs=context.blobs)
    assert result.dead_letters == []
