"""Settings, read once at the edge (the CLI) from `CRL_*` environment variables and passed down frozen.

Nesting uses `__`: `CRL_KAFKA__BOOTSTRAP_SERVERS=host:9092`, `CRL_DB__URL=postgresql+psycopg://...`,
`CRL_RUNNER__MAX_RETRIES=8`. A run config (`CRL_CONFIG=configs/tiny-minihack-room.yaml`, or `Settings(config=path)`)
is the same structure in YAML; CRL_* variables override it. No module below the CLI reads `os.environ`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from infra.broker import BrokerSettings
from infra.db import DbSettings
from infra.kafka import KafkaSettings
from pipeline.actor.schedule import Schedule
from pipeline.actor.settings import RolloutSettings, SchedulerSettings
from pipeline.bank.settings import BankSettings, EmbeddingSettings, RetrievalSettings
from pipeline.envs.settings import EnvSettings
from pipeline.errors import ConfigError
from pipeline.extractor.settings import ExtractorSettings
from pipeline.models.settings import ModelSettings, TinyModelSettings
from pipeline.rl.settings import ActorTrainerSettings, ExtractorTrainerSettings, TrainerSettings
from pipeline.runtime.settings import RunnerSettings
from pipeline.tracking.settings import TrackerSettings
from schemas.base import Role
from schemas.codec import DEFAULT_CLAIM_CHECK_BYTES, DEFAULT_MAX_PAYLOAD_BYTES


class ArchiverSettings(BaseModel):
    """When the archiver closes a Parquet segment. Environment: `CRL_ARCHIVER__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    flush_rows: int = Field(default=2000, gt=0, description="Close segments once this many events are buffered.")
    flush_interval_s: float = Field(default=2.0, gt=0, description="...or once the oldest buffered event is this old.")


class LaunchSettings(BaseModel):
    """What `crl run` starts and how it supervises it. Environment: `CRL_LAUNCH__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rollout_workers: int = Field(default=1, gt=0, description="Rollout worker processes (one consumer group).")
    extractor_workers: int = Field(default=1, gt=0, description="Extractor worker processes (one consumer group).")
    max_restarts: int = Field(default=3, ge=0, description="Restarts of one crashed worker before the run fails.")
    drain_timeout_s: float = Field(
        default=300.0, gt=0,
        description="After RunFinished, how long to wait for every consumer to reach the end of its inputs.")
    progress_interval_s: float = Field(default=1.0, gt=0, description="Refresh period of the live progress view.")


