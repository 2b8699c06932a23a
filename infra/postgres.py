"""A private PostgreSQL cluster in a directory of its own: what the tests (and anyone without a server) run against.

    with PostgresCluster(data_dir) as cluster:          # initdb once, then pg_ctl start on a free loopback port
        engine = make_engine(cluster.url("postgres"))

    cluster = PostgresCluster.temporary().start()       # in a new temporary directory; `remove()` deletes it

`initdb` creates the cluster with trust authentication for a superuser `postgres`, listening on 127.0.0.1 only (and
on a Unix socket inside the data directory); `stop()` stops this cluster and no other. The server binaries come from
`bin_dir`, else from PATH, else from Debian's `/usr/lib/postgresql/<version>/bin` (newest first). PostgreSQL refuses
to run as root, so under root every command runs as the system user `postgres` (which Debian's package creates), and
the data directory is handed to that user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Self

from infra.broker_process import free_loopback_port
from infra.errors import PipelineError
from infra.service import LocalService


class PostgresClusterError(PipelineError):
    """The cluster's binaries are missing, or initdb / pg_ctl failed."""


def locate_postgres_bin(override: Path | str | None = None) -> Path:
    """The directory holding `initdb` and `pg_ctl`."""
    candidates: list[Path] = [Path(override)] if override else []
    if not override:
        found = shutil.which("initdb")
        if found:
            candidates.append(Path(found).parent)
        debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                        key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0, reverse=True)
        candidates += debian
    for directory in candidates:
        if (directory / "initdb").is_file() and (directory / "pg_ctl").is_file():
            return directory
    raise PostgresClusterError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or under /usr/lib/postgresql/*/bin: install "
        "them (Debian: `apt-get install postgresql`) or point at a server with CRL_TEST_POSTGRES_URL")


class PostgresCluster(LocalService):
    """One PostgreSQL cluster in `data_dir`, started on a free loopback port."""

    def __init__(self, data_dir: Path, *, port: int | None = None, bin_dir: Path | str | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_loopback_port()
        self.bin_dir = locate_postgres_bin(bin_dir)
        self._as_postgres = os.geteuid() == 0
        self._scratch: Path | None = None

    @classmethod
    def temporary(cls, *, port: int | None = None, bin_dir: Path | str | None = None) -> PostgresCluster:
        """A cluster in a new temporary directory (under root: one the `postgres` user may enter)."""
        scratch = Path(tempfile.mkdtemp(prefix="crl-postgres-"))
        cluster = cls(scratch / "data", port=port, bin_dir=bin_dir)
        cluster._hand_to_postgres(scratch)
        cluster._scratch = scratch
        return cluster

    def remove(self) -> None:
        """Stop the cluster and delete the temporary directory `temporary()` made."""
        self.stop()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        options: dict[str, Any] = {}
        if self._as_postgres:
            user = pwd.getpwnam("postgres")
            options = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        result = subprocess.run(list(command), capture_output=True, text=True, timeout=120, cwd="/", **options)
        if check and result.returncode != 0:
            raise PostgresClusterError(f"{Path(command[0]).name} failed (exit {result.returncode}): "
                                       f"{(result.stderr or result.stdout).strip()[-1500:]}")
        return result

    def _hand_to_postgres(self, path: Path) -> None:
        if self._as_postgres:
            user = pwd.getpwnam("postgres")
            os.chown(path, user.pw_uid, user.pw_gid)

    def initialised(self) -> bool:
        return (self.data_dir / "PG_VERSION").is_file()

    def start(self) -> Self:
        if not self.initialised():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self.data_dir.chmod(0o700)
            self._hand_to_postgres(self.data_dir)
            self._run(str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-U", "postgres", "-A", "trust",
                      "-E", "UTF8", "--no-sync")
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data_dir}"
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.data_dir / "server.log"),
                  "-o", options, "-w", "-t", "60", "start")
        return self

    def is_running(self) -> bool:
        return self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "status", check=False).returncode == 0

    def stop(self, mode: str = "fast") -> None:
        """Stop this cluster (`fast`: roll back open transactions, disconnect clients). Safe when stopped."""
        if self.initialised() and self.is_running():
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "-t", "60", "stop")

    def create_database(self, name: str) -> str:
        """Create database `name` (if missing) and return its URL."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as connection:
            exists = connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if not exists:
                connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

