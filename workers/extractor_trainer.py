"""Extractor trainer: CISPO on extractor generations, rewarded by the episodes their experiences guided.

    crl worker extractor_trainer --run-dir runs/demo

Join: a guided train episode lists the experiences it was served with the generation that wrote each served version
(`TrajectoryCompleted.retrieved[].generation_id`); it gives that generation +1 on success and -1 on failure. A
generation that produced experiences (`ExtractionGenerated`, parse status ok) is a sample; its reward is the mean over
the episodes it guided so far (with `parse_error_reward` set, a rejected answer is a sample too, of that reward). A
sample joins the buffer when it holds outcomes it has not been trained on; once the buffer holds `buffer_size`
samples (paper 64) the oldest ones form a batch: `A_i = (r_i - mean r) * w_i`, with
`w_i = (1 + train_count_i)^(-alpha)`, or 0 if trained less than `delta` steps ago (Eq. 7), and one CISPO step against
the sampling log-probs recorded in the event. Checkpoint, then `PolicyPublished(extractor)` and `TrainStepCompleted`
(with each sample's reward, advantage and outcome count, so `crl replay train` re-runs it exactly).

Deterministic mode (`scheduler.deterministic`, docs/determinism.md): it trains at step boundaries only. Once every
train episode of step s is in, and every generation the extractor published for step s - 1 (listed by its
`StepSettled`) has been read, it trains every batch the join can form from the outcomes of steps up to s, the
ready samples ordered by (step, generation id) instead of by arrival, and publishes `StepSettled` (role
extractor_trainer) with its version: the version the extractor distils step s with.

Restart: the join state is rebuilt from the log. The worker keeps no positions: it re-reads `crl.extractions`,
`crl.trajectories` and its own `TrainStepCompleted`s from offset 0 up to the high watermarks it saw at start, without
training, and only then trains on new evidence. Which samples were trained, how often and on how many outcomes
comes from those recorded steps.
"""

from __future__ import annotations

import logging
import statistics
import time

from pipeline.actor.schedule import scheduled_id
from pipeline.actor.settings import ARMS_WITH_A_BANK, FROZEN_EXTRACTOR_ARMS
from pipeline.rl.batching import ExtractorBatch, ExtractorJoin
from pipeline.rl.trainer import (
    PolicyVersion,
    WarmStart,
    events_of,
    unpublished,
)
from pipeline.run.trainer_worker import TrainerWorker
from pipeline.runtime.context import WorkerContext
from pipeline.runtime.offsets import FromTheStart
from pipeline.runtime.runner import Origin, WorkerIO
from pipeline.runtime.transport import OffsetStore
from pipeline.settings import Settings
from schemas.base import Event, Producer
from schemas.extractions import ExtractionGenerated
from schemas.runs import StepSettled
from schemas.topics import EXTRACTIONS, POLICY, TRAIN_STEPS, TRAJECTORIES
from schemas.training import TrainStepCompleted
from schemas.trajectories import TrajectoryCompleted

log = logging.getLogger(__name__)


def extractor_warm_start(settings: Settings) -> WarmStart | None:
    """Fine-tuning of a freshly built extractor on the rule-based summariser's answers
    (`extractor_trainer.warm_start`)."""
    warm = settings.extractor_trainer.warm_start
    if warm.steps == 0:
        return None
    from pipeline.rl.warm_start import warm_start_extractor

    return lambda policy, progress: warm_start_extractor(policy, warm, settings.envs.tasks, settings.envs,
                                                         settings.extractor, progress,
                                                         merges=settings.scheduler.merge_every > 0,
                                                         precision=settings.extractor_trainer.model.precision)


