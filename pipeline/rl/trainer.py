"""What both trainers share: the policy with its optimiser, versioned checkpoints, and publishing every version
exactly once.

    checkpoints/<role>/v000000/   the initial policy (tiny preset or a local model), published as version 0
    checkpoints/<role>/v000001/   after the first update ...

A checkpoint is safetensors + config + tokenizer + optimiser state + a manifest with every file's sha256
(`pipeline.models.checkpoints`). Its manifest also carries the `TrainStepCompleted` of the step that produced it and
the trainer settings, so:

- the events of a version are a pure function of its checkpoint: their ids are derived from (run, role, version)
  and their timestamps are stored, so a trainer that died between writing a checkpoint and publishing it publishes
  the very same events on restart, and only those it finds missing on the log (no duplicate, no gap);
- `crl replay train` finds the settings the steps ran with in the initial checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.errors import ConfigError
from pipeline.models.checkpoints import (
    CheckpointInfo,
    load_checkpoint,
    manifest_sha256,
    save_checkpoint,
    weight_hash,
)
from pipeline.models.lora import is_lora
from pipeline.models.presets import prepared_preset
from pipeline.models.settings import ModelSettings
from pipeline.models.tiny import build_tiny, tokenizer_corpus
from pipeline.models.transformers_backend import TransformersPolicy
from pipeline.rl.advantages import subgroup_advantages
from pipeline.rl.policy_step import (
    Sample,
    StepResult,
    deterministic_torch,
)
from pipeline.rl.settings import ActorTrainerSettings, TrainerSettings
from pipeline.rl.trainer_step import TrainerStep
from pipeline.rl.versions import event_id_for, version_dir, versions_in
from pipeline.rl.warm_progress import Announce, Progress, WarmStartReporter, no_progress
from pipeline.runtime.log import Log, events_to_end
from schemas.base import Event, Producer, Role
from schemas.extractions import ExtractionGenerated
from schemas.topics import POLICY, TRAIN_STEPS
from schemas.training import PolicyPublished, TrainStepCompleted
from schemas.trajectories import TrajectoryCompleted

if TYPE_CHECKING:
    from pipeline.rl.data_parallel import DataParallel

log = logging.getLogger(__name__)


def replica_step(role: Role, settings: TrainerSettings, root: Path, temperature: float) -> TrainerStep:
    """The `TrainerStep` a data-parallel rank above 0 trains with: the newest checkpoint rank 0 wrote (or resumed
    from) under `root`, built exactly as `PolicyTrainer` builds it."""
    versions = versions_in(root)
    if not versions:
        raise ConfigError(f"no {role} checkpoint under {root}: rank 0 writes version 0 before the other ranks start")
    return TrainerStep.resumed(load_checkpoint(version_dir(root, versions[-1])), settings, temperature)


def initial_policy(model: ModelSettings) -> TransformersPolicy:
    """Version 0: the local model at `model.path`, the converted `model.preset`, or the tiny preset from its seed."""
    if model.preset is not None:
        return TransformersPolicy.from_pretrained(prepared_preset(model.preset), device=model.device)
    if model.path is not None:
        return TransformersPolicy.from_pretrained(model.path, device=model.device)
    corpus = None
    if model.tiny.corpus_envs:
        from pipeline.envs.random_play import corpus_texts


        corpus = tokenizer_corpus(model.tiny) + corpus_texts(model.tiny.corpus_envs, model.tiny.corpus_episodes,
                                                             model.tiny.seed)
    return build_tiny(model.tiny, device=model.device, corpus=corpus)


WarmStart = Callable[[TransformersPolicy, Progress], tuple[TransformersPolicy, dict[str, Any]]]
"""Fine-tunes a freshly built policy before it becomes version 0, telling `Progress` how far it has come; returns
it and what it did (`pipeline.rl.warm_start`)."""


@dataclass
class PolicyVersion:
    """A checkpoint on disk and the events that announce it."""

    version: int
    step: int
    info: CheckpointInfo
    train_step: TrainStepCompleted | None
    published: PolicyPublished


@dataclass(eq=False)
class PolicyTrainer:
    """The policy a trainer updates, its optimiser, and its checkpoint directory.

    Made, it resumes from the newest complete checkpoint (verified) or creates version 0; `step()` runs one update;
    `save()` writes the next version's checkpoint and returns the events to publish.
    """

    role: Role
    settings: TrainerSettings
    root: Path
    run_id: str
    producer: Producer
    warm_start: WarmStart | None = None
    announce: Announce | None = None
    """Publishes the warm start's progress while version 0 is being made (`WorkerContext.announce`); None: it is
    not published."""
    temperature: float = 1.0
    """The sampling temperature of the role's generation section (recorded in every checkpoint)."""
    parallel: DataParallel | None = None
    """The data-parallel group this trainer is rank 0 of (`pipeline.rl.data_parallel`); None: one process."""
    update: TrainerStep = field(init=False)
    current: PolicyVersion = field(init=False)

    def __post_init__(self) -> None:
        self.update, self.current = self._open()

    # -- versions on disk -----------------------------------------------------------------------------------------

    def versions(self) -> list[int]:
        return versions_in(self.root)

    @property
    def policy(self) -> TransformersPolicy:
        return self.update.policy

    def _open(self) -> tuple[TrainerStep, PolicyVersion]:
        versions = self.versions()
        if versions:
            path = version_dir(self.root, versions[-1])
            loaded = load_checkpoint(path)
            update = TrainerStep.resumed(loaded, self.settings, self.temperature)
            recorded = loaded.manifest["metadata"].get("trainer")
            lora = self.settings.model.lora.model_dump(mode="json")
            if recorded is not None and recorded.get("model", {}).get("lora", lora) != lora:
                raise ConfigError(f"{path} was trained with model.lora {recorded['model']['lora']}, the settings now "
                                  f"say {lora}; a run cannot switch between LoRA and full fine-tuning, or change its "
                                  "adapter, when it resumes (start a new run directory)")
            if recorded is not None and recorded != self.settings.model_dump(mode="json"):
                log.warning("%s trainer settings differ from those in %s; the checkpoint's weights are used, the new"
                            " settings apply from the next step", self.role, path)
            version = self._version_from(path, loaded.manifest)
            log.info("%s trainer resumes at version %d (step %d) from %s", self.role, version.version, version.step,
                     path)
            return update, version
        policy = initial_policy(self.settings.model)
        warm_start = None
        if self.warm_start is not None:
            deterministic_torch(self.settings.threads)  # the trainer's thread count, not torch's default
            progress: Progress = no_progress if self.announce is None else \
                WarmStartReporter(self.run_id, self.role, self.producer, self.announce)
            policy, warm_start = self.warm_start(policy, progress)
        if self.settings.model.lora.rank > 0:
            # Version 0 is the base in full; the adapter the trainer wraps around it starts as the identity.
            version = self._write(policy, None, version=0, step=0, train_step=None, warm_start=warm_start)
            update = TrainerStep(policy, self.settings, self.temperature)
        else:
            update = TrainerStep(policy, self.settings, self.temperature)
            version = self._write(update.policy, update.optimizer, version=0, step=0, train_step=None,
                                  warm_start=warm_start)
        log.info("%s trainer created version 0 at %s", self.role, version.info.path)
        return update, version

    def _write(self, policy: TransformersPolicy, optimizer: torch.optim.Optimizer | None, *, version: int, step: int,
               train_step: TrainStepCompleted | None, warm_start: dict[str, Any] | None = None) -> PolicyVersion:
        metadata = {
            **({"warm_start": warm_start} if warm_start is not None else {}),
            "role": self.role, "version": version, "step": step, "run_id": self.run_id,
            "trainer": self.settings.model_dump(mode="json"), "temperature": self.temperature,
            "train_step": json.loads(train_step.model_dump_json()) if train_step is not None else None,
            "published_at": (train_step.occurred_at if train_step is not None else datetime.now(UTC)).isoformat(),
        }
        path = version_dir(self.root, version)
        if path.exists() and not (path / "manifest.json").exists():
            shutil.rmtree(path)  # never completed: save_checkpoint renames a finished directory into place
        self.root.mkdir(parents=True, exist_ok=True)
        base = None
        if is_lora(policy.model):
            base_path = version_dir(self.root, 0)
            base = CheckpointInfo(base_path, manifest_sha256(base_path), "")
        info = save_checkpoint(path, policy, optimizer=optimizer, metadata=metadata, base=base)
        return self._version_from(path, json.loads((path / "manifest.json").read_text()), info)

    def _version_from(self, path: Path, manifest: dict[str, Any], info: CheckpointInfo | None = None) -> PolicyVersion:
        metadata = manifest["metadata"]
        info = info or CheckpointInfo(path=path, manifest_sha256=manifest_sha256(path),
                                      weight_hash=manifest["weight_hash"])
        version = int(metadata["version"])
        train_step = (TrainStepCompleted.model_validate(metadata["train_step"])
                      if metadata.get("train_step") is not None else None)
        published = PolicyPublished(
            event_id=event_id_for(self.run_id, self.role, version, "policy"),
            occurred_at=datetime.fromisoformat(metadata["published_at"]),
            run_id=self.run_id, producer=self.producer, role=self.role, version=version, step=int(metadata["step"]),
            checkpoint_uri=path.resolve().as_uri(), sha256=info.manifest_sha256,
        )
        return PolicyVersion(version, int(metadata["step"]), info, train_step, published)

    # -- training -------------------------------------------------------------------------------------------------

    @property
    def weight_hash(self) -> str:
        return weight_hash(self.policy.model)

    @property
    def world_size(self) -> int:
        return self.parallel.world_size if self.parallel is not None else 1

    def step(self, samples: Sequence[Sample]) -> StepResult:
        """One update with the loss of the settings (`train_step_event` records the same); data-parallel, every rank
        takes it and must end with the same weights."""
        if self.parallel is None:
            return self.update.run(samples, self.settings.loss)
        version = self.current.version + 1
        return self.parallel.step(self.update, samples, self.settings.loss, f"{self.role} version {version}")

    def keep_alive(self) -> None:
        """Between steps: tell the other ranks rank 0 is still there (nothing without a group)."""
        if self.parallel is not None:
            self.parallel.keep_alive()

    def save(self, train_step: TrainStepCompleted) -> PolicyVersion:
        """Write the checkpoint of `train_step.policy_version`; publish what it returns with `events_of`."""
        self.current = self._write(self.update.policy, self.update.optimizer, version=train_step.policy_version,
                                   step=train_step.step, train_step=train_step)
        return self.current

    def train_step_event(self, **fields: object) -> TrainStepCompleted:
        version = self.current.version + 1
        return TrainStepCompleted(
            event_id=event_id_for(self.run_id, self.role, version, "train-step"),
            run_id=self.run_id, producer=self.producer, role=self.role, policy_version=version,
            loss_variant=self.settings.loss, aggregation=self.settings.aggregation,
            world_size=self.world_size, **fields,
        )


