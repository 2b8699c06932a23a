"""Making files durable and naming their content: fsync of files and of the directories whose entries (a rename)
must survive a crash, and the sha256 that manifests (snapshots, checkpoints) record.

`write_hashed` and `read_hashed` name a file's content in the same pass that writes or reads it (each block is
hashed while it is in cache), so a checkpoint is never read back to hash what was just written, nor read twice to
check it and then use it; `map_file` and `sha256_of` let a caller hash a large file's bytes on another thread while it
uses the same bytes."""

from __future__ import annotations

import hashlib
import mmap
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


def read_hashed(path: Path) -> tuple[memoryview, str]:
    """The bytes of the file at `path` and their sha256, hashed block by block as read (one pass)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        view = memoryview(bytearray(size))
        filled = 0
        while filled < size:
            count = handle.readinto(view[filled : filled + BLOCK])
            if not count:
                break  # the file shrank while it was read: the hash below names what was read
            digest.update(view[filled : filled + count])
            filled += count
    return view[:filled], digest.hexdigest()


def map_file(path: Path) -> memoryview:
    """The bytes of the file at `path`, mapped copy-on-write: the pages of the page cache are read in place (no
    buffer is allocated and filled), and writing to the view never reaches the file. For files that are not written
    again, as a published checkpoint is not."""
    with path.open("rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return memoryview(bytearray())
        return memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY))


def sha256_of(data: memoryview | bytes) -> str:
    """sha256 of bytes in memory (hashlib releases the GIL: another thread can hash something else meanwhile)."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
