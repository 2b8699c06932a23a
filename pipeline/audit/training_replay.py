"""Re-run every recorded training step from the archive and the initial checkpoint; compare the weights.

    crl replay train runs/demo                   # both roles
    crl replay train runs/demo --role extractor

For each role: load version 0 from the checkpoint its `PolicyPublished` names (sha256 checked), with the trainer
settings recorded in it; then, in version order, rebuild every `TrainStepCompleted`'s batch from the archived events it
lists, run the same update the trainer ran (`pipeline.rl.trainer.TrainerStep`: the same optimiser construction and
step, deterministic CPU mode, the recorded thread count) and compare the weight hash before and after with the recorded
ones. The actor's advantages are recomputed from the trajectories and must equal the recorded ones; the extractor's
depend on which outcomes had arrived when it trained, so the recorded ones are used. An extractor batch event is the
copy the trainer's join kept (`pipeline.rl.batching.trained_copies`: the first one on the log whose parse status is ok,
or parse_error when the recorded trainer settings gave rejected answers a reward), not merely the first record of its
id. The first mismatch stops the replay and names the step.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.audit.views import Audit
from pipeline.errors import RankFailedError
from pipeline.models.checkpoints import checkpoint_path, load_checkpoint, weight_hash
from pipeline.rl.batching import trained_copies
from pipeline.rl.data_parallel import DataParallel
from pipeline.rl.policy_step import Sample
from pipeline.rl.settings import (
    DEFAULT_REPLAY_RANKS,
    ActorTrainerSettings,
    ExtractorTrainerSettings,
    TrainerSettings,
)
from pipeline.rl.trainer import actor_batch, extractor_samples
from pipeline.rl.trainer_step import TrainerStep
from schemas.base import Event, Role
from schemas.codec import DEFAULT_MAX_PAYLOAD_BYTES, decode
from schemas.extractions import ExtractionGenerated
from schemas.topics import EXTRACTIONS, POLICY, TRAIN_STEPS, TRAJECTORIES, Topic
from schemas.training import PolicyPublished, TrainStepCompleted
from schemas.trajectories import TrajectoryCompleted


@dataclass(frozen=True)
class StepCheck:
    step: int
    version: int
    recorded: str
    replayed: str
    problem: str | None = None
    world_size: int = 1

    @property
    def ok(self) -> bool:
        return self.problem is None


@dataclass
class TrainingReplay:
    role: Role
    checks: list[StepCheck] = field(default_factory=list)
    problem: str | None = None
    """Why the replay could not start or stopped (None: every step matched)."""
    unavailable: str | None = None
    """Set with `problem` when a step could not be replayed here (its world size), as opposed to a mismatch."""

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def world_sizes(self) -> list[int]:
        """The world sizes of the replayed steps, ascending."""
        return sorted({check.world_size for check in self.checks})


def _archived(audit: Audit, kind: str, topic: Topic) -> Iterator[Event]:
    _, rows = audit.query("SELECT payload::VARCHAR FROM events WHERE kind = ? ORDER BY topic, partition, \"offset\"",
                          (kind,))
    for (payload,) in rows:
        # The archive keeps each event whole, claim-checked arrays included: no payload cap applies to it.
        data = payload.encode()
        yield decode(topic, data, max_bytes=max(len(data), DEFAULT_MAX_PAYLOAD_BYTES))


def _every_copy(audit: Audit, kind: str, topic: Topic) -> Iterator[Event]:
    for payload in audit.every_copy(kind):
        data = payload.encode()
        yield decode(topic, data, max_bytes=max(len(data), DEFAULT_MAX_PAYLOAD_BYTES))


def replay_training(run_dir: Path, role: Role, on_step: Callable[[StepCheck], None] | None = None,
                    max_ranks: int = DEFAULT_REPLAY_RANKS) -> TrainingReplay:
    """Replay `role`'s recorded steps; stop at the first mismatch, or at a step recorded with more than `max_ranks`
    data-parallel ranks (or whose ranks cannot start)."""
    report = TrainingReplay(role)
    with Audit(run_dir) as audit:
        policies = {e.version: e for e in _archived(audit, "PolicyPublished", POLICY)
                    if isinstance(e, PolicyPublished) and e.role == role}
        steps = sorted({e.policy_version: e for e in _archived(audit, "TrainStepCompleted", TRAIN_STEPS)
                        if isinstance(e, TrainStepCompleted) and e.role == role}.values(),
                       key=lambda e: e.policy_version)
        batch_events: dict[str, Event] = {}
        copies: list[ExtractionGenerated] = []
        if role == "actor":
            batch_events = {str(e.event_id): e for e in _archived(audit, "TrajectoryCompleted", TRAJECTORIES)}
        else:
            copies = [e for e in _every_copy(audit, "ExtractionGenerated", EXTRACTIONS)
                      if isinstance(e, ExtractionGenerated)]
    if 0 not in policies:
        report.problem = f"no PolicyPublished(role={role}, version=0) in the archive of {run_dir}"
        return report
    initial = load_checkpoint(checkpoint_path(policies[0].checkpoint_uri), policies[0].sha256)
    settings_type = ActorTrainerSettings if role == "actor" else ExtractorTrainerSettings
    metadata = initial.manifest["metadata"]
    recorded_trainer = dict(metadata["trainer"])
    # Checkpoints written before the generation sections kept the temperature in the trainer settings.
    temperature = float(metadata.get("temperature", recorded_trainer.pop("temperature", 1.0)))
    recorded_trainer.pop("temperature", None)
    settings: TrainerSettings = settings_type.model_validate(recorded_trainer)
    if isinstance(settings, ExtractorTrainerSettings):
        # Not the first copy of each id (the `events` view) but the one the trainer's join kept: a generation
        # distilled again is published again under its id, and a copy that is not a sample never joined.
        batch_events = dict(trained_copies(copies, parse_errors=settings.parse_error_reward is not None))
    update = TrainerStep.resumed(initial, settings, temperature)  # what the trainer built from the same checkpoint
    policy = update.policy  # with its LoRA adapter when the run trained one
    ranks: ReplayRanks | None = None
    try:
        for expected_version, recorded in enumerate(steps, start=1):
            where = f"step {recorded.step} (version {recorded.policy_version})"
            if recorded.policy_version != expected_version:
                report.problem = f"version {expected_version} has no TrainStepCompleted in the archive; next is {where}"
                return report
            before = weight_hash(policy.model)
            if before != recorded.weight_hash_before:
                report.problem = (f"{where}: weights before the step differ: recorded {recorded.weight_hash_before}, "
                                  f"replay {before}")
                return report
            missing = [e for e in recorded.batch_event_ids if e not in batch_events]
            if missing:
                which = " with parse status ok" if role == "extractor" else ""
                report.problem = (f"{where}: {len(missing)} batch events are not in the archive{which}, e.g. "
                                  f"{missing[0]}")
                return report
            batch = [batch_events[e] for e in recorded.batch_event_ids]
            samples = _samples(role, batch, recorded, settings)
            if isinstance(samples, str):
                report.problem = f"{where}: {samples}"
                return report
            if recorded.aggregation != settings.aggregation:
                report.problem = (f"{where}: recorded aggregation {recorded.aggregation}, the trainer settings say "
                                  f"{settings.aggregation}")
                return report
            world_size = recorded.world_size
            if world_size == 1:
                if ranks is not None:
                    ranks.close()
                    ranks = None
                update.run(samples, recorded.loss_variant)
            else:
                if world_size > max_ranks:
                    report.problem = report.unavailable = (
                        f"{where} was taken by {world_size} data-parallel ranks; this replay may start at most "
                        f"{max_ranks} (--max-ranks), so it cannot reproduce the step's summation order")
                    return report
                try:
                    if ranks is None or ranks.world_size != world_size:
                        if ranks is not None:
                            ranks.close()
                            ranks = None
                        ranks = ReplayRanks(role, world_size, policies[0], settings, temperature)
                        ranks.share(update)
                    ranks.parallel.step(update, samples, recorded.loss_variant, where)
                except ReplayRanksUnavailable as exc:
                    report.problem = report.unavailable = f"{where}: {exc}"
                    return report
            check = StepCheck(recorded.step, recorded.policy_version, recorded.weight_hash_after,
                              weight_hash(policy.model), world_size=world_size)
            if check.recorded != check.replayed:
                check = StepCheck(check.step, check.version, check.recorded, check.replayed,
                                  f"{where}: weight hash after the step: recorded {check.recorded}, replay "
                                  f"{check.replayed}", world_size)
            report.checks.append(check)
            if on_step is not None:
                on_step(check)
            if not check.ok:
                report.problem = check.problem
                return report
    finally:
        if ranks is not None:
            ranks.close()
    return report


class ReplayRanksUnavailable(RankFailedError):
    """The local ranks a data-parallel step needs could not be started or joined."""


class ReplayRanks:
    """This process as rank 0 of `world_size` local gloo ranks; ranks 1.. are spawned processes that load version 0
    (`initial`), take the weights and optimiser state the replay has reached (`share`), and follow rank 0's steps."""

    def __init__(self, role: Role, world_size: int, initial: PolicyPublished, settings: TrainerSettings,
                 temperature: float) -> None:
        import torch.multiprocessing as mp

        self.world_size = world_size
        self._directory = Path(tempfile.mkdtemp(prefix="crl-replay-ranks-"))
        store = self._directory / "store"
        context = mp.get_context("spawn")
        self._processes = [
            context.Process(target=_replay_rank, name=f"replay-rank-{rank}", daemon=True,
                            args=(role, rank, world_size, str(store), initial.checkpoint_uri, initial.sha256,
                                  settings.model_dump_json(), temperature, settings.rank_timeout_s))
            for rank in range(1, world_size)]
        try:
            for process in self._processes:
                process.start()
            self.parallel = DataParallel.over_file(store, 0, world_size, settings.rank_timeout_s)
        except (OSError, RankFailedError) as exc:
            self._stop_processes()
            raise ReplayRanksUnavailable(f"could not start {world_size} local gloo ranks to replay a step taken "
                                         f"by {world_size} data-parallel ranks: {exc}") from exc

    def share(self, update: TrainerStep) -> None:
        """Give every rank the replay's current weights and optimiser state."""
        self.parallel.share_state(update)

    def close(self) -> None:
        try:
            if hasattr(self, "parallel"):
                self.parallel.finish()
        except RankFailedError:
            pass  # a rank already gone: stopping it is all that is left
        finally:
            self._stop_processes()

    def _stop_processes(self) -> None:
        for process in self._processes:
            if process.pid is not None:
                process.join(timeout=30)
                if process.is_alive():
                    process.terminate()
                    process.join()
        shutil.rmtree(self._directory, ignore_errors=True)


