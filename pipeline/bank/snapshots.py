"""Bank snapshots: a directory per snapshot, written whole or not at all, that a replica or a restarted bank worker
starts from instead of offset 0.

    RUN_DIR/bank/snapshots/<next offset, 12 digits>/
        state.json      BankState.to_snapshot(): experiences, histories, seen op ids, counts, state hash
        index/          ExperienceIndex over the active experiences (derived; rebuilt in canonical order)
        manifest.json   next offset, state hash, log id, counts, and the sha256 of every file above

The directory is written under a hidden temporary name, fsynced, and renamed into place; reading verifies every
file's sha256 and the state's own hash, so a torn or tampered snapshot is refused rather than trusted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.bank.index import ExperienceIndex, HnswOptions
from pipeline.bank.state import BankState
from pipeline.errors import SnapshotError
from pipeline.runtime.durable import file_sha256, fsync_directory, fsync_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotManifest:
    next_offset: int
    state_hash: str
    log_id: str
    active_experiences: int
    ops_applied: int
    files: dict[str, str]
    """Relative path -> sha256 of every file of the snapshot except the manifest."""


def snapshots_root(run_dir: Path) -> Path:
    return run_dir / "bank" / "snapshots"


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            fsync_file(path)
    for folder in [directory, *sorted(p for p in directory.rglob("*") if p.is_dir())]:
        fsync_directory(folder)


def write_snapshot(root: Path, state: BankState, log_id: str, exact_threshold: int = 10_000,
                   hnsw: HnswOptions | None = None) -> tuple[Path, SnapshotManifest]:
    """Write `state` (and an index of its active experiences, built with `exact_threshold` and the graph settings
    `hnsw`, which its manifest records) as the snapshot at `state.next_offset`."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{state.next_offset:012d}"
    temporary = root / f".{final.name}.{os.getpid()}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    snapshot = state.to_snapshot()
    (temporary / "state.json").write_text(json.dumps(snapshot, sort_keys=True, separators=(",", ":")))
    (temporary / "index").mkdir()
    if state.key_dim is not None:
        items = [(e.experience_id, e.task_family, e.key) for e in state.active()]
        ExperienceIndex.build(items, dim=state.key_dim, exact_threshold=exact_threshold,
                              **(hnsw or {})).save(temporary / "index")
    files = {str(path.relative_to(temporary)): file_sha256(path)
             for path in sorted(temporary.rglob("*")) if path.is_file()}
    manifest = SnapshotManifest(
        next_offset=state.next_offset,
        state_hash=snapshot["state_hash"],
        log_id=log_id,
        active_experiences=sum(1 for _ in state.active()),
        ops_applied=state.applied,
        files=files,
    )
    (temporary / "manifest.json").write_text(json.dumps(asdict(manifest), sort_keys=True, indent=1))
    _fsync_tree(temporary)
    if final.exists():
        # The same offset was snapshotted before a crash: the same ops give the same state, so keep either.
        shutil.rmtree(temporary)
        return final, read_manifest(final)
    os.rename(temporary, final)
    fsync_directory(root)
    return final, manifest


def read_manifest(path: Path) -> SnapshotManifest:
    try:
        return SnapshotManifest(**json.loads((path / "manifest.json").read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise SnapshotError(f"{path} has no readable manifest: {exc}") from exc


def snapshot_dirs(root: Path) -> list[Path]:
    """Snapshot directories, newest (highest offset) first; temporary directories are ignored."""
    if not root.exists():
        return []
    return sorted((p for p in root.glob("[0-9]" * 12) if p.is_dir()), reverse=True)


def newest_snapshot(root: Path, log_id: str | None = None, at_most: int | None = None) -> Path | None:
    """The snapshot with the highest offset (of `log_id`, at or below `at_most`, when given) whose manifest reads."""
    for path in snapshot_dirs(root):
        if at_most is not None and int(path.name) > at_most:
            continue
        try:
            manifest = read_manifest(path)
        except SnapshotError:
            continue
        if log_id is None or manifest.log_id == log_id:
            return path
    return None


def restore_newest(root: Path, log_id: str, at_most: int | None = None,
                   run_id: str | None = None) -> tuple[Path, BankState] | None:
    """The newest snapshot of `log_id` (at or below `at_most`) that passes every check, with its state (a bank of
    run `run_id` from there on).

    A torn or tampered snapshot is logged and skipped for the next older one, never trusted and never fatal.
    """
    for path in snapshot_dirs(root):
        if at_most is not None and int(path.name) > at_most:
            continue
        try:
            manifest = read_manifest(path)
            if manifest.log_id != log_id:
                continue
            state, _ = read_snapshot(path)
        except SnapshotError as exc:
            log.warning("skipping snapshot %s: %s", path, exc)
            continue
        state.run_id = run_id
        return path, state
    return None


def read_snapshot(path: Path) -> tuple[BankState, SnapshotManifest]:
    """The state stored in the snapshot at `path`, after checking every file's sha256 and the state hash."""
    manifest = read_manifest(path)
    for relative, expected in manifest.files.items():
        file = path / relative
        if not file.is_file() or file_sha256(file) != expected:
            raise SnapshotError(f"{path}: {relative} is missing or does not match its sha256")
    try:
        state = BankState.from_snapshot(json.loads((path / "state.json").read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"{path}: {exc}") from exc
    if state.state_hash() != manifest.state_hash or state.next_offset != manifest.next_offset:
        raise SnapshotError(f"{path}: state does not match its manifest")
    return state, manifest


def read_index(path: Path) -> ExperienceIndex | None:
    """The snapshot's index, or None for a snapshot of an empty bank."""
    index_dir = path / "index"
    return ExperienceIndex.load(index_dir) if (index_dir / "manifest.json").exists() else None
