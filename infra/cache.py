"""The user's cache of things fetched or built once and reused by every run: Apache Kafka's jars
(`infra.apache_kafka`), converted model presets (`pipeline.models.presets`), warm starts. `~/.cache/complementary-rl`
unless a caller is given another directory."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "complementary-rl"


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """One process at a time installs into a cache directory (two `crl` commands may start together)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
