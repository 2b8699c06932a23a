"""Broker fixtures shared by the integration and e2e tiers.

`kafka_bootstrap` gives every test empty registry topics on a real broker, in two tiers that run the same tests:
- `tansu`: a fresh embedded Tansu per test (it starts in ~20 ms and keeps records in memory, so a new process is the
  cleanest reset); the binary is located and checked once per session.
- `apache-kafka`: Apache Kafka 4.1.1, one broker per session; before each test every topic and consumer group is
  deleted and the registry topics are created anew. The broker is, in this order of preference:
  1. the embedded JVM broker (`infra/apache_kafka.py`) wherever Java 17+ runs; its jars come from Maven Central once
     (`make test` fetches them) and are sha256-checked;
  2. an `apache/kafka` container (testcontainers) where a Docker engine answers (the compose tier runs the same
     path on the Apache Kafka image built on this machine, `tests/compose/test_testcontainers.py`);
  3. neither: the tier is skipped with the reason, and fails instead on CI (`CI=true`).
  The session's header names the one it took.
`empty_kafka` is the same choice without topics, for tests of what creates them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Nothing a test loads may download (this machine and CI reach no model hub): before any test module imports
# transformers, whose hub settings are read at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from infra.admin import create_topics
from infra.apache_kafka import BROKER_POLICY, KAFKA_VERSION, ApacheKafkaBroker, install_kafka_jars, locate_java
from infra.broker import BrokerError, wait_until_answers
from infra.kafka import KafkaSettings, make_admin
from infra.tansu import TansuBroker, locate_tansu

APACHE_KAFKA_IMAGE = f"apache/kafka:{KAFKA_VERSION}"
_CHOSEN: dict[str, str] = {}
"""Which real broker each tier runs on in this process; every test that takes a broker records it (below)."""
SUMMARY = "session summary"
"""The key of the `user_properties` entries printed at the end of the run. Test reports carry them from pytest-xdist's
worker processes to the one that prints, where module globals of the workers would be lost."""


@pytest.fixture
def report_measurement(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """A function that puts one line of what the test measured in the session summary."""
    return lambda line: request.node.user_properties.append((SUMMARY, line))


def _record_tier(request: pytest.FixtureRequest, tier: str) -> None:
    request.node.user_properties.append((SUMMARY, f"broker tier {tier}: {_CHOSEN[tier]}"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines: dict[str, None] = {}  # in order, once each
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == SUMMARY and getattr(report, "when", "call") == "call":
                    lines[str(value)] = None
    tiers = sorted(line for line in lines if line.startswith("broker tier "))
    for line in [*tiers, *(line for line in lines if not line.startswith("broker tier "))]:
        terminalreporter.write_line(line)


TIER_OF_FOLDER = {"integration": "integration", "e2e": "e2e", "compose": "compose"}
RUNS = ("tests/e2e/", "tests/integration/test_pretrained_models.py")
"""The tests that run whole `crl run`s or load SmolLM2: under pytest-xdist they run one after another on one worker."""
LAST_RUN = "tests/e2e/test_scenario.py::"
"""...but for the Apache Kafka scenario (`[kafka]`): a unit of its own, last, for the worker that frees up first."""
COMPOSE = "tests/compose/"
"""The compose tier: a unit of its own, the first the other worker takes, so that its image builds (mostly downloads
and disk) and its stack run beside the SmolLM2 tests at the start of `RUNS` rather than after them. At the end of
`RUNS` instead, it made that worker's queue some 15 minutes longer than the other's. (Beside its image builds a run's
rollout group was once seen never to settle again after a member left, both members recreating their consumers
every 30 s for 18 minutes; the group watch now waits longer after each recreation in a row, with a random part.)"""
APACHE_KAFKA_FIXTURES = {"apache_kafka", "apache_kafka_bootstrap", "kafka_jars"}
APACHE_KAFKA_PARAMS = {"apache-kafka", "kafka"}


def _is_last_run(nodeid: str) -> bool:
    return nodeid.startswith(LAST_RUN) and nodeid.endswith("[kafka]")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (`make test` runs `-n 2`): the tests of `RUNS` form one unit of work, given to one worker
    and run in order there, while the other worker takes the compose tier (a unit too), then every other test one at
    a time; the Apache Kafka scenario comes last, as a unit of its own. Two whole runs side by side would only fight
    over two cores and the memory.
    (pytest-xdist's own `--dist loadgroup` cannot do this with pytest 9: the group it appends to a test's id no
    longer reaches the scheduler.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RunsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if _is_last_run(nodeid):
                return "apache-kafka scenario"
            if nodeid.startswith(COMPOSE):
                return "compose"
            return "runs" if nodeid.startswith(RUNS) else nodeid

    config.option.loadscopereorder = False  # units in the order `_order` gave, not the largest first
    return RunsTogether(config, log)


def _order(item: pytest.Item) -> int:
    """Where a test runs in the suite, and so the order of the units (the first appearance of each). SmolLM2 first:
    its warm starts are the longest thing a fresh machine computes, and nothing else runs beside them on that worker.
    The compose tier second: the first unit of the other worker. The Apache Kafka scenario last: by then the other
    worker has finished the short tests and takes it."""
    if _is_last_run(item.nodeid):
        return 4
    if item.nodeid.startswith(COMPOSE):
        return 1
    if item.nodeid.startswith(RUNS):
        return 0 if item.get_closest_marker("pretrained") else 2
    return 3


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks say what a test needs, and never drop a test they do not describe: every test of tests/integration and
    tests/e2e carries its folder's mark, and a test carries `apache_kafka` exactly when it runs on Apache Kafka (a
    fixture of that tier, or the tier's parameter of a broker fixture). Then the tests are put in `_order`."""
    wrong = []
    for item in items:
        folder = item.path.relative_to(config.rootpath / "tests").parts[0]
        if folder in TIER_OF_FOLDER:
            item.add_marker(TIER_OF_FOLDER[folder])
        params = getattr(item, "callspec", None)
        needs_kafka = bool(APACHE_KAFKA_FIXTURES & set(getattr(item, "fixturenames", ()))) or (
            params is not None and bool(APACHE_KAFKA_PARAMS & {str(v) for v in params.params.values()}))
        if needs_kafka != (item.get_closest_marker("apache_kafka") is not None):
            wrong.append(item.nodeid)
    if wrong:
        raise pytest.UsageError("the apache_kafka mark must be on exactly the tests that run on Apache Kafka; "
                                f"wrong on: {wrong}")
    items.sort(key=_order)


