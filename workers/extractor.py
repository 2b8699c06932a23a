"""Extractor worker: distils finished trajectories into experience ops, and consolidates the bank on request.

    crl worker extractor --run-dir runs/demo        # as many instances as you like: they share crl.trajectories

Distillation (consumer group on `crl.trajectories`): every train trajectory (or only guided ones,
`CRL_EXTRACTOR__DISTILL=guided`) of the run is shown to the extractor model with the experiences it was served, as
they stand in the bank now, by alias (`pipeline.extractor.protocol`). One batched generation serves up to `batch_size`
trajectories. Each answer is parsed strictly; `add` becomes `ExperienceAdded` keyed by the embedding of the
trajectory's query (goal + first observation), `refine` becomes `ExperienceRefined` expecting the version the
extractor was shown (`pipeline.extractor.ops`). The worker publishes `ExtractionGenerated` (prompt and response
token ids, sampling log-probs, parse status, op ids) and then its ops. Ids derive from the trajectory id, so a
re-processed trajectory repeats the same ids and the bank and the extractor trainer treat the repeat as a duplicate.
Each generation samples from its own stream, keyed by `extractor.generation.seed` and its trajectory id (a merge
chunk: the merge's step, the family and the chunk index; `pipeline.extractor.protocol.distill_seed` / `merge_seed`),
so neither its batch, nor the instance, nor how many calls came before changes what it draws.

Capacity: when the active bank would exceed `capacity`, the oldest experiences are retired (`ExperienceRetired`,
reason `capacity`), first in, first out.

Merging (`MergeRequested` on `crl.control`, one partition, so one instance of the group merges): the replica first
reads the op log to its end (read your writes); then per task family the active experiences go to the model in
chunks of `merge_chunk`, the newest experience a chunk produced sliding into the next chunk; `merge` gives
`ExperienceMerged` (keyed by its sources' mean key, or by its text: `extractor.merged_key`), `discard` gives
`ExperienceRetired`, `rewrite` gives `ExperienceRefined`.

Policy versions: `crl.policy` is followed for the extractor role; a newer version is loaded (sha256 checked)
between batches. Until version 0 is published the worker holds what it receives (and commits no position past it).

The runner hands every trajectory and merge request to `handle`, which holds it; after each poll (`after_poll`) the
held trajectories are distilled in batches of `batch_size`, then the held merges run, then positions are committed.

Deterministic mode (`scheduler.deterministic`, docs/determinism.md): nothing is distilled as it arrives. Step s is
distilled once every episode of it finished (evaluation included, so no guided episode of the step is served from a
bank that moves) and the extractor trainer settled it (`StepSettled`, naming the version to distil with): its train
trajectories in trajectory-id order, in chunks of `batch_size`, each chunk reading the ops of the chunks before; then
the merge due after step s; then the replica reads the op log to its end, and `StepSettled` (role extractor, that
end as `bank_offset`, the generations' event ids) lets the scheduler issue step s + 1.

Arms: in `grpo` there is no bank, so the worker only acknowledges its inputs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from pipeline.actor.schedule import scheduled_id
from pipeline.actor.settings import ARMS_WITH_A_BANK
from pipeline.bank.replica import BankReplica
from pipeline.bank.retrieval import start_query
from pipeline.errors import InvalidStateError, ParseError
from pipeline.extractor.ops import (
    OpAuthor,
    Shown,
    distill_ops,
    eviction_ops,
    generation_record,
    merge_ops,
    merged_key,
)
from pipeline.extractor.protocol import (
    ANSWER_STOP,
    EXTRACTOR_SYSTEM,
    DistillOp,
    TrajectoryDigest,
    distill_generation_id,
    distill_prompt,
    distill_seed,
    merge_generation_id,
    merge_prompt,
    merge_seed,
    parse_distill,
    parse_merge,
)
from pipeline.models.base import Generation, PolicyModel, SamplingParams, limit_threads
from pipeline.models.policy_follower import PolicyFollower
from pipeline.runtime.context import WorkerContext
from pipeline.runtime.log import Follow, FollowedView, events_to_end
from pipeline.runtime.runner import Origin, Worker, WorkerIO
from pipeline.runtime.transport import Position, Record
from schemas.arrays import EmbeddingVector
from schemas.base import Event, Producer
from schemas.codec import EventDecodeError, decode
from schemas.experiences import (
    ExperienceAdded,
)
from schemas.extractions import ExtractionGenerated
from schemas.runs import MergeRequested, StepSettled
from schemas.topics import CONTROL, EXPERIENCE_OPS_TOPIC, EXTRACTIONS, POLICY, TRAIN_STEPS, TRAJECTORIES
from schemas.trajectories import TrajectoryCompleted

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

log = logging.getLogger(__name__)

class SettledSteps(FollowedView):
    """Follows `crl.train-steps` for one role's `StepSettled` of one run (the extractor reads its trainer's this way:
    consuming the topic would order the two kinds' starts in a cycle)."""

    def __init__(self, follow: Follow, role: str, run_id: str) -> None:
        self.role, self.run_id = role, run_id
        self._settled: dict[int, StepSettled] = {}
        self._lock = threading.Lock()
        self.follower = follow([TRAIN_STEPS], self._on_record, name=f"settled-{role}")

    def get(self, step: int) -> StepSettled | None:
        if self.failure is not None:
            raise InvalidStateError(f"the {self.role} settlement follower stopped: {self.failure}") from self.failure
        with self._lock:
            return self._settled.get(step)

    def _on_record(self, record: Record) -> None:
        try:
            event = decode(TRAIN_STEPS, record.value)
        except EventDecodeError:
            return  # dead-lettered by the workers that consume crl.train-steps
        if isinstance(event, StepSettled) and event.role == self.role and event.run_id == self.run_id:
            with self._lock:
                self._settled.setdefault(event.step, event)


