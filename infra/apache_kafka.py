"""Apache Kafka as an embedded broker: the real broker (4.1.1, as in docker-compose.yml) run by the JVM as a child.

    python -m infra.apache_kafka fetch      # download the pinned jars once (Maven Central, sha256-checked)
    python -m infra.apache_kafka lock       # re-resolve infra/kafka-broker/pom.xml with Maven and rewrite jars.lock

    with ApacheKafkaBroker(data_dir=run_dir / "kafka", log_path=run_dir / "logs" / "broker.log") as broker:
        print(broker.bootstrap_servers)

The broker is published on Maven Central as ordinary jars. `infra/kafka-broker/pom.xml` names them and
`infra/kafka-broker/jars.lock` pins what they resolve to (coordinates, size, sha256); `install_kafka_jars` downloads
exactly those files into a cache outside any run directory (`~/.cache/complementary-rl/kafka-4.1.1/`), checks every
sha256 on every start, and never trusts a file that does not match. Running the broker needs Java 17+, not Maven.

`ApacheKafkaBroker` formats a KRaft storage directory once (single node, broker + controller, a new cluster id),
writes `server.properties` with the settings of the compose service (`BROKER_POLICY`; tests/unit/infra/test_compose.py
keeps the two equal), starts `kafka.Kafka` on free loopback ports, waits until it answers, and stops it with
SIGTERM (a controlled shutdown; SIGKILL after 30 s). Its log lives in `data_dir`, so it survives a restart: started
again on the same directory it serves the same topics, records, topic ids and committed group offsets, on the same
ports when they are free.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from infra.broker_process import BrokerProcess, free_loopback_port, port_is_free
from infra.cache import default_cache_dir, exclusive_lock
from infra.errors import BrokerError
from infra.kafka_security import SecuredBus, write_private

log = logging.getLogger(__name__)

KAFKA_VERSION = "4.1.1"
BROKER_FILES = Path(__file__).resolve().parent / "kafka-broker"
LOCK_FILE = BROKER_FILES / "jars.lock"
POM_FILE = BROKER_FILES / "pom.xml"
LOG4J_CONFIG = BROKER_FILES / "log4j2.properties"
MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
MIN_JAVA = 17
"""Kafka 4.x brokers need Java 17."""

BROKER_POLICY: dict[str, str] = {
    "node.id": "1",
    "process.roles": "broker,controller",
    "controller.listener.names": "CONTROLLER",
    "inter.broker.listener.name": "PLAINTEXT",
    # One node: internal topics cannot have more replicas than brokers.
    "offsets.topic.replication.factor": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    # Topics are created by `crl topics create` with their final partition counts; a typo must fail.
    "auto.create.topics.enable": "false",
    # The log is the system of record: events are never deleted by age.
    "log.retention.ms": "-1",
    # Records are capped at 1 MiB by the app; 8 MiB leaves headroom for batches and headers.
    "message.max.bytes": "8388608",
}
"""The broker settings shared with the compose service's `KAFKA_*` environment (same names, `.` for `_`).