@dataclass(frozen=True)
class TestBroker:
    """A real broker a test may use: its address and which tier it belongs to."""

    __test__ = False  # not a test class, whatever its name says
    tier: str
    bootstrap_servers: str


@pytest.fixture(scope="session")
def tansu_bin() -> Path:
    """The Tansu binary, proven to start once; a missing broker fails the session (it is a dependency)."""
    try:
        binary = locate_tansu(os.environ.get("CRL_BROKER__TANSU_BIN"))
        TansuBroker(tansu_bin=binary).start().stop()
    except BrokerError as exc:
        pytest.fail(f"the embedded broker is required for integration tests: {exc}")
    _CHOSEN["tansu"] = f"embedded Tansu ({binary}), a fresh broker per test"
    return binary


@pytest.fixture
def tansu(tansu_bin: Path, tmp_path: Path) -> Iterator[TansuBroker]:
    with TansuBroker(tansu_bin=tansu_bin, log_path=tmp_path / "broker.log") as broker:
        yield broker


def _docker_engine_answers() -> str | None:
    """None if a Docker engine answers, else why not."""
    try:
        import docker

        docker.from_env(timeout=5).ping()
    except Exception as exc:  # noqa: BLE001 - docker raises several unrelated types when no daemon answers
        return f"no Docker engine answers ({type(exc).__name__}: {exc})"
    return None


def _embedded_apache_kafka(data_dir: Path) -> Iterator[str]:
    with ApacheKafkaBroker(data_dir=data_dir, log_path=data_dir / "broker.log") as broker:
        memory = (broker.resident_memory_bytes() or 0) / 2**20
        _CHOSEN["apache-kafka"] = (f"embedded Apache Kafka {KAFKA_VERSION} (child JVM, started in "
                                   f"{broker.start_seconds:.1f}s, {memory:.0f} MiB resident; log {broker.log_path})")
        yield broker.bootstrap_servers


def apache_kafka_container(image: str = APACHE_KAFKA_IMAGE) -> Iterator[str]:
    """Bootstrap address of a single-node KRaft Apache Kafka in a container of `image` (testcontainers), with the
    settings of the compose service and of the embedded broker; the container is removed at the end."""
    from testcontainers.core.container import DockerContainer

    container = (
        DockerContainer(image)
        .with_exposed_ports(9092)
        .with_env("KAFKA_LISTENERS", "PLAINTEXT://:9092,CONTROLLER://:9093")
        .with_env("KAFKA_CONTROLLER_QUORUM_VOTERS", "1@localhost:9093")
        .with_env("KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT")
    )
    for key, value in BROKER_POLICY.items():  # the settings of the compose service and of the embedded broker
        container.with_env("KAFKA_" + key.upper().replace(".", "_"), value)
    # The advertised address must be the mapped host port, known only after start: set it through the entrypoint.
    container.with_command(
        "bash -c 'until [ -f /tmp/advertised ]; do sleep 0.1; done; "
        "export KAFKA_ADVERTISED_LISTENERS=$(cat /tmp/advertised); exec /etc/kafka/docker/run'"
    )
    container.start()
    try:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(9092)
        container.exec(f"bash -c 'echo PLAINTEXT://{host}:{port} > /tmp/advertised'")
        wait_until_answers(f"{host}:{port}", timeout_s=90)
        _CHOSEN["apache-kafka"] = f"{image} container (testcontainers) at {host}:{port}"
        yield f"{host}:{port}"
    finally:
        container.stop()


