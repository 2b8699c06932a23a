"""A content-addressed blob store under the run directory: claim checks for what is too large for an event (the bulky
arrays of a large trajectory, the raw bytes of a large dead-lettered record).

`put(data)` writes `RUN_DIR/blobs/<sha256[:2]>/<sha256>` atomically (write, fsync, rename) and returns a `file://`
URI; writing the same bytes twice is a no-op. `get(uri)` reads them back and verifies the hash; `read(sha256)` reads
them by hash, unverified (the codec checks them against the claim check, to say which event they belong to).
Workers on several hosts share the store through the run directory (a volume in docker-compose.yml).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from pipeline.errors import HashMismatchError, InvalidArgumentError
from pipeline.runtime.durable import fsync_directory, fsync_file


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, data: bytes) -> tuple[str, str]:
        """Store `data`; returns `(uri, sha256)`."""
        digest = hashlib.sha256(data).hexdigest()
        path = self.root / digest[:2] / digest
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # A name of its own per writer (process and thread): two workers storing the same bytes at once (the
            # archiver and the bank dead-lettering one large record) must not write or rename each other's file.
            temporary = path.with_name(f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp")
            temporary.write_bytes(data)
            fsync_file(temporary)
            os.replace(temporary, path)
            fsync_directory(path.parent)
        return path.resolve().as_uri(), digest

    def read(self, sha256: str) -> bytes | None:
        """The bytes stored under `sha256`, as they are on disk, or None when there are none."""
        try:
            return (self.root / sha256[:2] / sha256).read_bytes()
        except FileNotFoundError:
            return None

    def get(self, uri: str) -> bytes:
        if not uri.startswith("file://"):
            raise InvalidArgumentError(f"not a blob-store URI: {uri}")
        path = Path(uri.removeprefix("file://"))
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != path.name:
            raise HashMismatchError(f"blob {path} does not match its sha256 name")
        return data
