"""The registry of worker kinds (`workers.WORKERS`) and how `crl worker NAME` finds its kind: it imports that kind's
module and no other, so the kinds that use no model (scheduler, archiver, tracker, bank) start without torch, and
`crl` itself starts without it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.runtime.launch import load_worker_kind, load_worker_registry
from pipeline.runtime.runner import Worker
from workers import WORKERS, WorkerKinds

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "minihack", "sentence_transformers")


def _imported_after(code: str) -> list[str]:
    """Which of `HEAVY` a fresh interpreter has imported after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("kind", ["scheduler", "archiver", "tracker", "bank"])
def test_a_kind_without_a_model_is_found_without_importing_torch(kind):
    assert _imported_after(f"from pipeline.runtime.launch import load_worker_kind\nload_worker_kind({kind!r})") == []


def test_the_command_line_starts_without_torch_and_a_trainer_kind_brings_it():
    assert _imported_after("import pipeline.cli") == []
    assert "torch" in _imported_after("from pipeline.runtime.launch import load_worker_kind\n"
                                      "load_worker_kind('actor_trainer')")


def test_every_kind_is_registered_under_its_own_name():
    assert set(WORKERS) == {"scheduler", "rollout", "extractor", "archiver", "bank", "actor_trainer",
                            "extractor_trainer", "tracker"}
    for name, kind in WORKERS.items():
        assert issubclass(kind, Worker) and kind.name == name
        assert load_worker_kind(name) is kind
    assert load_worker_registry() == dict(WORKERS.items())


def test_keys_import_nothing_and_a_lookup_imports_its_home():
    kinds = WorkerKinds({"ghost": "workers.no_such_module:Ghost", "archiver": "workers.archiver:Archiver"})
    assert sorted(kinds) == ["archiver", "ghost"] and len(kinds) == 2 and "ghost" in kinds
    assert kinds.home("ghost") == "workers.no_such_module:Ghost"
    with pytest.raises(ModuleNotFoundError):
        kinds["ghost"]
    with pytest.raises(KeyError):
        kinds["nobody"]
    assert kinds["archiver"].name == "archiver"


def test_a_class_registered_under_another_name_is_refused():
    kinds = WorkerKinds({"archive": "workers.archiver:Archiver"})
    with pytest.raises(ConfigError, match=r"archiver:Archiver is named 'archiver' but registered as 'archive'"):
        kinds["archive"]


def test_an_unknown_kind_names_the_known_ones():
    with pytest.raises(ConfigError, match="unknown worker 'nope'; known workers: actor_trainer, archiver, bank"):
        load_worker_kind("nope")