def events_of(version: PolicyVersion) -> list[Event]:
    """What announces a version, in publishing order: the policy, then the step that made it."""
    return [version.published] + ([version.train_step] if version.train_step is not None else [])


def unpublished(version: PolicyVersion, log: Log) -> list[Event]:
    """The events of `version` not yet on the log (after a crash between checkpoint and publish)."""
    on_log = {event.event_id for topic in (POLICY, TRAIN_STEPS) for event in events_to_end(log, topic)}
    return [event for event in events_of(version) if event.event_id not in on_log]


def actor_batch(trajectories: list[TrajectoryCompleted], settings: ActorTrainerSettings
                ) -> tuple[list[Sample], torch.Tensor]:
    """An actor step's samples and per-trajectory advantages from its canonically ordered trajectories: what the
    actor trainer trains on and what `crl replay train` rebuilds."""
    advantages = actor_advantages(trajectories, settings)
    return actor_samples(trajectories, advantages.tolist()), advantages


def extractor_samples(generations: Iterable[ExtractionGenerated], advantages: Sequence[float]) -> list[Sample]:
    """One sample per generation: its prompt and response tokens, its sampling log-probs, its advantage."""
    return [Sample(tuple(g.prompt_token_ids), tuple(g.response_token_ids), tuple(g.sampling_logprobs), advantage)
            for g, advantage in zip(generations, advantages, strict=True)]


