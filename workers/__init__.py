"""Worker kinds. A new kind is one file here, one line in `WORKERS`, one test and one compose service.

Imports flow `schemas <- pipeline <- workers`: workers may use everything, nothing imports workers (the CLI finds
this registry through the `crl.workers` entry point in pyproject.toml).

`WORKERS` maps each kind's name to where its class lives and imports a kind's module the first time the kind is
looked up: `crl worker scheduler` imports the scheduler's module only, not torch and the models the trainers need
(seconds of every worker start on two cores). Iterating over the keys imports nothing; over the values, everything.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from pipeline.errors import ConfigError
from pipeline.runtime.launch import WorkerClass


class WorkerKinds(Mapping[str, WorkerClass]):
    """Kind name -> worker class, each class imported from its `module:Class` home on first lookup; a class whose
    `name` is not the key it is registered under is refused then (`ConfigError`)."""

    def __init__(self, homes: Mapping[str, str]) -> None:
        self._homes = dict(homes)
        self._loaded: dict[str, WorkerClass] = {}

    def __getitem__(self, name: str) -> WorkerClass:
        if name not in self._loaded:
            module, _, attribute = self._homes[name].partition(":")
            kind = getattr(importlib.import_module(module), attribute)
            if kind.name != name:
                raise ConfigError(f"{self._homes[name]} is named {kind.name!r} but registered as {name!r}")
            self._loaded[name] = kind
        return self._loaded[name]

    def __contains__(self, name: object) -> bool:
        return name in self._homes

    def __iter__(self) -> Iterator[str]:
        return iter(self._homes)

    def __len__(self) -> int:
        return len(self._homes)

    def home(self, name: str) -> str:
        """Where kind `name` lives, `module:Class`, without importing it."""
        return self._homes[name]


WORKERS = WorkerKinds({
    "scheduler": "workers.scheduler:Scheduler",
    "rollout": "workers.rollout:Rollout",
    "extractor": "workers.extractor:Extractor",
    "archiver": "workers.archiver:Archiver",
    "bank": "workers.bank:BankProjection",
    "actor_trainer": "workers.actor_trainer:ActorTrainer",
    "extractor_trainer": "workers.extractor_trainer:ExtractorTrainer",
    "tracker": "workers.tracker:Tracker",
})