@pytest.fixture(scope="session")
def apache_kafka_in_container() -> Callable[[str], contextlib.AbstractContextManager[str]]:
    """`apache_kafka_container` as a context manager, for the tests that pick the image."""
    return contextlib.contextmanager(apache_kafka_container)


@pytest.fixture(scope="session")
def kafka_jars() -> list[Path]:
    """Apache Kafka's pinned jars, for tests that start brokers of their own: skipped without Java (a failure on CI);
    where Java runs, a failure to install them fails the test."""
    try:
        locate_java()
    except BrokerError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Apache Kafka cannot run here: {exc}")
        pytest.skip(f"Apache Kafka cannot run here: {exc}")
    try:
        return install_kafka_jars()
    except BrokerError as exc:
        pytest.fail(f"Java runs here, so Apache Kafka must: {exc}")


@pytest.fixture(scope="session")
def apache_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap address of a single-node KRaft Apache Kafka: the embedded JVM broker, else a container."""
    try:
        locate_java()
    except BrokerError as java_missing:
        docker_missing = _docker_engine_answers()
        if docker_missing:
            reason = f"no Apache Kafka can start here: {java_missing}; and {docker_missing}"
            if os.environ.get("CI") == "true":
                pytest.fail(reason)
            pytest.skip(reason)
        yield from apache_kafka_container()
        return
    data_dir = tmp_path_factory.mktemp("apache-kafka")
    try:
        yield from _embedded_apache_kafka(data_dir)
    except BrokerError as exc:
        pytest.fail(f"Java runs here, so the Apache Kafka tier must: {exc}")
    shutil.rmtree(data_dir, ignore_errors=True)


def reset_apache_kafka(bootstrap: str, create: bool) -> None:
    """Delete every topic and consumer group a previous test left; create the registry topics when asked.

    A group that cannot be deleted (a process of an earlier test still holds it) or a topic that does not go away
    fails the test that finds it, not a later one that would read its records."""
    admin = make_admin(KafkaSettings(bootstrap_servers=bootstrap))
    try:
        groups = [group["group_id"] for group in admin.list_groups()]
        # A member that died without leaving keeps its group non-empty until its session times out (6 s).
        deadline = time.monotonic() + 20
        while groups:
            # A group that is gone by the time of the delete (its last member left, or the broker dropped it as
            # empty between the listing and the delete) answers GroupIdNotFoundError: gone is what we want.
            refused = {group: outcome for group, outcome in admin.delete_groups(groups).items()
                       if outcome not in ("OK", "GroupIdNotFoundError")}
            assert not refused or time.monotonic() < deadline, \
                f"consumer groups left by an earlier test could not be deleted: {refused}"
            groups = list(refused)
            if groups:
                time.sleep(0.5)
        existing = [name for name in admin.list_topics() if not name.startswith("__")]
        if existing:
            admin.delete_topics(existing)
            deadline = time.monotonic() + 30
            while set(existing) & set(admin.list_topics()):
                assert time.monotonic() < deadline, f"topics not deleted within 30 s: {existing}"
                time.sleep(0.1)
        if create:
            create_topics(admin)
    finally:
        admin.close()


def _tansu_with_topics(broker: TansuBroker) -> str:
    admin = make_admin(KafkaSettings(bootstrap_servers=broker.bootstrap_servers))
    try:
        create_topics(admin)
    finally:
        admin.close()
    return broker.bootstrap_servers


BROKER_TIERS = ["tansu", pytest.param("apache-kafka", marks=pytest.mark.apache_kafka)]


@pytest.fixture(params=BROKER_TIERS)
def kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    """A real broker with every registry topic created and empty."""
    if request.param == "tansu":
        bootstrap = _tansu_with_topics(request.getfixturevalue("tansu"))
    else:
        bootstrap = request.getfixturevalue("apache_kafka")
        reset_apache_kafka(bootstrap, create=True)
    _record_tier(request, request.param)
    return bootstrap


@pytest.fixture(params=BROKER_TIERS)
def empty_kafka(request: pytest.FixtureRequest) -> TestBroker:
    """A real broker with no topics at all (for what creates them)."""
    if request.param == "tansu":
        broker = TestBroker("tansu", request.getfixturevalue("tansu").bootstrap_servers)
    else:
        bootstrap = request.getfixturevalue("apache_kafka")
        reset_apache_kafka(bootstrap, create=False)
        broker = TestBroker("apache-kafka", bootstrap)
    _record_tier(request, request.param)
    return broker


@pytest.fixture
def apache_kafka_bootstrap(request: pytest.FixtureRequest, apache_kafka: str) -> str:
    """Apache Kafka alone (for what only it shows), every registry topic created and empty."""
    reset_apache_kafka(apache_kafka, create=True)
    _record_tier(request, "apache-kafka")
    return apache_kafka