Group session timeouts keep Kafka's defaults on purpose (`group.min.session.timeout.ms` 6,000 ms): the client
settings in `infra/kafka.py` must work on a stock Apache Kafka, not only on brokers configured by this project."""


# -- the pinned jars ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LockedJar:
    """One jar of the lock: Maven coordinates `group:artifact:version`, its size and sha256."""

    coordinates: str
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        _, artifact, version = self.coordinates.split(":")
        return f"{artifact}-{version}.jar"

    @property
    def repository_path(self) -> str:
        group, artifact, version = self.coordinates.split(":")
        return f"{group.replace('.', '/')}/{artifact}/{version}/{self.filename}"


def read_lock(path: Path = LOCK_FILE) -> list[LockedJar]:
    jars = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 3 or len(fields[0]) != 64 or fields[2].count(":") != 2:
            raise BrokerError(f"{path}:{number}: expected 'sha256 size group:artifact:version', got {line!r}")
        jars.append(LockedJar(coordinates=fields[2], size=int(fields[1]), sha256=fields[0]))
    if not jars:
        raise BrokerError(f"{path} lists no jars")
    return jars


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _download(url: str, target: Path, jar: LockedJar, attempts: int = 3) -> None:
    """Download `url` to `target` through a temporary file; the file appears only once its sha256 matches.

    A transfer that fails or ends short is tried again; a complete file with other bytes is refused at once."""
    last: str = ""
    for attempt in range(1, attempts + 1):
        partial: Path | None = None
        try:
            with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{jar.filename}.", delete=False) as tmp:
                partial = Path(tmp.name)
                with urllib.request.urlopen(url, timeout=60) as response:
                    shutil.copyfileobj(response, tmp, 1 << 20)
            size = partial.stat().st_size
            if size == jar.size:
                got = file_sha256(partial)
                if got != jar.sha256:
                    raise BrokerError(f"{url}: sha256 {got} differs from the lock's {jar.sha256} ({LOCK_FILE}); "
                                      "refusing to run a jar that is not the pinned one")
                partial.chmod(0o644)  # a shared cache must be readable by everyone who runs the broker
                partial.replace(target)
                partial = None
                return
            last = f"got {size} bytes, the lock says {jar.size}"
        except ValueError as exc:  # urllib's answer to a repository address that is not a URL
            raise BrokerError(f"cannot download {url}: {exc} (CRL_BROKER__MAVEN_REPOSITORY must be a URL)") from exc
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        finally:
            if partial is not None:
                partial.unlink(missing_ok=True)
        if attempt < attempts:
            time.sleep(attempt)
    raise BrokerError(f"could not download {url} after {attempts} attempts ({last}); Apache Kafka's jars come from "
                      "Maven Central: set CRL_BROKER__MAVEN_REPOSITORY to a mirror, or use --broker tansu")


def install_kafka_jars(cache_dir: Path | None = None, repository: str = MAVEN_CENTRAL) -> list[Path]:
    """Every jar of the lock in `cache_dir/kafka-<version>/lib`, downloading what is missing; checks every sha256.

    Returns the jars in lock order (the classpath). Raises `BrokerError` on a download failure or a hash mismatch.
    """
    lib = (cache_dir or default_cache_dir()) / f"kafka-{KAFKA_VERSION}" / "lib"
    jars = read_lock()
    with exclusive_lock(lib.parent / ".install.lock"):
        lib.mkdir(parents=True, exist_ok=True)
        missing = [jar for jar in jars if not _matches(lib / jar.filename, jar)]
        if missing:
            total = sum(jar.size for jar in missing)
            log.warning("downloading Apache Kafka %s: %d jars, %.1f MB from %s into %s (once)", KAFKA_VERSION,
                        len(missing), total / 1e6, repository, lib)
            began = time.monotonic()
            for jar in missing:
                _download(f"{repository.rstrip('/')}/{jar.repository_path}", lib / jar.filename, jar)
            log.warning("Apache Kafka %s jars installed in %.1fs", KAFKA_VERSION, time.monotonic() - began)
    return [lib / jar.filename for jar in jars]


def _matches(path: Path, jar: LockedJar) -> bool:
    return path.is_file() and path.stat().st_size == jar.size and file_sha256(path) == jar.sha256


def write_lock(pom: Path = POM_FILE, lock: Path = LOCK_FILE) -> list[LockedJar]:
    """Resolve `pom` with Maven (`mvn dependency:list`, which downloads the jars into ~/.m2) and write the lock from
    the resolved jars. Fails when Maven resolves nothing or lists an artifact this parser does not understand."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("writing the lock needs Maven (`mvn`) on PATH")
    with tempfile.TemporaryDirectory(prefix="crl-kafka-lock-") as scratch:
        listing = Path(scratch) / "dependencies.txt"
        subprocess.run([mvn, "-q", "-B", "-f", str(pom), "dependency:list", "-DincludeScope=runtime",
                        f"-DoutputFile={listing}", "-DoutputAbsoluteArtifactFilename=true"], check=True)
        jars = []
        for line in listing.read_text().splitlines():
            if ":jar:" not in line:
                continue
            # group:artifact:jar:version:scope:/path/to/artifact-version.jar[ -- module name]
            match = re.match(r"\s*([^:\s]+):([^:]+):jar:([^:]+):(?:compile|runtime):(\S+?\.jar)\b", line)
            if match is None:
                raise BrokerError(f"cannot read this line of `mvn dependency:list`: {line!r}")
            group, artifact, version, path = match.groups()
            jar_path = Path(path)
            jars.append(LockedJar(f"{group}:{artifact}:{version}", jar_path.stat().st_size, file_sha256(jar_path)))
    if not jars:
        raise BrokerError(f"Maven resolved no jars from {pom}")
    jars.sort(key=lambda jar: jar.coordinates)
    header = (f"# Apache Kafka {KAFKA_VERSION}: the broker's runtime jars as Maven resolves "
              "infra/kafka-broker/pom.xml.\n"
              "# Written by `python -m infra.apache_kafka lock`; infra/apache_kafka.py downloads exactly these files.\n"
              "# sha256 size group:artifact:version\n")
    lock.write_text(header + "".join(f"{j.sha256} {j.size} {j.coordinates}\n" for j in jars))
    return jars


# -- Java -----------------------------------------------------------------------------------------------------------


