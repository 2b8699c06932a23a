"""What every embedded broker has in common: a child process on free loopback ports that answers Kafka requests.

`BrokerProcess` starts the command a subclass names, sends its output to a log file, ties the child to its parent
with PR_SET_PDEATHSIG (it never outlives a killed `crl` process), waits until a Kafka client can fetch metadata, and
stops it with SIGTERM (SIGKILL after a grace period). It records how long the start took and reads the child's
resident memory, so the brokers can be compared side by side (`benchmarks/bus_throughput.py`, `crl stack up`).
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
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Self

from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from infra.errors import BrokerError
from infra.service import LocalService

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Resolved once here: a child between fork and exec may only make the call (loading a library there can deadlock
# when other threads of the parent held the allocator's lock at the fork).
_prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a server could listen on loopback `port` now (as servers do, ignoring connections in TIME_WAIT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def die_with_parent() -> None:
    """Runs in the child before exec: deliver SIGTERM to the child when the process that started it dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_until_answers(bootstrap_servers: str, timeout_s: float = 20.0,
                       check: Callable[[], None] | None = None, client_options: dict[str, Any] | None = None) -> None:
    """Block until a Kafka client can fetch metadata from `bootstrap_servers`, or raise `BrokerError`.

    `check` runs between attempts and may raise to give up early (a broker process that exited); `client_options`
    are kafka-python keywords of the client that asks (a secured broker's TLS and SASL login)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if check is not None:
            check()
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers.split(","), request_timeout_ms=2000,
                                     **(client_options or {}))
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


def resident_memory_bytes(pid: int) -> int | None:
    """The resident set size of process `pid` (VmRSS), or None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class BrokerProcess(LocalService):
    """A Kafka-protocol broker as a child process. `start()` returns once it answers metadata requests.

    Subclasses say what to run (`_command`), may prepare files first (`_prepare`), and set `kind` (the name users
    choose it by), `description` and `durable` (whether its log survives a restart).
    """

    kind: ClassVar[str]
    description: ClassVar[str]
    durable: ClassVar[bool]
    stop_timeout_s: ClassVar[float] = 5.0

    def __init__(self, *, log_path: Path | None, port: int | None, start_timeout_s: float) -> None:
        self.port = port or free_loopback_port()
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.start_seconds: float | None = None
        """Wall time of the last `start()`, preparation included."""
        self._process: subprocess.Popen[bytes] | None = None
        self.client_options: dict[str, Any] = {}
        """kafka-python keywords a client needs to reach this broker (TLS and SASL login when it is secured)."""

    # -- what subclasses provide ---------------------------------------------------------------------------------

    def _prepare(self) -> None:
        """Runs before every start (install, format storage, write configuration)."""

    @abstractmethod
    def _command(self) -> list[str]:
        """The command line of the broker process."""

    # -- lifecycle -----------------------------------------------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def resident_memory_bytes(self) -> int | None:
        process = self._process
        return resident_memory_bytes(process.pid) if process is not None and self.is_running() else None

    def start(self) -> Self:
        if self.is_running():
            return self
        began = time.monotonic()
        self.launch()
        self.wait_until_ready(began)
        return self

    def launch(self) -> None:
        """Prepare and start the child without waiting for it to answer (a cluster starts every node first)."""
        if not port_is_free(self.port):
            raise BrokerError(f"{self.description} cannot listen on 127.0.0.1:{self.port}: the port is in use")
        self._prepare()
        command = self._command()
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
        log.info("%s starting pid=%s bootstrap=%s log=%s", self.description, self._process.pid,
                 self.bootstrap_servers, self.log_path)

    def wait_until_ready(self, began: float) -> None:
        """Wait until the launched child answers metadata requests; `began` is when its start began (monotonic)."""
        try:
            self._wait_until_ready(began + self.start_timeout_s)
        except BaseException:  # a failed start, or Ctrl-C during one: never leave the child behind
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        log.info("%s answers at %s after %.2fs", self.description, self.bootstrap_servers, self.start_seconds)

    def _check_alive(self) -> None:
        if self._process is not None and self._process.poll() is not None:
            raise BrokerError(f"{self.description} exited with code {self._process.returncode} during start-up"
                              f" (see {self.log_path or 'its log: pass log_path'})")

    def _wait_until_ready(self, deadline: float) -> None:
        while True:
            self._check_alive()
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            if time.monotonic() > deadline:
                raise BrokerError(f"{self.description} did not open port {self.port} within "
                                  f"{self.start_timeout_s:.0f}s (see {self.log_path or 'its log'})")
            time.sleep(0.02)
        wait_until_answers(self.bootstrap_servers, max(1.0, deadline - time.monotonic()), check=self._check_alive,
                           client_options=self.client_options)

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM, then SIGKILL after `timeout_s` (the class's grace period by default). Safe to call twice."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=self.stop_timeout_s if timeout_s is None else timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s pid=%s did not stop in time; killed", self.description, process.pid)
            process.kill()
            process.wait()
        log.info("%s stopped pid=%s", self.description, process.pid)

    def kill(self) -> None:
        """SIGKILL, no chance to flush: what a crash or an OOM kill does."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