def actor_samples(trajectories: Iterable[TrajectoryCompleted], advantages: Sequence[float]) -> list[Sample]:
    """One sample per turn, each turn carrying its trajectory's advantage and its trajectory's index as the sequence
    it weighs as part of (tokens of the prompt, observations and injected experience are the prompt: they carry no
    loss)."""
    return [
        Sample(tuple(turn.prompt_token_ids), tuple(turn.response_token_ids), tuple(turn.sampling_logprobs), advantage,
               sequence=index)
        for index, (trajectory, advantage) in enumerate(zip(trajectories, advantages, strict=True))
        for turn in trajectory.turns
    ]


def actor_advantages(trajectories: list[TrajectoryCompleted], settings: ActorTrainerSettings) -> torch.Tensor:
    """Subgroup advantages of a canonically ordered batch (also what `crl replay train` recomputes). An episode
    whose engine failed (`env_error`) gets 0 and is left out of its subgroup's mean and std: its failure says
    nothing about the policy."""
    group_index = {g: i for i, g in enumerate(sorted({t.group_id for t in trajectories}))}
    played = [i for i, t in enumerate(trajectories) if t.env_error is None]
    advantages = torch.zeros(len(trajectories), dtype=torch.float32)
    if played:
        advantages[played] = subgroup_advantages(
            torch.tensor([trajectories[i].reward for i in played]),
            torch.tensor([group_index[trajectories[i].group_id] for i in played]),
            torch.tensor([trajectories[i].guided for i in played]),
            settings.advantage_norm, settings.advantage_eps,
        )
    return advantages