class Settings(BaseSettings):
    """Everything a worker or command needs to know about its environment."""

    # env_parse_none_str: CRL_RETRIEVAL__SIMILARITY_MARGIN=null sets a setting that may be None to None.
    model_config = SettingsConfigDict(env_prefix="CRL_", env_nested_delimiter="__", frozen=True, extra="ignore",
                                      env_parse_none_str="null")

    config: Path | None = Field(
        default=None,
        description="A run config (YAML, the same structure as these settings, e.g. configs/tiny-minihack-room.yaml)."
        " CRL_* variables override what it says.")
    run_dir: Path = Field(default=Path("runs/default"), description="Run directory: archive, SQL bank, logs, blobs.")
    run_id: str | None = Field(default=None, description="Run id stamped on events; default: the run dir's name.")
    broker: BrokerSettings = Field(
        default_factory=BrokerSettings,
        description="The embedded broker started when no CRL_KAFKA__BOOTSTRAP_SERVERS is given (tansu | kafka).")
    max_payload_bytes: int = Field(
        default=DEFAULT_MAX_PAYLOAD_BYTES, gt=0, description="Records larger than this are dead-lettered (1 MiB)."
    )
    claim_check_bytes: int = Field(
        default=DEFAULT_CLAIM_CHECK_BYTES, gt=0,
        description="An event that would encode larger than this keeps its token ids and log-probs in the run's blob "
        "store and carries a {sha256, size} claim check instead (256 KiB; below max_payload_bytes).")
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    db: DbSettings = Field(default_factory=DbSettings)
    runner: RunnerSettings = Field(default_factory=RunnerSettings)
    archiver: ArchiverSettings = Field(default_factory=ArchiverSettings)
    tracker: TrackerSettings = Field(default_factory=TrackerSettings)
    bank: BankSettings = Field(default_factory=BankSettings)
    embedding: EmbeddingSettings = Field(default_factory=EmbeddingSettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    envs: EnvSettings = Field(default_factory=EnvSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    extractor: ExtractorSettings = Field(default_factory=ExtractorSettings)
    launch: LaunchSettings = Field(default_factory=LaunchSettings)
    actor_trainer: ActorTrainerSettings = Field(default_factory=ActorTrainerSettings)
    extractor_trainer: ExtractorTrainerSettings = Field(
        default_factory=lambda: ExtractorTrainerSettings(model=ModelSettings(tiny=TinyModelSettings(seed=1))))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Precedence: arguments, then CRL_* variables, then the YAML file named by CRL_CONFIG, then defaults."""
        sources = [init_settings, env_settings]
        # `Settings(config=path)` names the file directly; else CRL_CONFIG (this is the settings edge).
        assert isinstance(init_settings, InitSettingsSource)  # pydantic-settings passes the arguments' source here
        config_file = init_settings.init_kwargs.get("config")
        named_by = None if config_file else "CRL_CONFIG"
        config_file = config_file or os.environ.get("CRL_CONFIG")
        if config_file:
            sources.append(RunConfigSource(settings_cls, Path(config_file), named_by))
        return (*sources, dotenv_settings, file_secret_settings)

    @model_validator(mode="after")
    def _claim_checks_below_the_cap(self) -> Settings:
        if self.claim_check_bytes >= self.max_payload_bytes:
            raise ValueError(f"claim_check_bytes: {self.claim_check_bytes} must be below max_payload_bytes "
                             f"({self.max_payload_bytes}): an event between the two would be dead-lettered")
        return self

    @model_validator(mode="after")
    def _known_envs(self) -> Settings:
        from pipeline.envs.registry import ENV_SPECS
        from pipeline.settings_errors import did_you_mean

        unknown = [f"envs.tasks[{n}].env_id: unknown env id {task.env_id!r} (`crl envs list` lists them)"
                   f"{did_you_mean(task.env_id, sorted(ENV_SPECS))}"
                   for n, task in enumerate(self.envs.tasks) if task.env_id not in ENV_SPECS]
        if unknown:
            raise ValueError("\n".join(unknown))
        return self

    @model_validator(mode="after")
    def _lora_generates_with_transformers(self) -> Settings:
        for role, generation, trainer in (("rollout", self.rollout.generation, self.actor_trainer),
                                          ("extractor", self.extractor.generation, self.extractor_trainer)):
            if generation.backend == "vllm" and trainer.model.lora.rank > 0:
                raise ValueError(f"{role}.generation.backend: vllm serves full checkpoints only, and the trainer "
                                 "of that role trains a LoRA adapter (model.lora.rank > 0): use the transformers "
                                 "backend, or lora.rank 0")
        return self

    @model_validator(mode="after")
    def _deterministic_in_lock_step(self) -> Settings:
        if not self.scheduler.deterministic:
            return self
        needs = {"scheduler.staleness": (self.scheduler.staleness, 0),
                 "scheduler.max_steps_ahead": (self.scheduler.max_steps_ahead, 0),
                 "launch.extractor_workers": (self.launch.extractor_workers, 1)}
        wrong = [f"{name} is {value}, needs {needed}" for name, (value, needed) in needs.items() if value != needed]
        if wrong:
            raise ValueError("scheduler.deterministic: a deterministic run goes in lock step, but " + "; ".join(wrong)
                             + " (docs/determinism.md)")
        return self

    @property
    def resolved_run_id(self) -> str:
        return self.run_id or self.run_dir.resolve().name

    def trainer(self, role: Role) -> TrainerSettings:
        """The settings of `role`'s trainer (`actor_trainer` or `extractor_trainer`)."""
        return self.actor_trainer if role == "actor" else self.extractor_trainer

    def sampling_temperature(self, role: Role) -> float:
        """The temperature `role`'s policy samples at, and its log-probs are taken at: the rollout's for the actor,
        the extractor's generation's for the extractor."""
        return (self.rollout if role == "actor" else self.extractor).generation.temperature

    def schedule(self) -> Schedule:
        """The run's schedule: the scheduler's settings with the actor trainer's group size, groups per step and
        warm-up, so the two cannot disagree."""
        return Schedule.of(self.scheduler, self.envs, self.actor_trainer)

    def run_config(self) -> dict[str, Any]:
        """These settings as a run config (plain YAML-able data, what `Settings(config=path)` reads back), secrets in
        the clear: `crl run` hands it to its workers in RUN_DIR/config.yaml."""
        data = self.model_dump(mode="json", exclude={"config"})
        if self.kafka.sasl_plain_password is not None:
            data["kafka"]["sasl_plain_password"] = self.kafka.sasl_plain_password.get_secret_value()
        return data

    def with_bootstrap(self, bootstrap_servers: str) -> Settings:
        """A copy pointing every client at `bootstrap_servers`."""
        return self.model_copy(update={"kafka": self.kafka.model_copy(update={"bootstrap_servers": bootstrap_servers})})


class RunConfigSource(YamlConfigSettingsSource):
    """A run config file: YAML with the structure of `Settings`. A missing file or an unknown top-level key is an
    error (nested models forbid unknown keys themselves), so a typo never silently falls back to a default."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path, named_by: str | None = None) -> None:
        from pipeline.settings_errors import did_you_mean

        if not path.is_file():
            raise ConfigError(f"run config {path} does not exist" + (f" ({named_by})" if named_by else ""))
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
            raise ConfigError(f"{path} is not valid YAML{at}: {problem}") from exc
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{path}: a run config is a mapping of settings (`scheduler: {{steps: 3}}`), not a "
                              f"{type(data).__name__}")
        super().__init__(settings_cls, yaml_file=path)
        unknown = sorted(set(self.yaml_data or {}) - set(settings_cls.model_fields))
        if unknown:
            known = list(settings_cls.model_fields)
            raise ConfigError("\n".join(f"{key} in {path}: unknown key{did_you_mean(key, known)}" for key in unknown))

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        data.setdefault("config", self.yaml_file_path)
        return data


def load_settings(config: Path | None = None, **overrides: Any) -> Settings:
    """`Settings(config=config, **overrides)`, its errors explained in the user's words: a `ConfigError` with one line
    per error, naming the `CRL_*` variable or the key and file that set the bad value, with a "did you mean"
    (`pipeline.settings_errors`)."""
    from pipeline.settings_errors import explain

    try:
        return Settings(config=config, **overrides) if config is not None else Settings(**overrides)
    except ValidationError as exc:
        named = config if config is not None else (Path(os.environ["CRL_CONFIG"]) if os.environ.get("CRL_CONFIG")
                                                   else None)
        raise ConfigError("\n".join(explain(exc, named, Settings))) from exc