def java_major_version(java: str) -> int:
    """The major version `java -version` reports (8 for '1.8.0_402', 17 for '17.0.15')."""
    try:
        result = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BrokerError(f"cannot run `{java} -version`: {exc} (set CRL_BROKER__JAVA to a Java 17+ binary)") from exc
    match = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if result.returncode != 0 or match is None:
        raise BrokerError(f"`{java} -version` failed: {(result.stderr or result.stdout).strip()[:300]}")
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def locate_java(override: Path | str | None = None) -> str:
    """A `java` of version 17 or newer: `override` (CRL_BROKER__JAVA) if given, else the one on PATH."""
    java = str(override) if override else shutil.which("java")
    if java is None:
        raise BrokerError(f"Apache Kafka {KAFKA_VERSION} needs Java {MIN_JAVA}+ and no `java` is on PATH: install "
                          "OpenJDK 17 (Debian: `apt-get install openjdk-17-jre-headless`) or set CRL_BROKER__JAVA; "
                          "`--broker tansu` needs no Java")
    major = java_major_version(java)
    if major < MIN_JAVA:
        raise BrokerError(f"{java} is Java {major}; Apache Kafka {KAFKA_VERSION} needs Java {MIN_JAVA}+ "
                          "(set CRL_BROKER__JAVA to a newer one)")
    return java


# -- the broker -----------------------------------------------------------------------------------------------------


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (as `kafka-storage random-uuid`). Like
    Kafka's own `Uuid.randomUuid()`, an id that starts with "-" is drawn again: the storage tool's argument parser
    would read it as an option (1 format in 64 failed with "--cluster-id: expected one argument")."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def replication_policy(brokers: int) -> dict[str, str]:
    """Broker settings of a cluster of `brokers` nodes: internal topics and topics created without settings get
    min(3, brokers) replicas, and a write needs 2 of them in sync once there are 3 (a single node keeps 1 and 1)."""
    replicas = min(3, brokers)
    in_sync = min_insync_replicas(replicas)
    return {
        "offsets.topic.replication.factor": str(replicas),
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": str(in_sync),
        "share.coordinator.state.topic.replication.factor": str(replicas),
        "share.coordinator.state.topic.min.isr": str(in_sync),
        "default.replication.factor": str(replicas),
        "min.insync.replicas": str(in_sync),
    }


def min_insync_replicas(replicas: int) -> int:
    """2 of 3 or more replicas (one broker may die and writes with acks=all go on), else 1."""
    return 2 if replicas >= 3 else 1


def server_properties(port: int, controller_port: int, log_dir: Path, *, node_id: int = 1,
                      voters: dict[int, int] | None = None) -> dict[str, str]:
    """`server.properties` of a KRaft node on loopback (broker and controller): `BROKER_POLICY` plus its id,
    listeners and storage. `voters` maps every node id of the controller quorum to its controller port (default:
    this node alone); a cluster of more than one node also gets `replication_policy`."""
    voters = voters or {node_id: controller_port}
    return {
        **BROKER_POLICY,
        **(replication_policy(len(voters)) if len(voters) > 1 else {}),
        "node.id": str(node_id),
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "controller.quorum.voters": ",".join(f"{node}@127.0.0.1:{cport}" for node, cport in sorted(voters.items())),
        "log.dirs": str(log_dir),
    }


@dataclass(frozen=True)
class KafkaJvm:
    """How a broker's JVM runs and where its jars come from: one for a broker, shared by every node of a cluster."""

    heap_mb: int = 512
    java: Path | str | None = None
    """The `java` to run (CRL_BROKER__JAVA); None: the one on PATH."""
    cache_dir: Path | None = None
    """Where the jars are kept (`install_kafka_jars`); None: the project's cache directory."""
    repository: str = MAVEN_CENTRAL
    """The Maven repository the jars are downloaded from."""


DEFAULT_JVM = KafkaJvm()


