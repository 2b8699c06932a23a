"""Making files durable: fsync of files and of the directories whose entries (a rename) must survive a crash."""

from __future__ import annotations

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
