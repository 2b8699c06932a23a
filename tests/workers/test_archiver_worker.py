"""The archiver through the harness: every event of every topic to Parquet, poison records dead-lettered on the way."""

from __future__ import annotations

import uuid

from harness_setup import RUN, settings_for

from pipeline.audit.views import Audit
from pipeline.runtime.harness import RawRecord, build_worker, run_worker
from schemas.codec import encode
from schemas.examples import example_events
from schemas.topics import TRAJECTORIES
from workers.archiver import Archiver


def test_the_archiver_archives_every_kind_and_dead_letters_garbage(tmp_path):
    events = example_events(RUN)
    worker, context = build_worker(Archiver, settings_for(tmp_path))
    result = run_worker(worker, [*events, RawRecord(TRAJECTORIES.name, b"not json")], context=context)
    assert [letter.error_class for letter in result.dead_letters] == ["MalformedPayloadError"]
    with Audit(tmp_path) as audit:
        _, rows = audit.query("SELECT kind, count(*) FROM events GROUP BY kind ORDER BY kind")
    assert dict(rows) == {event.kind: 1 for event in events}
    # the dead letter itself goes to crl.dead-letters, where the next poll of an archiver reads it
    assert result.committed[(TRAJECTORIES.name, 0)] == 2


def test_a_poison_record_with_a_large_key_is_dead_lettered_and_archiving_goes_on(tmp_path):
    # Before: the dead letter carried the 600 KB key inline, exceeded the payload cap, and the archiver crashed on
    # it at every restart, so archiving stopped for every topic.
    big_key = b"k" * 600_000
    events = example_events(RUN)
    worker, context = build_worker(Archiver, settings_for(tmp_path))
    result = run_worker(worker, [RawRecord(TRAJECTORIES.name, b"[1]", key=big_key), *events], context=context,
                        blobs=context.blobs)
    [letter] = result.dead_letters
    assert (letter.error_class, letter.source_key_size, letter.source_key_b64) == ("MalformedPayloadError",
                                                                                  600_000, None)
    assert context.blobs.get(letter.source_key_uri) == big_key
    with Audit(tmp_path) as audit:
        _, rows = audit.query("SELECT count(*) FROM events")
    assert rows == [(len(events),)]


def test_an_event_whose_record_timestamp_lies_past_the_year_9999_is_archived(tmp_path):
    # Before: converting the record's timestamp to a datetime failed and the valid event became a dead letter.
    event = next(e for e in example_events(RUN) if e.kind == "TrajectoryCompleted")
    far, never = 300_000_000_000_000, -1  # year ~11,476; -1: the record has none
    worker, context = build_worker(Archiver, settings_for(tmp_path))
    second = event.model_copy(update={"event_id": uuid.uuid4()})
    result = run_worker(worker, [RawRecord(TRAJECTORIES.name, encode(event), timestamp_ms=far),
                                 RawRecord(TRAJECTORIES.name, encode(second), timestamp_ms=never)], context=context)
    assert result.dead_letters == []
    with Audit(tmp_path) as audit:
        _, rows = audit.query("SELECT record_timestamp_ms, record_timestamp FROM events ORDER BY \"offset\"")
    assert rows == [(far, None), (never, None)]
