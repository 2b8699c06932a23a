"""The blob store: content-addressed, written atomically, safe when several writers store the same bytes at once.

Run: pytest tests/unit/runtime/test_blobs.py
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

from pipeline.runtime.blobs import BlobStore


def test_threads_storing_the_same_bytes_at_once_all_succeed_and_leave_one_blob(tmp_path):
    # The archiver and the bank in one process dead-letter the same large record: before, both wrote and renamed
    # one temporary file (named by pid only), and one of them failed with FileNotFoundError.
    store = BlobStore(tmp_path)
    data = b"x" * 2_000_000
    for _ in range(5):
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: store.put(data), range(8)))
        assert len(set(results)) == 1
    uri, digest = results[0]
    assert digest == hashlib.sha256(data).hexdigest() and store.get(uri) == data
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [digest]  # no temporary file left behind
