"""A local service this project starts and stops itself (an embedded broker, a cluster of them, a private
PostgreSQL): `start()` returns it running, `stop()` ends it, and `with` does both."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self


class LocalService(ABC):
    @abstractmethod
    def start(self) -> Self:
        """Start it (and wait until it answers); returns it."""

    @abstractmethod
    def stop(self) -> None:
        """Stop it and everything it started."""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