def _replay_rank(role: Role, rank: int, world_size: int, store: str, checkpoint_uri: str, sha256: str,
                 settings_json: str, temperature: float, timeout_s: float) -> None:
    """A spawned replay rank above 0: join, build the step from version 0, follow rank 0 until it says stop."""
    settings_type = ActorTrainerSettings if role == "actor" else ExtractorTrainerSettings
    parallel = DataParallel.over_file(Path(store), rank, world_size, timeout_s)
    try:
        loaded = load_checkpoint(checkpoint_path(checkpoint_uri), sha256)
        parallel.follow(TrainerStep.resumed(loaded, settings_type.model_validate_json(settings_json), temperature))
    finally:
        parallel.close()


def _samples(role: Role, batch: list[Event], recorded: TrainStepCompleted, settings: TrainerSettings
             ) -> list[Sample] | str:
    """The step's samples rebuilt from its batch events, or why they cannot be."""
    if role == "actor":
        trajectories = [e for e in batch if isinstance(e, TrajectoryCompleted)]
        if len(trajectories) != len(batch):
            return "a batch event is not a TrajectoryCompleted"
        assert isinstance(settings, ActorTrainerSettings)
        if recorded.rewards:
            # The same event id with another outcome: a play of the episode other than the one the step trained on
            # (an episode played again under its id after the broker lost the first play).
            changed = [(event_id, t.reward, reward) for event_id, t, reward
                       in zip(recorded.batch_event_ids, trajectories, recorded.rewards, strict=True)
                       if t.reward != reward]
            if changed:
                event_id, archived, trained = changed[0]
                return (f"{len(changed)} archived batch trajectories are not the plays the step trained on, e.g. "
                        f"{event_id}: reward {archived} in the archive, {trained} recorded by the step")
        samples, advantages = actor_batch(trajectories, settings)
        if recorded.advantages and tuple(advantages.tolist()) != recorded.advantages:
            return f"recomputed advantages {advantages.tolist()} differ from the recorded {list(recorded.advantages)}"
        return samples
    generations = [e for e in batch if isinstance(e, ExtractionGenerated)]
    if len(generations) != len(batch):
        return "a batch event is not an ExtractionGenerated"
    if len(recorded.advantages) != len(generations):
        return "the step records no per-sample advantages"
    return extractor_samples(generations, recorded.advantages)
