"""`crl doctor`: checks that everything a run needs is here and works, one row per check.

    crl doctor --embedded      # starts a throwaway embedded broker and checks against it (--broker kafka: Apache Kafka)
    crl doctor                 # checks the broker of CRL_KAFKA__BOOTSTRAP_SERVERS (or of the run dir)

Checks: broker reachable; the broker's limits against the client's settings (group session timeout, record size,
topic retention; each failure names the setting to change); every registry topic present with its partition count;
a round trip through Kafka of one valid example of every event kind (decoded equal; through the registry topics of
the throwaway embedded broker, or through a scratch topic deleted afterwards on an external Kafka, whose run topics
get no test events); the SQL database (SQLite, and PostgreSQL when CRL_DB__URL is set); the embedding model loads
offline; NLE / MiniHack import and step.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

from infra.admin import TOPIC_MAX_MESSAGE_BYTES, create_topics, existing_partition_counts
from infra.broker import embedded_broker, wait_until_answers
from infra.db import check_connection, current_revision, make_engine, migrate
from infra.kafka import KafkaSettings, make_admin, make_producer
from pipeline.bank.embeddings import load_sentence_encoder
from pipeline.runtime.context import resolve_kafka
from pipeline.runtime.log import KafkaLog
from pipeline.runtime.transport import Record
from pipeline.settings import Settings
from schemas.codec import decode, encode
from schemas.examples import example_events
from schemas.topics import TOPICS, topic_of


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _attempt(name: str, action: Callable[[], str]) -> Check:
    try:
        return Check(name, True, action())
    except Exception as exc:  # noqa: BLE001 - a doctor reports every failure as a row, not stopping at the first
        return Check(name, False, f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def _broker(settings: Settings, embedded: bool, scratch: Path) -> Iterator[tuple[KafkaSettings | None, Check]]:
    if embedded:
        try:
            broker = embedded_broker(settings.broker, data_dir=scratch / "kafka",
                                     log_path=scratch / "broker.log").start()
        except Exception as exc:  # noqa: BLE001 - reported as a failed row
            yield None, Check("broker reachable", False, f"embedded broker: {type(exc).__name__}: {exc}")
            return
        try:
            kafka = settings.kafka.model_copy(update={"bootstrap_servers": broker.bootstrap_servers})
            yield kafka, Check("broker reachable", True, f"embedded {broker.description} at "
                                                         f"{broker.bootstrap_servers} (pid {broker.pid}, started in "
                                                         f"{broker.start_seconds:.1f}s)")
        finally:
            broker.stop()
        return
    try:
        kafka = resolve_kafka(settings)
        wait_until_answers(kafka.require_bootstrap(), timeout_s=10)
    except Exception as exc:  # noqa: BLE001 - reported as a failed row
        yield None, Check("broker reachable", False, f"{type(exc).__name__}: {exc}")
        return
    yield kafka, Check("broker reachable", True, f"Kafka at {kafka.bootstrap_servers}")


def _topic_checks(kafka: KafkaSettings, create: bool) -> list[Check]:
    admin = make_admin(kafka)
    try:
        if create:
            create_topics(admin, replicas=kafka.replication_factor, min_insync=kafka.min_insync_replicas)
        counts = existing_partition_counts(admin)
    finally:
        admin.close()
    checks = []
    for topic in TOPICS:
        found = counts.get(topic.name)
        if found is None:
            checks.append(Check(f"topic {topic.name}", False, "missing: run `crl topics create`"))
        else:
            checks.append(Check(f"topic {topic.name}", found == topic.partitions,
                                f"{found} partitions (registry: {topic.partitions})"))
    return checks


TANSU_CLUSTER_ID = "tansu_cluster"
"""The cluster id every Tansu broker reports; Tansu answers no broker configs and accepts any session timeout."""

RECORD_OVERHEAD_BYTES = 1024
"""Room a record needs beyond its value: key, headers and the record batch header."""

_BROKER_LIMITS = ("group.min.session.timeout.ms", "group.max.session.timeout.ms", "group.initial.rebalance.delay.ms")


def _config_values(admin: KafkaAdminClient, resource: ConfigResource) -> dict[str, str]:
    described = admin.describe_configs([resource], config_filter="all")
    entries: dict[str, Any] = next(iter(described.get(resource.resource_type.name.lower(), {}).values()), {})
    return {name: entry["value"] for name, entry in entries.items() if entry.get("value") is not None}


def _limits_checks(kafka: KafkaSettings, max_payload_bytes: int) -> list[Check]:
    """The broker's limits against the client's settings; every failure names the setting to change."""
    admin = make_admin(kafka, client_id="crl-doctor")
    try:
        cluster = admin.describe_cluster()
        if cluster.get("cluster_id") == TANSU_CLUSTER_ID:
            return [Check("broker limits", True, "Tansu reports no broker configs and accepts any group session "
                                                 "timeout; its retention is memory-only (nothing to compare)")]
        brokers = [_config_values(admin, ConfigResource(ConfigResourceType.BROKER, str(broker["broker_id"]),
                                                        dict.fromkeys(_BROKER_LIMITS)))
                   for broker in cluster["brokers"]]
        topics = {topic.name: _config_values(admin, ConfigResource(ConfigResourceType.TOPIC, topic.name,
                                                                   {"max.message.bytes": None, "retention.ms": None}))
                  for topic in TOPICS}
    finally:
        admin.close()
    return [_session_check(kafka, brokers), _record_size_check(kafka, max_payload_bytes, topics),
            _retention_check(topics)]


def _session_check(kafka: KafkaSettings, brokers: list[dict[str, str]]) -> Check:
    unreported = sorted({name for broker in brokers for name in _BROKER_LIMITS if name not in broker})
    if unreported:
        return Check("broker limits: group session", False,
                     f"the broker did not report {', '.join(unreported)}; compare them with "
                     f"CRL_KAFKA__SESSION_TIMEOUT_MS={kafka.session_timeout_ms} by hand")
    # Every broker may coordinate a group, so the tightest limits count.
    low = max(int(b["group.min.session.timeout.ms"]) for b in brokers)
    high = min(int(b["group.max.session.timeout.ms"]) for b in brokers)
    delay = max(int(b["group.initial.rebalance.delay.ms"]) for b in brokers)
    session = kafka.session_timeout_ms
    notes = f"; groups wait {delay} ms before their first assignment (group.initial.rebalance.delay.ms)" if delay \
        else ""
    if session < low:
        return Check("broker limits: group session", False,
                     f"CRL_KAFKA__SESSION_TIMEOUT_MS={session} is below the broker's group.min.session.timeout.ms="
                     f"{low}, so consumer groups cannot join: set CRL_KAFKA__SESSION_TIMEOUT_MS to {low} or more "
                     "(or lower group.min.session.timeout.ms on the broker)")
    if session > high:
        return Check("broker limits: group session", False,
                     f"CRL_KAFKA__SESSION_TIMEOUT_MS={session} is above the broker's group.max.session.timeout.ms="
                     f"{high}: set CRL_KAFKA__SESSION_TIMEOUT_MS to {high} or less")
    return Check("broker limits: group session", True,
                 f"CRL_KAFKA__SESSION_TIMEOUT_MS={session} within the broker's [{low}, {high}] ms" + notes)


def _record_size_check(kafka: KafkaSettings, max_payload_bytes: int, topics: dict[str, dict[str, str]]) -> Check:
    needed = max_payload_bytes + RECORD_OVERHEAD_BYTES
    # A topic's max.message.bytes (which `crl topics create` sets) overrides the broker's message.max.bytes.
    limits = {f"{name} (max.message.bytes)": int(values["max.message.bytes"])
              for name, values in topics.items() if "max.message.bytes" in values}
    if len(limits) < len(topics):
        missing = sorted(set(topics) - {name.split(" ")[0] for name in limits})
        return Check("broker limits: record size", False,
                     f"the broker did not report max.message.bytes of {', '.join(missing)}")
    where, smallest = min(limits.items(), key=lambda item: item[1])
    if smallest < needed:
        return Check("broker limits: record size", False,
                     f"{where} accepts records up to {smallest} bytes, but CRL_MAX_PAYLOAD_BYTES={max_payload_bytes} "
                     f"allows {needed} with key and headers: set CRL_MAX_PAYLOAD_BYTES to at most "
                     f"{smallest - RECORD_OVERHEAD_BYTES}, or raise that topic's max.message.bytes "
                     f"(`crl topics create` gives new topics {TOPIC_MAX_MESSAGE_BYTES})")
    if kafka.max_request_size < needed:
        return Check("broker limits: record size", False,
                     f"CRL_KAFKA__MAX_REQUEST_SIZE={kafka.max_request_size} is below the {needed} bytes a record of "
                     f"CRL_MAX_PAYLOAD_BYTES={max_payload_bytes} needs: raise it")
    return Check("broker limits: record size", True,
                 f"records up to {needed} bytes fit; the smallest limit is {where}: {smallest}")


def _retention_check(topics: dict[str, dict[str, str]]) -> Check:
    registry = {topic.name: topic.retention_ms for topic in TOPICS}
    unreported = sorted(name for name, values in topics.items() if "retention.ms" not in values)
    if unreported:
        return Check("broker limits: retention", False,
                     f"the broker did not report retention.ms of {', '.join(unreported)}")
    shorter = {name: int(values["retention.ms"]) for name, values in topics.items()
               if "retention.ms" in values and registry[name] < 0 and int(values["retention.ms"]) >= 0}
    if shorter:
        listing = ", ".join(f"{name} {ms} ms" for name, ms in sorted(shorter.items()))
        return Check("broker limits: retention", False,
                     f"the log is the system of record, but these topics delete records by age: {listing}; set "
                     "retention.ms=-1 on them (kafka-configs.sh --alter --add-config retention.ms=-1)")
    return Check("broker limits: retention", True, "every registry topic keeps its records as the registry asks")


def _round_trip_checks(kafka: KafkaSettings, scratch_topic: str | None, timeout_s: float = 15.0) -> list[Check]:
    """Produce one example of every kind, read each back by event id, and compare the decoded event.

    With `scratch_topic` every example goes through that one topic (created here, deleted after), so a doctor run
    against a production Kafka writes nothing into the run topics; otherwise each goes to its registry topic.
    """
    events = example_events(run_id=f"doctor-{uuid.uuid4().hex[:8]}")
    wanted = {str(event.event_id): event for event in events}
    received: dict[str, bytes] = {}
    log_ = KafkaLog(kafka, client_id="crl-doctor")
    admin = make_admin(kafka) if scratch_topic else None
    producer = make_producer(kafka, client_id="crl-doctor")
    try:
        if admin is not None:
            assert scratch_topic is not None  # the admin client is made only to create and delete it
            admin.create_topics([NewTopic(scratch_topic, 1, 1)])
            deadline = time.monotonic() + timeout_s
            while scratch_topic not in admin.list_topics() and time.monotonic() < deadline:
                time.sleep(0.1)
            start = {(scratch_topic, 0): 0}
        else:  # the ends now, before our records land
            start = {(t.name, p): end for t in TOPICS for p, end in log_.end_offsets(t).items()}
        for event in events:
            topic = topic_of(event)
            producer.send(scratch_topic or topic.name, key=topic.key_bytes(event), value=encode(event))
        producer.flush(timeout=timeout_s)

        def arrived(record: Record) -> bool:
            value = record.value or b""
            try:
                event_id = json.loads(value)["event_id"]
            except (ValueError, KeyError, TypeError):
                return False  # someone else's record on a shared broker
            if event_id in wanted:
                received[event_id] = value
            return len(received) == len(wanted)

        log_.records_after(start, arrived, timeout_s)
    finally:
        producer.close(timeout=5)
        if admin is not None:
            admin.delete_topics([scratch_topic])
            admin.close()
    checks = []
    via = scratch_topic or "its registry topic"
    for event_id, event in wanted.items():
        name = f"round trip {event.kind}"
        if event_id not in received:
            checks.append(Check(name, False, f"not read back from {via} within {timeout_s:.0f}s"))
            continue
        decoded = decode(topic_of(event), received[event_id])
        where = scratch_topic or topic_of(event).name
        checks.append(Check(name, decoded == event, f"{len(received[event_id])} bytes via {where}"
                            + ("" if decoded == event else ": decoded event differs")))
    return checks


def _sql_check(url: str, apply_migrations: bool) -> str:
    """Connect; on the scratch database also apply every migration (a user's database is only inspected)."""
    engine = make_engine(url)
    try:
        server = check_connection(engine)
        if apply_migrations:
            migrate(engine)
        return f"{server}, schema revision {current_revision(engine) or 'none (workers migrate on start)'}"
    finally:
        engine.dispose()


def _embedding_check(model: str) -> str:
    encoder = load_sentence_encoder(model)
    vector = encoder.encode(["reach the staircase down"], convert_to_numpy=True)
    return f"{model} offline, dim {vector.shape[1]}"


def _nle_check() -> str:
    import gymnasium
    import minihack  # noqa: F401  (registers the MiniHack environments)
    import nle

    env = gymnasium.make("MiniHack-Room-5x5-v0")
    try:
        env.reset()
        env.step(0)
    finally:
        env.close()
    return f"nle {nle.__version__}, MiniHack-Room-5x5-v0 reset and stepped"


def _engine_check(name: str, settings: Settings) -> Check:
    """A text-world engine: its JVM started, one game reset and stepped. A failure fails the doctor only where the
    config's mixture plays that engine; otherwise the row says what the engine would need."""
    from pipeline.envs.jvm import engine_requirements
    from pipeline.envs.registry import ENV_SPECS, make_env

    env_ids = [spec.env_id for spec in ENV_SPECS.values() if spec.engine == name]
    used = any(task.env_id in env_ids for task in settings.envs.tasks)
    label = f"{name} ({', '.join(env_ids)})"
    if (missing := engine_requirements(name)) is not None:
        return Check(label, not used, f"{missing}" + ("" if used else "; the config does not play it"))

    def play() -> str:
        env = make_env(env_ids[0], settings.envs)
        try:
            env.reset(1)
            outcome = env.step(env.available_actions()[0])
        finally:
            env.close()
        return f"JVM started, {env_ids[0]} reset and stepped ({len(outcome.info.available_actions)} valid actions)"
    check = _attempt(label, play)
    if used or check.ok:
        return check
    return Check(label, True, f"{check.detail}; the config does not play it")


def run_checks(settings: Settings, embedded: bool) -> list[Check]:
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="crl-doctor-") as scratch:
        scratch_dir = Path(scratch)
        with _broker(settings, embedded, scratch_dir) as (kafka, reachable):
            checks.append(reachable)
            if kafka is not None:
                try:
                    topic_checks = _topic_checks(kafka, create=embedded)
                except Exception as exc:  # noqa: BLE001 - reported as a failed row
                    topic_checks = [Check("topics", False, f"{type(exc).__name__}: {exc}")]
                checks += topic_checks
                if all(check.ok for check in topic_checks):
                    try:
                        checks += _limits_checks(kafka, settings.max_payload_bytes)
                    except Exception as exc:  # noqa: BLE001 - reported as a failed row
                        checks.append(Check("broker limits", False, f"{type(exc).__name__}: {exc}"))
                if all(check.ok for check in topic_checks):
                    try:
                        scratch_topic = None if embedded else f"crl.doctor-{uuid.uuid4().hex[:12]}"
                        checks += _round_trip_checks(kafka, scratch_topic)
                    except Exception as exc:  # noqa: BLE001 - reported as a failed row
                        checks.append(Check("round trip", False, f"{type(exc).__name__}: {exc}"))
                else:
                    # Sending to a missing topic would block on metadata for a minute per event.
                    checks.append(Check("round trip", False, "not attempted: the topics above are not all ready"))
        checks.append(_attempt("SQL SQLite", lambda: _sql_check(f"sqlite:///{scratch_dir / 'doctor.sqlite3'}", True)))
        if db_url := settings.db.url:
            checks.append(_attempt("SQL CRL_DB__URL", lambda: _sql_check(db_url, False)))
    checks.append(_attempt("embedding model", lambda: _embedding_check(settings.embedding.model)))
    checks.append(_attempt("NLE / MiniHack", _nle_check))
    checks += [_engine_check(name, settings) for name in ("textworld-express", "scienceworld")]
    return checks
