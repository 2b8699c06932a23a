"""Java game engines behind py4j, one JVM per engine jar per process, shared by every environment of a worker.

    engine = jvm_engine("textworld-express")          # nothing starts yet
    game = engine.open()                                # starts the JVM on first use; a new game interface object
    text = engine.call(game, "stepJSON", "take key")    # a dead JVM or a Java exception -> EngineCrashedError
    engine.release()                                    # the last user's release stops the JVM

TextWorldExpress and ScienceWorld ship their engines as jars inside their wheels, with Python wrappers that start a
JVM per wrapper object. A worker plays many episodes of one environment at once (one `TextEnv` each), so the
adapters here talk to the engines' own `PythonInterface` classes instead: every environment gets its own interface
object (its own game state) in the one JVM of its engine. The JVM starts with the first environment that needs it
and stops when the last one closes (a worker's stop); py4j's `die_on_exit` also ends it with the process.

A failed call (the JVM died, the connection broke, the engine threw) raises `EngineCrashedError` with the cause. The
JVM is stopped if it is no longer answering, so the next `open` starts a fresh one; the environment that saw the
crash drops its interface object and opens a new one at its next reset.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import EngineCrashedError, EnvUnavailableError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    name: str
    package: str
    """The Python package whose directory holds the jar."""
    jar: str
    interface: str
    """The fully qualified Java class of the per-game interface."""
    pip: str
    """What to install to get it."""


ENGINES = {
    "textworld-express": EngineSpec("textworld-express", "textworld_express", "textworld-express.jar",
                                    "textworldexpress.runtime.PythonInterface", "pip install textworld-express==1.1.0"),
    "scienceworld": EngineSpec("scienceworld", "scienceworld", "scienceworld.jar",
                               "scienceworld.runtime.pythonapi.PythonInterface", "pip install scienceworld==1.2.3"),
}


def engine_requirements(name: str) -> str | None:
    """Why engine `name` cannot start here (no Java on PATH, its package missing), or None when it can."""
    spec = ENGINES[name]
    if shutil.which("java") is None:
        return "no java on PATH (install OpenJDK 17: apt-get install openjdk-17-jre-headless)"
    try:
        _jar_path(spec)
    except EnvUnavailableError as exc:
        return str(exc)
    return None


def _jar_path(spec: EngineSpec) -> Path:
    import importlib.util

    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        raise EnvUnavailableError(f"the {spec.package} package is not installed ({spec.pip})")
    jar = Path(found.origin).parent / spec.jar
    if not jar.is_file():
        raise EnvUnavailableError(f"{jar} is missing from the {spec.package} package ({spec.pip})")
    return jar


class JvmEngine:
    """One engine's JVM in this process, started on the first `open` and stopped by the last `release`."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.users = 0
        self.starts = 0
        """JVMs started in this process (a crash makes the next `open` start another)."""
        self._gateway: Any = None
        self._lock = threading.Lock()

    @property
    def process(self) -> Any:
        """The running JVM's `subprocess.Popen`, or None."""
        return None if self._gateway is None else self._gateway.java_process

    def open(self) -> Any:
        """A new game interface object in the running JVM (started here if there is none): the caller's own game
        state. Counts the caller as a user until its `release`."""
        with self._lock:
            if self._gateway is not None and self._gateway.java_process.poll() is not None:
                self._stop()  # died since the last call
            if self._gateway is None:
                self._start()
            try:
                interface = self._new_interface()
            except Exception as exc:  # py4j raises its own errors and OSError for a JVM that stopped answering
                self._stop()
                raise EngineCrashedError(f"{self.spec.name}: the engine did not answer ({type(exc).__name__}: "
                                         f"{exc})") from exc
            self.users += 1
            return interface

    def _new_interface(self) -> Any:
        java_class: Any = self._gateway.jvm
        for part in self.spec.interface.split("."):
            java_class = getattr(java_class, part)
        return java_class()

    def call(self, game: Any, method: str, *args: Any) -> Any:
        """`game.method(*args)` on a game interface; any failure becomes `EngineCrashedError`, and a JVM that no
        longer answers is stopped so the next `open` starts a fresh one."""
        try:
            return getattr(game, method)(*args)
        except Exception as exc:  # py4j: Py4JJavaError (the engine threw), Py4JNetworkError / Py4JError (gone)
            with self._lock:
                if self._gateway is not None and not self._answers():
                    self._stop()
            raise EngineCrashedError(f"{self.spec.name}: {method} failed ({type(exc).__name__}: "
                                     f"{str(exc).strip()[:500]})") from exc

    def release(self) -> None:
        """One user is done; the last one stops the JVM."""
        with self._lock:
            self.users = max(0, self.users - 1)
            if self.users == 0:
                self._stop()

    def _answers(self) -> bool:
        if self._gateway.java_process.poll() is not None:
            return False
        try:
            self._gateway.jvm.java.lang.System.currentTimeMillis()
        except Exception:  # noqa: BLE001 - any failure means it does not answer
            return False
        return True

    def _start(self) -> None:
        from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway

        jar = _jar_path(self.spec)
        if shutil.which("java") is None:
            raise EnvUnavailableError(f"{self.spec.name} needs Java: no java on PATH (install OpenJDK 17: apt-get "
                                      "install openjdk-17-jre-headless)")
        port, process = launch_gateway(classpath=str(jar), die_on_exit=True, cwd=str(jar.parent),
                                       javaopts=["-Xverify:none", "-XX:+UseSerialGC"], return_proc=True)
        # auto_field off: a method call is one round trip (with it, py4j first asks the JVM whether the name is a
        # field, on every call).
        self._gateway = JavaGateway(gateway_parameters=GatewayParameters(auto_field=False, port=port),
                                    java_process=process)
        self.starts += 1
        log.info("%s: JVM %d started (pid %d)", self.spec.name, self.starts, process.pid)

    def _stop(self) -> None:
        gateway, self._gateway = self._gateway, None
        if gateway is None:
            return
        process = gateway.java_process
        if process.poll() is not None:
            # A dead JVM: mark the client disconnected so the game objects' finalizers (py4j tells the JVM when one
            # is garbage collected) do not try to reach it, each logging a connection error from inside the GC.
            gateway._gateway_client.is_connected = False
        with contextlib.suppress(Exception):  # a dead JVM cannot be shut down politely
            gateway.shutdown()
        if process.poll() is None:
            try:  # die_on_exit: the JVM ends when its stdin gets a line (py4j's own recipe)
                process.stdin.write(b"\n")
                process.stdin.flush()
                process.wait(timeout=5)
            except Exception:  # noqa: BLE001 - fall through to kill
                process.kill()
                process.wait(timeout=5)


_ENGINES: dict[str, JvmEngine] = {}
_REGISTRY_LOCK = threading.Lock()


def jvm_engine(name: str) -> JvmEngine:
    """This process's engine `name` (one of `ENGINES`)."""
    with _REGISTRY_LOCK:
        if name not in _ENGINES:
            _ENGINES[name] = JvmEngine(ENGINES[name])
        return _ENGINES[name]
