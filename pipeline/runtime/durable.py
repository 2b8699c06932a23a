"""Making files durable and naming their content: fsync of files and of the directories whose entries (a rename)
must survive a crash, and the sha256 that manifests (snapshots, checkpoints) record."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def fsync_directory(path: Path) -> None:
    """Persist the directory's entries, e.g. a file just renamed into it."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