class ApacheKafkaBroker(BrokerProcess):
    """Apache Kafka (KRaft, one node) as a child JVM, its log in `data_dir` (durable across restarts)."""

    kind = "kafka"
    description = f"Apache Kafka {KAFKA_VERSION}"
    durable = True
    stop_timeout_s = 30.0

    def __init__(
        self,
        *,
        data_dir: Path,
        log_path: Path | None = None,
        port: int | None = None,
        jvm: KafkaJvm = DEFAULT_JVM,
        start_timeout_s: float = 90.0,
        overrides: dict[str, str] | None = None,
        node_id: int = 1,
        cluster_id: str | None = None,
        controller_port: int | None = None,
        voters: dict[int, int] | None = None,
        security: SecuredBus | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.security = security
        """TLS, SASL/SCRAM logins and ACL authorization (`infra.kafka_security`); None: a PLAINTEXT broker."""
        self.overrides = dict(overrides or {})
        """Broker settings that replace `BROKER_POLICY`'s (tests use them to stand in for a stock broker)."""
        self.node_id = node_id
        self.cluster_id = cluster_id
        """The KRaft cluster id to format with (a cluster's nodes share one); None: a new one."""
        self.voters = voters
        """node id -> controller port of every node of the quorum (`ApacheKafkaCluster`); None: this node alone."""
        listeners = self._remembered_ports()
        super().__init__(log_path=log_path, port=port or listeners.get("port"), start_timeout_s=start_timeout_s)
        self.controller_port = controller_port or listeners.get("controller_port") or free_loopback_port()
        self.jvm = jvm
        self._classpath: list[Path] = []
        self._java = ""
        if security is not None:
            self.client_options = security.client_options()

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "log"

    @property
    def properties_path(self) -> Path:
        return self.data_dir / "server.properties"

    @staticmethod
    def remembered_ports(data_dir: Path) -> dict[str, int]:
        """The ports of the last start on `data_dir`, when both are free again (the same bootstrap address)."""
        path = data_dir / "listeners.json"
        if not path.exists():
            return {}
        ports = json.loads(path.read_text())
        if all(port_is_free(port) for port in (ports["port"], ports["controller_port"])):
            return dict(ports)
        return {}

    def _remembered_ports(self) -> dict[str, int]:
        return self.remembered_ports(self.data_dir)

    def _prepare(self) -> None:
        self._java = locate_java(self.jvm.java)
        self._classpath = install_kafka_jars(self.jvm.cache_dir, self.jvm.repository)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        properties = server_properties(self.port, self.controller_port, self.log_dir, node_id=self.node_id,
                                       voters=self.voters)
        if self.security is not None:
            properties |= self.security.broker_properties(self.port, self.controller_port)
        properties |= self.overrides
        # A secured node's properties hold the broker's own logins: readable by the owner only.
        write_private(self.properties_path, "".join(f"{key}={value}\n" for key, value in properties.items()))
        (self.data_dir / "listeners.json").write_text(
            json.dumps({"port": self.port, "controller_port": self.controller_port}))
        if not (self.log_dir / "meta.properties").exists():
            self._format()

    def _java_command(self, main: str, *args: str, heap_mb: int) -> list[str]:
        return [
            self._java, f"-Xmx{heap_mb}m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
            "-XX:InitiatingHeapOccupancyPercent=35", "-XX:+ExplicitGCInvokesConcurrent", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            "-cp", ":".join(str(path) for path in self._classpath), main, *args,
        ]

    def _format(self) -> None:
        """`kafka-storage format`: a new cluster id, the metadata log of a single-node quorum; a secured node's SCRAM
        credentials (salted: no password on the command line)."""
        command = self._java_command("kafka.tools.StorageTool", "format",
                                     "--cluster-id", self.cluster_id or new_cluster_id(),
                                     "--config", str(self.properties_path),
                                     *(self.security.scram_arguments() if self.security is not None else ()),
                                     heap_mb=256)
        # A short-lived tool: the JIT's first tier is all it needs.
        command.insert(1, "-XX:TieredStopAtLevel=1")
        result = subprocess.run(command, capture_output=True, text=True, timeout=self.start_timeout_s)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as handle:
                handle.write(result.stdout + result.stderr)
        if result.returncode != 0:
            raise BrokerError(f"formatting the Kafka storage in {self.log_dir} failed (exit {result.returncode}): "
                              f"{(result.stderr or result.stdout).strip()[-1000:]}")

    def _command(self) -> list[str]:
        return self._java_command("kafka.Kafka", str(self.properties_path), heap_mb=self.jvm.heap_mb)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.apache_kafka", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch", help="download the pinned jars into the cache (once) and check them")
    fetch.add_argument("--cache-dir", type=Path, default=None)
    fetch.add_argument("--repository", default=MAVEN_CENTRAL)
    commands.add_parser("lock", help="resolve infra/kafka-broker/pom.xml with Maven and rewrite jars.lock")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "fetch":
            began = time.monotonic()
            jars = install_kafka_jars(args.cache_dir, args.repository)
            size = sum(path.stat().st_size for path in jars)
            print(f"Apache Kafka {KAFKA_VERSION}: {len(jars)} jars, {size / 1e6:.1f} MB, sha256 checked, in "
                  f"{jars[0].parent} ({time.monotonic() - began:.1f}s)")
        else:
            locked = write_lock()
            print(f"{LOCK_FILE}: {len(locked)} jars")
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
