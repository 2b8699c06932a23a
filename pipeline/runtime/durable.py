"""Making files durable and naming their content: fsync of files and of the directories whose entries (a rename)
must survive a crash, and the sha256 that manifests (snapshots, checkpoints) record.

`write_hashed` and `read_hashed` name a file's content in the same pass that writes or reads it (each block is
hashed while it is in cache), so a checkpoint is never read back to hash what was just written, nor read twice to
check it and then use it."""

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


BLOCK = 1 << 20


def write_hashed(path: Path, data: bytes | memoryview | list[bytes | memoryview]) -> str:
    """Write `data` (bytes, or parts written one after the other) to a new file at `path`, fsynced, and return its
    sha256, hashed block by block as written."""
    digest = hashlib.sha256()
    with path.open("xb") as handle:
        for part in data if isinstance(data, list) else [data]:
            view = memoryview(part).cast("B")
            for start in range(0, len(view), BLOCK):
                block = view[start : start + BLOCK]
                digest.update(block)
                handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    return digest.hexdigest()


def read_hashed(path: Path) -> tuple[bytearray, str]:
    """The bytes of the file at `path` and their sha256, hashed block by block as read (one pass)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        data = bytearray(size)
        view = memoryview(data)
        filled = 0
        while filled < size:
            count = handle.readinto(view[filled : filled + BLOCK])
            if not count:
                break  # the file shrank while it was read: the hash below names what was read
            digest.update(view[filled : filled + count])
            filled += count
        view.release()
    if filled < size:
        del data[filled:]
    return data, digest.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
