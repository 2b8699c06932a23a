"""`crl track`'s reading of an archive: rows that no longer decode are skipped, counted and named, never silently.

Run: pytest tests/unit/audit/test_track_archive.py
"""

from __future__ import annotations

from collections import Counter

import pyarrow.parquet as pq
from test_report import archived, complementary_run

from pipeline.audit.archive import archive_root, segment_files
from pipeline.audit.track import archived_events


def test_rows_that_do_not_decode_are_counted_by_topic(tmp_path):
    run_dir = archived(tmp_path / "run", complementary_run())
    every = list(archived_events(run_dir))
    segment = next(p for p in segment_files(archive_root(run_dir)) if "trajectories" in p.parent.name)
    table = pq.read_table(segment)
    payloads = table.column("payload").to_pylist()
    # an event of a kind this code does not know (a newer schema): it no longer decodes
    payloads[0] = payloads[0].replace('"kind":"TrajectoryCompleted"', '"kind":"TrajectoryCompletedV9"', 1)
    assert payloads[0] != table.column("payload").to_pylist()[0]
    pq.write_table(table.set_column(table.column_names.index("payload"), "payload", [payloads]), segment)
    undecodable: Counter[str] = Counter()
    left = list(archived_events(run_dir, undecodable=undecodable))
    assert undecodable == Counter({"crl.trajectories": 1})
    assert len(left) == len(every) - 1
