"""`crl` as a user runs it: real subprocesses, a real embedded broker, real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka import KafkaProducer

from infra.broker_process import port_is_free
from schemas.codec import encode
from schemas.examples import example_events
from schemas.topics import EVENT_TYPES, TOPICS, topic_of

pytestmark = pytest.mark.integration

CRL = [sys.executable, "-m", "pipeline.cli"]


def crl(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    return subprocess.run([*CRL, *args], capture_output=True, text=True, timeout=timeout,
                          env={**clean, "COLUMNS": "200", **(env or {})})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purposes
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def test_doctor_embedded_passes_every_check():
    result = crl("doctor", "--embedded")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "broker reachable" in out
    for topic in TOPICS:
        assert f"topic {topic.name}" in out
    for kind in EVENT_TYPES:
        assert f"round trip {kind}" in out
    for check in ("SQL SQLite", "embedding model", "NLE / MiniHack", "textworld-express", "scienceworld"):
        assert check in out
    assert out.count("JVM started") == 2  # each text-world engine started, a game reset and stepped
    assert "Tansu reports no broker configs" in out  # its limits row says why there is nothing to compare
    checks = 1 + len(TOPICS) + 1 + len(EVENT_TYPES) + 5
    assert f"{checks} passed, 0 failed" in out


@pytest.mark.apache_kafka
def test_doctor_embedded_apache_kafka_passes_every_check_and_reads_the_broker_limits(kafka_jars):
    result = crl("doctor", "--embedded", "--broker", "kafka", env={"COLUMNS": "1000"}, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "embedded Apache Kafka 4.1.1 at 127.0.0.1:" in out
    assert "CRL_KAFKA__SESSION_TIMEOUT_MS=6000 within the broker's [6000, 1800000] ms" in out
    assert "records up to 1049600 bytes fit" in out and "every registry topic keeps its records" in out
    checks = 1 + len(TOPICS) + 3 + len(EVENT_TYPES) + 5  # SQL, embeddings, NLE and the two text-world engines
    assert f"{checks} passed, 0 failed" in out


def test_doctor_checks_postgresql_when_configured_and_fails_on_a_bad_url(postgres_url):
    good = crl("doctor", "--embedded", env={"CRL_DB__URL": postgres_url})
    assert good.returncode == 0, good.stdout + good.stderr
    assert "SQL CRL_DB__URL" in good.stdout and "postgresql" in good.stdout
    bad = crl("doctor", "--embedded", env={"CRL_DB__URL": "postgresql+psycopg://nobody@127.0.0.1:1/none"})
    assert bad.returncode == 1
    assert "1 failed" in bad.stdout


def test_envs_list_says_what_each_environment_needs_and_whether_it_runs_here():
    result = crl("envs", "list", env={"COLUMNS": "300"})
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 4}
    for env_id in ("TWX-CookingWorld", "TWX-TWC", "TWX-CoinCollector", "ScienceWorld"):
        assert "Java 17" in rows[env_id] and "│ yes" in rows[env_id]
    assert "alfworld + its game files" in rows["ALFWorld"] and "no: see docs/environments.md" in rows["ALFWorld"]


def test_doctor_without_a_broker_fails_with_the_reason(tmp_path):
    result = crl("doctor", "--run-dir", str(tmp_path))
    assert result.returncode == 1
    assert "no broker" in result.stdout


STACKS = ["tansu", pytest.param("kafka", marks=pytest.mark.apache_kafka)]


def _stack_up(run_dir: Path, kind: str, **popen: object) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    clean["COLUMNS"] = "300"  # one line per message
    return subprocess.Popen([*CRL, "stack", "up", "--run-dir", str(run_dir), "--broker", kind], env=clean,
                            **popen)  # type: ignore[call-overload]


def _wait_for(path: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert path.exists(), f"stack up wrote no {path.name}"


@pytest.mark.parametrize("kind", STACKS)
def test_stack_up_worker_and_audit_end_to_end(tmp_path, kind, request):
    if kind == "kafka":
        request.getfixturevalue("kafka_jars")  # skipped without Java, like every Apache Kafka test
    run_dir = tmp_path / "run"
    stack = _stack_up(run_dir, kind, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    broker_file = run_dir / "broker.json"
    try:
        _wait_for(broker_file)
        broker = json.loads(broker_file.read_text())
        assert broker["kind"] == kind
        described = crl("topics", "describe", "--run-dir", str(run_dir))
        assert described.returncode == 0, described.stdout + described.stderr
        assert "crl.trajectories" in described.stdout
        producer = KafkaProducer(bootstrap_servers=broker["bootstrap_servers"])
        events = example_events("cli-run")
        for event in events:
            topic = topic_of(event)
            producer.send(topic.name, key=topic.key_bytes(event), value=encode(event))
        producer.send("crl.trajectories", value=b"not an event")
        producer.close()
        # every example, the garbage record, and the dead letter the archiver itself wrote for that record
        worker = crl("worker", "archiver", "--run-dir", str(run_dir), "--max-events", str(len(events) + 2),
                     "--timeout", "60")
        assert worker.returncode == 0, worker.stdout + worker.stderr
        assert f"max_events={len(events) + 2} reached" in worker.stdout
        counts = crl("audit", "sql", str(run_dir), "SELECT kind, count(*) AS n FROM events GROUP BY kind",
                     "--format", "json")
        assert counts.returncode == 0, counts.stderr
        rows = {row["kind"]: row["n"] for row in map(json.loads, counts.stdout.splitlines())}
        assert rows == {**dict.fromkeys(EVENT_TYPES, 1), "DeadLetter": 2}
        listed = crl("audit", "events", str(run_dir), "--kind", "PolicyPublished", "--limit", "5")
        assert listed.returncode == 0 and "PolicyPublished" in listed.stdout and "1 rows" in listed.stdout
        assert list((run_dir / "logs").glob("*.log")), "worker and broker logs belong in the run dir"
        assert list((run_dir / "metrics").glob("*.jsonl"))
    finally:
        stack.send_signal(signal.SIGINT)
        output, _ = stack.communicate(timeout=60)
    assert stack.returncode == 0, output
    assert "broker stopped" in output and "started in" in output and "MiB resident" in output
    assert not broker_file.exists()
    assert not _alive(broker["pid"])
    if kind == "kafka":
        # Apache Kafka's log lives in the run directory: the same command continues it, records and all, on the
        # same address when its ports are still free (another process may have taken one meanwhile)
        remembered = json.loads((run_dir / "kafka" / "listeners.json").read_text())
        free = all(port_is_free(port) for port in remembered.values())
        again = _stack_up(run_dir, kind, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_for(broker_file)
            address = json.loads(broker_file.read_text())["bootstrap_servers"]
            assert (address == broker["bootstrap_servers"]) == free, (address, broker["bootstrap_servers"], free)
            described = crl("topics", "describe", "--run-dir", str(run_dir))
            assert described.returncode == 0, described.stdout + described.stderr
            dead_letters = next(line for line in described.stdout.splitlines() if "crl.dead-letters" in line)
            assert " 2 " in dead_letters  # the two dead letters written before the restart are still there
        finally:
            again.send_signal(signal.SIGINT)
            output, _ = again.communicate(timeout=60)
        assert again.returncode == 0, output


@pytest.mark.apache_kafka
def test_stack_up_starts_a_three_broker_cluster_and_stops_every_node(tmp_path, kafka_jars):
    stack = subprocess.Popen([*CRL, "stack", "up", "--run-dir", str(tmp_path), "--broker", "kafka", "--brokers", "3"],
                             env={k: v for k, v in os.environ.items() if not k.startswith("CRL_")} | {"COLUMNS": "300"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    broker_file = tmp_path / "broker.json"
    try:
        _wait_for(broker_file)
        broker = json.loads(broker_file.read_text())
        assert len(broker["bootstrap_servers"].split(",")) == 3 and set(broker["node_pids"]) == {"1", "2", "3"}
        described = crl("topics", "describe", "--run-dir", str(tmp_path))
        assert described.returncode == 0 and "crl.trajectories" in described.stdout, described.stderr
    finally:
        stack.send_signal(signal.SIGINT)
        output, _ = stack.communicate(timeout=90)
    assert stack.returncode == 0, output
    assert "Apache Kafka 4.1.1 (3 brokers)" in output and "broker-*.log" in output and "broker stopped" in output
    assert not any(_alive(pid) for pid in broker["node_pids"].values())
    assert sorted(p.name for p in (tmp_path / "logs").glob("broker-*.log")) == [f"broker-{n}.log" for n in (1, 2, 3)]


@pytest.mark.parametrize("kind", STACKS)
def test_broker_dies_with_its_parent(tmp_path, kind, request):
    if kind == "kafka":
        request.getfixturevalue("kafka_jars")
    stack = _stack_up(tmp_path, kind, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    broker_file = tmp_path / "broker.json"
    _wait_for(broker_file)
    pid = json.loads(broker_file.read_text())["pid"]
    assert _alive(pid)
    stack.kill()  # SIGKILL: no cleanup code runs in the parent
    stack.wait()
    deadline = time.monotonic() + 40  # Apache Kafka shuts down in a controlled way on the SIGTERM it is sent
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"the {kind} child outlived its killed parent"


def test_cli_errors_become_exit_codes_with_reasons(tmp_path):
    unknown = crl("worker", "nope", "--run-dir", str(tmp_path))
    assert unknown.returncode == 2
    assert "unknown worker 'nope'" in unknown.stderr and "archiver" in unknown.stderr
    no_broker = crl("worker", "archiver", "--run-dir", str(tmp_path))
    assert no_broker.returncode == 2 and "no broker" in no_broker.stderr
    invalid = crl("doctor", env={"CRL_MAX_PAYLOAD_BYTES": "-1", "CRL_KAFKA__ACKS": "some"})
    assert invalid.returncode == 2
    assert "CRL_MAX_PAYLOAD_BYTES" in invalid.stderr and "CRL_KAFKA__ACKS" in invalid.stderr
    (tmp_path / "archive").mkdir()
    write = crl("audit", "sql", str(tmp_path), "DELETE FROM events")
    assert write.returncode == 1 and "only SELECT / EXPLAIN" in write.stderr
    typo = tmp_path / "no-such-run"
    missing = crl("audit", "sql", str(typo), "SELECT count(*) FROM events")
    assert missing.returncode == 2 and "no run directory" in missing.stderr
    assert not typo.exists()  # a read-only command creates nothing
    level = crl("--log-level", "loud", "doctor")
    assert level.returncode == 2 and "'loud' is not one of" in level.stderr
    cluster = crl("stack", "up", "--brokers", "3", "--broker", "tansu", "--run-dir", str(tmp_path))
    assert cluster.returncode == 2 and "3 brokers need the Apache Kafka broker (--broker kafka)" in cluster.stderr


def test_every_command_has_help_text():
    """The installed command answers `--help` in a process of its own; then every command of the tree, in this
    process (a process per command would only time Python's start-up again), says what it does."""
    import typer
    from typer.testing import CliRunner

    from pipeline.cli import app

    top = crl("--help")
    assert top.returncode == 0 and "Usage" in top.stdout, top.stderr
    root = typer.main.get_command(app)
    for name in ("run", "topics", "stack", "worker", "doctor", "audit", "replay", "report", "config", "envs"):
        assert name in top.stdout

    def paths(command, prefix):  # every command of the tree, groups included
        yield prefix, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from paths(sub, [*prefix, name])

    runner = CliRunner()
    for path, command in paths(root, []):
        assert (command.help or "").strip(), f"crl {' '.join(path)} has no help text"
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0 and "Usage" in result.output, (path, result.output)


def test_topics_create_then_doctor_against_an_external_broker(empty_kafka):
    env = {"CRL_KAFKA__BOOTSTRAP_SERVERS": empty_kafka.bootstrap_servers}
    before = crl("doctor", env=env)
    assert before.returncode == 1 and "missing: run `crl topics create`" in before.stdout
    created = crl("topics", "create", env=env)
    assert created.returncode == 0, created.stderr
    assert created.stdout.count("created") == len(TOPICS)
    again = crl("topics", "create", env=env)
    assert again.stdout.count("exists") == len(TOPICS)  # idempotent
    after = crl("doctor", env=env)
    assert after.returncode == 0, after.stdout + after.stderr
    assert f"Kafka at {empty_kafka.bootstrap_servers}" in after.stdout
    assert "via crl.doctor-" in after.stdout
    if empty_kafka.tier == "apache-kafka":
        # the broker's limits, read from the broker, against the client's settings
        assert "CRL_KAFKA__SESSION_TIMEOUT_MS=6000 within the broker's [6000, 1800000] ms" in after.stdout
        assert "records up to 1049600 bytes fit" in after.stdout
        assert "every registry topic keeps its records" in after.stdout
    # Nothing was written into the run topics, and the scratch topic is gone.
    from infra.admin import describe_topics, existing_partition_counts
    from infra.kafka import KafkaSettings, make_admin, make_consumer

    kafka = KafkaSettings(bootstrap_servers=empty_kafka.bootstrap_servers)
    admin, consumer = make_admin(kafka), make_consumer(kafka)
    try:
        assert all(status.messages == 0 for status in describe_topics(admin, consumer))
        assert not [name for name in existing_partition_counts(admin) if name.startswith("crl.doctor-")]
    finally:
        admin.close()
        consumer.close()


@pytest.mark.apache_kafka
def test_doctor_names_the_client_setting_apache_kafka_refuses(apache_kafka_bootstrap):
    """The defect Tansu hid: a 2 s group session is below Apache Kafka's default minimum of 6 s."""
    result = crl("doctor", env={"CRL_KAFKA__BOOTSTRAP_SERVERS": apache_kafka_bootstrap,
                                "CRL_KAFKA__SESSION_TIMEOUT_MS": "2000",
                                "CRL_KAFKA__HEARTBEAT_INTERVAL_MS": "500", "CRL_MAX_PAYLOAD_BYTES": "9000000",
                                "COLUMNS": "1000"})  # wide enough that no detail wraps
    assert result.returncode == 1
    out = result.stdout
    assert "CRL_KAFKA__SESSION_TIMEOUT_MS=2000 is below the broker's group.min.session.timeout.ms=6000" in out
    assert "set CRL_KAFKA__SESSION_TIMEOUT_MS to 6000 or more" in out
    assert "set CRL_MAX_PAYLOAD_BYTES to at most 8387584" in out