class ExtractorTrainer(TrainerWorker):
    name = "extractor_trainer"
    role = "extractor"
    consumes = (EXTRACTIONS, TRAJECTORIES, TRAIN_STEPS)
    consumption = "assign"
    produces = (POLICY, TRAIN_STEPS)
    arms = ARMS_WITH_A_BANK

    def __init__(self, context: WorkerContext) -> None:
        self.settings = context.settings.extractor_trainer
        self.log = context.log
        self.arm = context.settings.scheduler.arm
        self.trainer = self.policy_trainer(context, extractor_warm_start(context.settings))
        settings = context.settings
        self.deterministic = settings.scheduler.deterministic
        self.join = ExtractorJoin(canonical=self.deterministic, parse_error_reward=self.settings.parse_error_reward)
        self._started: float | None = None
        self.schedule = settings.schedule()
        self.steps = settings.scheduler.steps
        self.producer = Producer(worker=self.name, instance=context.instance)
        self.arrived: dict[int, set[str]] = {}
        """Deterministic mode: the train trajectory ids of each step read so far."""
        self.extractions: set[str] = set()
        """Deterministic mode: the event ids of every `ExtractionGenerated` read (samples or not)."""
        self.extractor_settled: dict[int, StepSettled] = {}
        self.next_step = 0
        """Deterministic mode: the next step to settle (one past the last this run's trainer settled)."""

    def offset_store(self, context: WorkerContext) -> OffsetStore:
        return FromTheStart()  # the join state is rebuilt by reading every input from offset 0

    def start(self, io: WorkerIO) -> None:
        """Note where the inputs end now (the join is rebuilt up to there before any training), and publish what a
        crash between checkpoint and publish left unpublished."""
        io.caught_up()
        self._started = time.monotonic()
        for event in unpublished(self.trainer.current, self.log):
            log.info("publishing %s of version %d (written before the last stop, not yet on the log)", event.kind,
                     self.trainer.current.version)
            io.publish(event)
        if self.trainer.current.train_step is not None:
            self.join.add_train_step(self.trainer.current.train_step)
        io.commit()
        if self.arm in FROZEN_EXTRACTOR_ARMS:
            log.info("arm %s: the extractor stays at version %d and is not trained", self.arm,
                     self.trainer.current.version)

    def handle(self, event: Event, origin: Origin) -> list[Event]:
        if event.run_id != self.trainer.run_id:
            return []  # another run's events never enter this run's batches or credit
        if isinstance(event, ExtractionGenerated):
            self.join.add_extraction(event)
            self.extractions.add(str(event.event_id))
        elif isinstance(event, TrajectoryCompleted):
            self.join.add_trajectory(event)
            if event.split == "train":
                self.arrived.setdefault(event.step, set()).add(event.trajectory_id)
        elif isinstance(event, StepSettled) and event.role == "extractor":
            self.extractor_settled.setdefault(event.step, event)
        elif isinstance(event, StepSettled):
            self.next_step = max(self.next_step, event.step + 1)
        elif isinstance(event, TrainStepCompleted):
            self.join.add_train_step(event)
        return []

    def after_poll(self, io: WorkerIO) -> None:
        """Once the join is rebuilt from the log, train every batch it can form."""
        self.trainer.keep_alive()  # data parallel: the other ranks wait for the next batch
        if self.deterministic and io.caught_up():
            return self._settle_steps(io)
        if self.arm in FROZEN_EXTRACTOR_ARMS or not io.caught_up():
            return
        if self._started is not None:
            log.info("extractor join rebuilt from the log in %.1fs: %d generations, %d credited, %d ready",
                     time.monotonic() - self._started, len(self.join.generations), len(self.join.outcomes),
                     len(self.join.ready()))
            self._started = None
        while (batch := self.join.batch(self.trainer.current.version + 1, self.settings.buffer_size,
                                        self.settings.count_alpha, self.settings.count_delta)) is not None:
            self.train(batch, io)

    def _settle_steps(self, io: WorkerIO) -> None:
        """Deterministic mode: train on each step's outcomes once they and the generations they credit are all in,
        then name the version that distils the step (`StepSettled`)."""
        while self.next_step < self.steps:
            step = self.next_step
            if not self.schedule.trajectory_ids(step, "train") <= self.arrived.get(step, set()):
                return
            if step > 0:
                before = self.extractor_settled.get(step - 1)
                if before is None or not set(before.extraction_event_ids) <= self.extractions:
                    return
            while self.arm not in FROZEN_EXTRACTOR_ARMS and (batch := self.join.batch(
                    self.trainer.current.version + 1, self.settings.buffer_size, self.settings.count_alpha,
                    self.settings.count_delta, through=step)) is not None:
                self.train(batch, io)
            io.publish(StepSettled(
                event_id=scheduled_id(self.trainer.run_id, "settled", "extractor_trainer", step),
                run_id=self.trainer.run_id, producer=self.producer, role="extractor_trainer", step=step,
                extractor_version=self.trainer.current.version))
            io.commit()
            log.info("step %d settled at extractor version %d", step, self.trainer.current.version)
            self.next_step += 1

    def train(self, batch: ExtractorBatch, io: WorkerIO) -> None:
        step = self.trainer.current.version + 1
        started = time.perf_counter()
        before = self.trainer.weight_hash
        result = self.trainer.step(batch.samples)
        metrics = {
            **result.diagnostics(), "train/clipped_low": float(result.clipped_low),
            "train/clipped_high": float(result.clipped_high), "train/grad_norm": result.grad_norm,
            "train/trained_tokens": float(result.trained_tokens), "train/sequences": float(result.sequences),
            "train/lr": self.settings.lr, "train/threads": float(self.settings.threads),
            "train/seconds": time.perf_counter() - started,
            "extractor/reward_mean": statistics.fmean(batch.rewards),
            "extractor/outcomes_mean": statistics.fmean(batch.outcome_counts),
            "extractor/weight_mean": statistics.fmean(batch.weights),
            "extractor/retrained_fraction": statistics.fmean(
                float(bool(self.join.generations[k].trainings)) for k in batch.event_ids),
        }
        event = self.trainer.train_step_event(
            step=step, batch_event_ids=batch.event_ids, weight_hash_before=before,
            weight_hash_after=self.trainer.weight_hash, loss=result.loss, tokens=result.tokens, metrics=metrics,
            rewards=batch.rewards, advantages=batch.advantages, outcome_counts=batch.outcome_counts,
        )
        version = self.trainer.save(event)
        self.join.add_train_step(event)
        self.publish_version(version, io)
        log.info("extractor step %d: loss %.5f, clip %.3f, reward mean %.3f over %d generations", step, result.loss,
                 result.clip_fraction, metrics["extractor/reward_mean"], len(batch.event_ids))

    def publish_version(self, version: PolicyVersion, io: WorkerIO) -> None:
        for event in events_of(version):
            io.publish(event)
        io.commit()