class Extractor(Worker):
    name = "extractor"
    consumes = (TRAJECTORIES, CONTROL)
    consumption = "group"
    produces = (EXTRACTIONS, EXPERIENCE_OPS_TOPIC, TRAIN_STEPS)
    follows = (POLICY, EXPERIENCE_OPS_TOPIC, TRAIN_STEPS)
    arms = ARMS_WITH_A_BANK
    instances = "extractor_workers"

    def __init__(self, context: WorkerContext) -> None:
        settings = context.settings
        self.context = context
        self.settings = settings.extractor
        self.arm = settings.scheduler.arm
        self.run_id = settings.resolved_run_id
        self.embedding_model = settings.embedding.model
        self.retrieval_key = settings.retrieval.key
        """What of a trajectory's start keys the experiences it adds: the rollout workers key their queries alike."""
        self.producer = Producer(worker=self.name, instance=context.instance)
        self.follower = PolicyFollower(context.follow, "extractor")
        self.generation = self.settings.generation
        limit_threads(self.generation.threads)
        self.sampling = SamplingParams(
            max_new_tokens=self.generation.max_new_tokens, temperature=self.generation.temperature,
            top_p=self.generation.top_p, top_k=self.generation.top_k, stop=(ANSWER_STOP,))
        self.policy: PolicyModel | None = None
        self.version = -1
        self.replica: BankReplica | None = None
        self.encoder: SentenceTransformer | None = None
        self.held: list[tuple[TrajectoryCompleted | MergeRequested, Origin]] = []
        """Trajectories to distil and merges to run, in arrival order, with where they were read."""
        self._last_wait_log = 0.0
        self.statuses: Counter[str] = Counter()
        self.op_kinds: Counter[str] = Counter()
        self.deterministic = settings.scheduler.deterministic
        self.schedule = settings.schedule()
        self.steps = settings.scheduler.steps
        self.arrived: dict[int, set[str]] = {}
        """Deterministic mode: the trajectory ids of each step read so far (every split)."""
        self.trainer_settled = SettledSteps(context.follow, "extractor_trainer", self.run_id) \
            if self.deterministic else None
        self.next_step = 0
        """Deterministic mode: the next step to distil (one past the last this run's extractor settled)."""
        self._expected: dict[int, frozenset[str]] = {}
        self._published: list[str] = []
        """Event ids of the `ExtractionGenerated` published since the step began (deterministic mode)."""

    @classmethod
    def build(cls, context: WorkerContext) -> Extractor:
        return cls(context)

    # -- the worker -----------------------------------------------------------------------------------------------

    def start(self, io: WorkerIO) -> None:
        if self.arm == "grpo":
            log.info("arm grpo has no experience bank: acknowledging inputs without distilling")
            return
        from pipeline.bank.embeddings import load_sentence_encoder

        settings = self.context.settings
        self.follower.start()
        self.replica = BankReplica(self.context.follow, self.context.log.log_id(EXPERIENCE_OPS_TOPIC),
                                   settings.run_dir, settings.bank.exact_threshold,
                                   run_id=settings.resolved_run_id, hnsw=settings.bank.hnsw_options()).start()
        self.encoder = load_sentence_encoder(self.embedding_model)
        if self.trainer_settled is not None:
            self.trainer_settled.start()
            for event in events_to_end(self.context.log, TRAIN_STEPS):
                if isinstance(event, StepSettled) and event.run_id == self.run_id and event.role == "extractor":
                    self.next_step = max(self.next_step, event.step + 1)

    def handle(self, event: Event, origin: Origin) -> list[Event]:
        if self.arm == "grpo" or event.run_id != self.run_id:
            return []
        if isinstance(event, TrajectoryCompleted) and self.deterministic:
            # every trajectory of the step holds its position until the step is settled, so a restart reads the
            # whole step again (evaluation episodes too: the step waits for them)
            self.arrived.setdefault(event.step, set()).add(event.trajectory_id)
            self.held.append((event, origin))
            return []
        if (isinstance(event, TrajectoryCompleted) and self._distils(event)) or isinstance(event, MergeRequested):
            self.held.append((event, origin))
        return []

    def committable(self, positions: dict[Position, int]) -> dict[Position, int]:
        held: dict[Position, int] = {}
        for _, origin in self.held:
            position = (origin.topic, origin.partition)
            held[position] = min(origin.offset, held.get(position, origin.offset))
        return {p: min(offset, held.get(p, offset)) for p, offset in positions.items()}

    @property
    def busy(self) -> bool:
        return bool(self.held) and self.policy is not None

    def after_poll(self, io: WorkerIO) -> None:
        if self.arm == "grpo":
            return
        self.held = [(event, origin) for event, origin in self.held if io.owns((origin.topic, origin.partition))]
        if self.deterministic:
            return self._settle_steps(io)
        self._follow_policy()
        if self.policy is None:
            now = time.monotonic()
            if self.held and now - self._last_wait_log > 30:
                self._last_wait_log = now
                log.info("waiting for extractor version 0 on crl.policy (the extractor trainer publishes it); "
                         "%d inputs held", len(self.held))
            return
        held, self.held = self.held, []
        trajectories = [event for event, _ in held if isinstance(event, TrajectoryCompleted)]
        size = self.settings.batch_size
        for start in range(0, len(trajectories), size):
            self.distill(trajectories[start:start + size], io)
        for event, _ in held:
            if isinstance(event, MergeRequested):
                self.merge(event, io)

    def _settle_steps(self, io: WorkerIO) -> None:
        """Deterministic mode: distil, merge and settle every step that is due, in order."""
        # read again after a restart: settled before it
        self.held = [(e, o) for e, o in self.held if e.step >= self.next_step]
        while self.next_step < self.steps:
            step = self.next_step
            expected = self._expected.setdefault(step, self.schedule.trajectory_ids(step))
            assert self.trainer_settled is not None
            trainer = self.trainer_settled.get(step)
            if not expected <= self.arrived.get(step, set()) or trainer is None:
                return
            merges = [e for e, _ in self.held if isinstance(e, MergeRequested) and e.step == step]
            if step + 1 < self.steps and self.schedule.merge_due(step + 1) and not merges:
                return  # the scheduler requests it once every episode of the step finished
            if not self._load_version(trainer.extractor_version):
                return
            by_id = {e.trajectory_id: e for e, _ in self.held
                     if isinstance(e, TrajectoryCompleted) and e.step == step and self._distils(e)}
            trajectories = [by_id[key] for key in sorted(by_id)]
            self._published = []
            size = self.settings.batch_size
            for start in range(0, len(trajectories), size):
                self.distill(trajectories[start:start + size], io)
            for merge in merges[:1]:
                self.merge(merge, io)
            self._sync(strict=True)
            assert self.replica is not None
            io.publish(StepSettled(
                event_id=scheduled_id(self.run_id, "settled", "extractor", step), run_id=self.run_id,
                producer=self.producer, role="extractor", step=step, extractor_version=self.version,
                bank_offset=self.replica.offset, extraction_event_ids=tuple(self._published)))
            self.held = [(e, o) for e, o in self.held if e.step != step]
            io.commit()
            log.info("step %d settled: %d trajectories distilled with extractor version %d, bank at offset %d",
                     step, len(trajectories), self.version, self.replica.offset)
            self.next_step += 1

    def _load_version(self, version: int) -> bool:
        """Deterministic mode: have exactly `version` loaded (False while its `PolicyPublished` is not seen)."""
        if self.version == version:
            return True
        event = self.follower.published(version)
        if event is None:
            return False
        policy = self.follower.load(event, self.generation.backend, self.generation.device,
                                    micro_batch_size=self.generation.micro_batch, seed=self.generation.seed,
                                    keeping=self.version, current=self.policy, precision=self.generation.precision)
        if policy is None:
            raise InvalidStateError(f"extractor version {version}, named by the extractor trainer for a step, failed "
                                    "its checksum: a deterministic run cannot go on without it")
        self.policy, self.version = policy, version
        return True

    def _distils(self, trajectory: TrajectoryCompleted) -> bool:
        if trajectory.split != "train":
            return False  # evaluation episodes measure the bank; distilling them would leak the eval pool into it
        if trajectory.env_error is not None:
            return False  # the engine failed it: there is nothing to learn from how it ended
        return self.settings.distill == "all" or trajectory.guided

    def _follow_policy(self) -> None:
        newer = self.follower.newer_than(self.version)
        if newer is None:
            return
        policy = self.follower.load(newer, self.generation.backend, self.generation.device,
                                    micro_batch_size=self.generation.micro_batch, seed=self.generation.seed,
                                    keeping=self.version, current=self.policy, precision=self.generation.precision)
        if policy is not None:
            self.policy, self.version = policy, newer.version

    def _generate(self, prompts: list[str], seeds: list[int]) -> list[Generation]:
        """One batched generation; row `i` samples from its own stream `seeds[i]` (`distill_seed`, `merge_seed`)."""
        assert self.policy is not None
        return self.policy.generate([self.policy.prompt_ids(p, EXTRACTOR_SYSTEM) for p in prompts],
                                    self.sampling, seeds=seeds)

    def _keys(self, texts: list[str]) -> list[EmbeddingVector]:
        if not texts:
            return []
        assert self.encoder is not None
        vectors = self.encoder.encode(texts, convert_to_numpy=True, normalize_embeddings=True,
                                      show_progress_bar=False)
        return [EmbeddingVector.from_array(self.embedding_model, vector) for vector in vectors]

    def _sync(self, strict: bool = False) -> None:
        """Let the replica apply every op on the log now, our own included (read your writes). Deterministic mode
        cannot go on with less: it waits, and fails after 60 times `replica_wait_s`."""
        assert self.replica is not None
        end = self.context.log.end_offsets(EXPERIENCE_OPS_TOPIC)[0]
        strict = strict or self.deterministic
        if strict and not self.replica.wait_for_offset(end, 60 * self.settings.replica_wait_s):
            raise InvalidStateError(f"bank replica at offset {self.replica.offset}, not {end}, after "
                                    f"{60 * self.settings.replica_wait_s:.0f}s: deterministic mode needs every op")
        if not self.replica.wait_for_offset(end, self.settings.replica_wait_s):
            log.warning("bank replica at offset %d, not %d, after %.1fs; going on with what it has",
                        self.replica.offset, end, self.settings.replica_wait_s)

    # -- distillation ---------------------------------------------------------------------------------------------

    def _shown(self, trajectory: TrajectoryCompleted) -> list[Shown]:
        """The experiences the episode was served, as the bank holds them now (retired ones are not shown)."""
        assert self.replica is not None
        shown: list[Shown] = []
        for ref in trajectory.retrieved:
            experience = self.replica.experience(ref.experience_id)
            if experience is not None and experience.active and all(s.experience_id != ref.experience_id
                                                                    for s in shown):
                shown.append(Shown(experience.experience_id, experience.version, experience.generation_id,
                                   experience.text))
        return shown

    def distill(self, trajectories: list[TrajectoryCompleted], io: WorkerIO) -> None:
        """One batched generation over `trajectories`; publish every generation and its ops, then commit."""
        s = self.settings
        self._sync()
        shown = [self._shown(t) for t in trajectories]
        prompts = [distill_prompt(TrajectoryDigest.of(t), [e.text for e in shown_t], max_ops=s.max_ops,
                                  max_actions=s.max_actions_shown)
                   for t, shown_t in zip(trajectories, shown, strict=True)]
        started = time.perf_counter()
        generations = self._generate(prompts, [distill_seed(self.generation.seed, t.trajectory_id)
                                               for t in trajectories])
        seconds = time.perf_counter() - started
        parsed_all: list[tuple[list[DistillOp], str | None]] = []
        for shown_t, generation in zip(shown, generations, strict=True):
            try:
                parsed_all.append((parse_distill(generation.text, len(shown_t), max_ops=s.max_ops,
                                                 max_chars=s.max_experience_chars), None))
            except ParseError as exc:
                parsed_all.append(([], str(exc)))
        # Keys only for trajectories that add an experience: one encode call for the batch.
        adding = [t for t, (parsed, _) in zip(trajectories, parsed_all, strict=True)
                  if any(op.op == "add" for op in parsed)]
        keys = dict(zip([t.trajectory_id for t in adding], self._keys(
            [start_query(t, self.retrieval_key) for t in adding]), strict=True))
        author = self._author()
        added = 0
        for trajectory, shown_t, generation, (parsed, error) in zip(trajectories, shown, generations, parsed_all,
                                                                   strict=True):
            generation_id = distill_generation_id(self.run_id, trajectory.trajectory_id)
            ops = distill_ops(author, generation_id, trajectory, shown_t, parsed, keys.get(trajectory.trajectory_id))
            added += sum(isinstance(op, ExperienceAdded) for op in ops)
            self._publish(io, generation_record(
                author, generation_id, "distill", trajectory.task_family, trajectory.step, (trajectory.trajectory_id,),
                shown_t, generation, error, ops), ops)
        assert self.replica is not None
        for event in eviction_ops(author, generation_id, self.replica.active_experiences(), added,
                                  self.settings.capacity):
            self.op_kinds[event.kind] += 1
            io.publish(event)
        io.commit()
        log.info("distilled %d trajectories in %.2fs with extractor version %d; parse status so far %s, ops %s",
                 len(trajectories), seconds, self.version, dict(self.statuses), dict(self.op_kinds))

    def _author(self) -> OpAuthor:
        return OpAuthor(run_id=self.run_id, producer=self.producer, extractor_version=self.version)

    def _publish(self, io: WorkerIO, generation: ExtractionGenerated, ops: list[Event]) -> None:
        self.statuses[generation.parse_status] += 1
        self._published.append(str(generation.event_id))
        io.publish(generation)
        for op in ops:
            self.op_kinds[op.kind] += 1
            io.publish(op)

    # -- merging --------------------------------------------------------------------------------------------------

    def merge(self, request: MergeRequested, io: WorkerIO) -> None:
        """Consolidate every family of `request` chunk by chunk; publish as it goes, then commit."""
        assert self.replica is not None
        self._sync()
        started = time.perf_counter()
        generations = 0
        for family in request.task_families:
            queue = [Shown(e.experience_id, e.version, e.generation_id, e.text, e.key)
                     for e in self.replica.active_experiences(family)]
            carry: Shown | None = None
            chunk = 0
            while queue:
                take = self.settings.merge_chunk - (carry is not None)
                members = ([carry] if carry is not None else []) + queue[:take]
                queue = queue[take:]
                if len(members) < 2:
                    break
                carry = self._merge_chunk(io, request, family, chunk, members)
                chunk += 1
                generations += 1
        io.commit()
        log.info("merge %s: %d generations in %.2fs", request.merge_id, generations, time.perf_counter() - started)

    def _merge_chunk(self, io: WorkerIO, request: MergeRequested, family: str, chunk: int,
                     members: list[Shown]) -> Shown | None:
        """Merge generation `chunk` of `family` over `members`; returns what slides into the next chunk."""
        generation_id = merge_generation_id(request.merge_id, family, chunk)
        generation = self._generate([merge_prompt(family, [m.text for m in members])],
                                    [merge_seed(self.generation.seed, request.step, family, chunk)])[0]
        error = None
        try:
            parsed = parse_merge(generation.text, len(members), max_chars=self.settings.max_experience_chars)
        except ParseError as exc:
            parsed, error = [], str(exc)
        merges = [op for op in parsed if op.op == "merge"]
        if self.settings.merged_key == "sources":
            keys = [merged_key(self.embedding_model, [members[alias - 1].key for alias in op.aliases])
                    for op in merges]
        else:
            keys = self._keys([op.text or "" for op in merges])
        ops, carry = merge_ops(self._author(), generation_id, family, members, parsed, keys)
        self._publish(io, generation_record(self._author(), generation_id, "merge", family, request.step, (), members,
                                            generation, error, ops), ops)
        return carry
