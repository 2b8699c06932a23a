"""The archiver through the harness: every event of every topic to Parquet, poison records dead-lettered on the way."""

from __future__ import annotations

from harness_setup import RUN, settings_for

from pipeline.audit.views import Audit
from pipeline.runtime.harness import RawRecord, build_worker, run_worker
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
