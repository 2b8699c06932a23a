"""Kafka client settings and the one factory every producer, consumer and admin client comes from.

The defaults are tuned for kafka-python against both Apache Kafka and the embedded Tansu broker (measurements in
docs/kafka.md). SASL/TLS fields pass straight through to kafka-python, so pointing `CRL_KAFKA__BOOTSTRAP_SERVERS`
at a secured cluster needs only environment variables, e.g.::

    CRL_KAFKA__BOOTSTRAP_SERVERS=broker:9093 CRL_KAFKA__SECURITY_PROTOCOL=SASL_SSL \
    CRL_KAFKA__SASL_MECHANISM=SCRAM-SHA-512 CRL_KAFKA__SASL_PLAIN_USERNAME=crl CRL_KAFKA__SASL_PLAIN_PASSWORD=... \
    crl worker archiver
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping
from typing import Any, Literal

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ACLOperation
from kafka.errors import KafkaTimeoutError
from kafka.structs import OffsetAndMetadata
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from infra.errors import ConfigError
from infra.kafka_group_join import finish_completed_joins
from infra.kafka_io_loop import guard_cross_thread_calls

guard_cross_thread_calls()
finish_completed_joins()


class KafkaSettings(BaseModel):
    """How to reach the broker and how clients behave. Environment: `CRL_KAFKA__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: str | None = Field(
        default=None,
        description="host:port[,host:port]. None: use the embedded broker of the run directory (`crl stack up`).",
    )
    client_id: str = Field(default="crl", description="Client id prefix shown in broker logs.")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="Passed to kafka-python unchanged."
    )
    # OAUTHBEARER and GSSAPI need a token provider / Kerberos setup that plain settings cannot carry.
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        default=None, description="SASL mechanism with SASL_PLAINTEXT / SASL_SSL.")
    sasl_plain_username: str | None = Field(default=None, description="SASL user name.")
    sasl_plain_password: SecretStr | None = Field(
        default=None, description="SASL password (masked in RunStarted and `crl config show`).")
    ssl_cafile: str | None = Field(default=None, description="CA bundle for SSL / SASL_SSL.")
    ssl_certfile: str | None = Field(default=None, description="Client certificate (mutual TLS).")
    ssl_keyfile: str | None = Field(default=None, description="Client key (mutual TLS).")
    ssl_check_hostname: bool = Field(default=True, description="Check the broker's certificate names its host.")

    # Producer: kafka-python's CPU is the bottleneck, so batch generously; 5 ms of linger costs nothing next to an
    # LLM generation and gave ~33k msg/s of 1 KiB here (docs/kafka.md).
    linger_ms: int = Field(default=5, ge=0, description="Producer batching delay.")
    batch_size: int = Field(default=256 * 1024, gt=0, description="Producer batch size in bytes.")
    compression_type: Literal["lz4", "zstd", "gzip", "snappy"] | None = Field(
        default="lz4", description="lz4 and zstd cost little; gzip is CPU-bound (~5k msg/s)."
    )
    acks: Literal["all", 0, 1] = Field(default="all", description="'all': an acknowledged record is durable.")
    max_request_size: int = Field(
        default=2 * 1024 * 1024, gt=0, description="Largest produce request; above the 1 MiB event payload cap."
    )

    # Consumer: large fetches (44-92k msg/s with 2000-5000 records a poll here).
    max_poll_records: int = Field(default=2000, gt=0, description="Most records one poll returns.")
    fetch_max_bytes: int = Field(default=64 * 1024 * 1024, gt=0, description="Most bytes one fetch returns.")
    max_partition_fetch_bytes: int = Field(
        default=8 * 1024 * 1024, gt=0, description="Most bytes one fetch returns per partition.")
    # Group membership. Apache Kafka refuses a JoinGroup whose session timeout lies outside the broker's
    # [group.min.session.timeout.ms, group.max.session.timeout.ms] = [6,000, 1,800,000] ms by default; 6 s is the
    # shortest a stock broker (compose, the embedded Apache Kafka, a managed cluster) accepts. A dead member's
    # partitions move after it. On Tansu a joining member waits half the session timeout (3 s) for its partitions.
    # `crl doctor` compares these with the broker's limits.
    session_timeout_ms: int = Field(
        default=6000, gt=0, description="Consumer-group session timeout; must lie within the broker's limits.")
    heartbeat_interval_ms: int = Field(
        default=1000, gt=0, description="Group heartbeats; below the session timeout (a third of it is usual).")
    # Far above any gap between polls: an overrun leader left the live members without partitions on Tansu.
    max_poll_interval_ms: int = Field(
        default=300_000, gt=0, description="Longest gap between polls before a group member is considered gone.")
    request_timeout_ms: int = Field(default=30_000, gt=0, description="How long a client waits for one request.")
    # Replication of the topics `crl topics create` makes (existing topics keep theirs).
    replication_factor: int | None = Field(
        default=None, ge=1, description="Replicas of each new topic. None: min(3, the brokers the cluster has).")
    min_insync_replicas: int | None = Field(
        default=None, ge=1,
        description="Replicas a write with acks=all must reach. None: 2 with 3 or more replicas, else 1.")
    # Riding out a broker restart: clients reconnect at most a second after the broker is back (kafka-python's
    # default backs off up to 30 s), and a producer keeps a record for up to two minutes of outage before it
    # reports the send as failed.
    reconnect_backoff_max_ms: int = Field(default=1000, gt=0, description="Longest wait between reconnects.")
    delivery_timeout_ms: int = Field(
        default=120_000, gt=0, description="How long a producer keeps retrying a record before the send fails.")
    # A log restored from the archive into a fresh broker (`crl run --resume` of a run on the memory-only Tansu) has
    # the same records at the same offsets under new topic ids; the run's positions, archive, dead letters and bank
    # count in the ids of the log they were written against, so the restored topics go by those.
    log_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Topic id of this broker -> the id of the log it was restored from (set by `crl run --resume`).")

    @model_validator(mode="after")
    def _heartbeats_fit_the_session(self) -> KafkaSettings:
        # A member whose heartbeats are further apart than its session is declared dead between two of them.
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below session_timeout_ms "
                             f"({self.session_timeout_ms}); a third of it is usual")
        return self

    def security(self) -> dict[str, Any]:
        """The connection and security keywords shared by every client."""
        options: dict[str, Any] = {
            "bootstrap_servers": self.require_bootstrap().split(","),
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            options["sasl_mechanism"] = self.sasl_mechanism
            options["sasl_plain_username"] = self.sasl_plain_username
            if self.sasl_plain_password is not None:
                options["sasl_plain_password"] = self.sasl_plain_password.get_secret_value()
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(self, name):
                options[name] = getattr(self, name)
        if self.security_protocol in ("SSL", "SASL_SSL"):
            options["ssl_check_hostname"] = self.ssl_check_hostname
        return options

    def require_bootstrap(self) -> str:
        if not self.bootstrap_servers:
            raise ConfigError("no Kafka bootstrap servers configured")
        return self.bootstrap_servers


def make_producer(settings: KafkaSettings, client_id: str | None = None) -> KafkaProducer:
    return KafkaProducer(
        **settings.security(), client_id=client_id or settings.client_id,
        linger_ms=settings.linger_ms, batch_size=settings.batch_size, compression_type=settings.compression_type,
        acks=settings.acks, max_request_size=settings.max_request_size, request_timeout_ms=settings.request_timeout_ms,
        delivery_timeout_ms=max(settings.delivery_timeout_ms, settings.linger_ms + settings.request_timeout_ms),
        reconnect_backoff_max_ms=settings.reconnect_backoff_max_ms,
        # Retries are bounded by the delivery timeout, not by a count: a broker restart takes several seconds.
        # One in-flight request per connection keeps a partition's records in send order across retries.
        max_in_flight_requests_per_connection=1,
    )


def make_consumer(
    settings: KafkaSettings,
    group_id: str | None = None,
    client_id: str | None = None,
    auto_offset_reset: Literal["earliest", "none"] = "earliest",
) -> KafkaConsumer:
    """A consumer that never auto-commits: the worker runner commits after its outputs are flushed.

    `auto_offset_reset="none"` makes a position outside the log an error instead of a silent jump (assign mode).
    """
    return KafkaConsumer(
        **settings.security(),
        client_id=client_id or settings.client_id, group_id=group_id,
        enable_auto_commit=False, auto_offset_reset=auto_offset_reset,
        max_poll_records=settings.max_poll_records, fetch_max_bytes=settings.fetch_max_bytes,
        max_partition_fetch_bytes=settings.max_partition_fetch_bytes,
        session_timeout_ms=settings.session_timeout_ms, heartbeat_interval_ms=settings.heartbeat_interval_ms,
        max_poll_interval_ms=settings.max_poll_interval_ms,
        request_timeout_ms=max(settings.request_timeout_ms, settings.session_timeout_ms + 1000),
        reconnect_backoff_max_ms=settings.reconnect_backoff_max_ms,
    )


def commit_group_offsets(settings: KafkaSettings, group_id: str, offsets: Mapping[tuple[str, int], int],
                         client_id: str | None = None) -> None:
    """Commit `offsets` ((topic, partition) -> next offset) for `group_id` without joining the group: how a
    restored log hands a consumer group its positions before any member starts."""
    consumer = make_consumer(settings, group_id=group_id, client_id=client_id)
    try:
        consumer.commit({TopicPartition(topic, partition): OffsetAndMetadata(offset, "", -1)
                         for (topic, partition), offset in offsets.items()})
    finally:
        consumer.close(autocommit=False)


class KafkaLoginError(ConfigError):
    """The broker refused the client's SASL login (a wrong user name or password) or its TLS handshake (a CA that
    did not sign the broker's certificate)."""


def _handshake_failure(options: Mapping[str, Any]) -> str | None:
    """Why the first bootstrap server, which accepts a TCP connection, refuses the TLS handshake with the configured
    CA (SSL / SASL_SSL), or None when it accepts it. Raises `OSError` when no TCP connection opens."""
    host, _, port = options["bootstrap_servers"][0].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        if options["security_protocol"] not in ("SSL", "SASL_SSL"):
            return None
        context = ssl.create_default_context(cafile=options.get("ssl_cafile"))
        context.check_hostname = bool(options.get("ssl_check_hostname", True))
        try:
            with context.wrap_socket(sock, server_hostname=host):
                return None
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            return f"{type(exc).__name__}: {exc}"


class _AdminClient(KafkaAdminClient):
    """kafka-python's admin client, which says why it could not bootstrap, and reads a group description whatever
    operations the broker says a client may perform on it.

    - kafka-python retries a refused SASL login until its bootstrap timeout and then reports only "Unable to
      bootstrap" (and its SSL transport often sees the broker's close before the refusal): a broker that answers over
      TLS but lets no login through within the timeout refused the credentials.
    - kafka-python 3.0.12's `describe_groups` always asks for the authorized operations and turns each into its
      `ACLOperation` enum, which stops at 14: Tansu answers 15 among them, and the call raised `ValueError` (so a
      `GroupWatch` check crashed its worker). Codes the enum lacks are left out of `authorized_operations`; upstream
      would need to keep unknown codes (or honour `include_authorized_operations=False`)."""

    def _process_acl_operations(self, obj: dict[str, Any]) -> dict[str, Any]:
        operations = obj.get("authorized_operations")
        if operations is not None:
            known = {operation.value for operation in ACLOperation} - {0, 1, 2}  # UNKNOWN, ANY and ALL: not granted
            obj["authorized_operations"] = [ACLOperation(code).name for code in operations if code in known]
        return obj

    def __init__(self, **options: Any) -> None:
        try:
            super().__init__(**options)
        except KafkaTimeoutError as exc:
            if hasattr(self, "_net"):  # stop the IO thread the failed constructor left running
                self._closed = False
                self.close()
            if not options.get("sasl_mechanism"):
                raise
            try:
                refused_tls = _handshake_failure(options)
            except OSError:
                raise exc from None  # nothing listens there: a broker down, not a login refused
            if refused_tls is not None:
                raise KafkaLoginError(f"the TLS handshake with the broker at {options['bootstrap_servers'][0]} "
                                      f"failed: {refused_tls} (CRL_KAFKA__SSL_CAFILE names the CA that signed "
                                      "its certificate)") from exc
            raise KafkaLoginError(
                f"the broker at {','.join(options['bootstrap_servers'])} answers over {options['security_protocol']} "
                f"but refused the login of {options.get('sasl_plain_username')!r} ({options['sasl_mechanism']}) for "
                f"{options['bootstrap_timeout_ms'] / 1000:.0f}s: a wrong user name or password (its log says "
                "'Failed authentication'); check CRL_KAFKA__SASL_PLAIN_USERNAME and CRL_KAFKA__SASL_PLAIN_PASSWORD"
            ) from exc


def make_admin(settings: KafkaSettings, client_id: str | None = None) -> KafkaAdminClient:
    """An admin client; raises `KafkaLoginError` when the broker refuses its SASL login."""
    return _AdminClient(
        **settings.security(),
        client_id=client_id or f"{settings.client_id}-admin",
        request_timeout_ms=settings.request_timeout_ms,
        bootstrap_timeout_ms=settings.request_timeout_ms,
        reconnect_backoff_max_ms=settings.reconnect_backoff_max_ms,
    )
