"""Rollout worker: plays the episodes the scheduler assigns and publishes every one as a `TrajectoryCompleted`.

    crl worker rollout --run-dir runs/demo          # as many instances as you like: they share crl.tasks as a group

The runner polls `crl.tasks` (a consumer group) and hands every assignment to `handle`, which queues it; after every
poll (`after_poll`, without blocking while episodes are in flight):
1. drop queued assignments of partitions that moved to another member; load a newer actor version if one is due;
2. admit queued episodes up to `max_concurrent_episodes`: reset the environment from the task seed; guided slots
   queue the retrieval of the top experience for their query (goal + first observation) through the bank replica,
   served in the background (`EpisodePlayer`: one thread, whatever is queued as one batch — one embedding call, one
   index search) while the episodes already in flight keep playing; each records the served refs and the bank
   offset they came from;
3. play one turn of every episode in flight that is ready with **one batched generation** (prompt: goal, the
   experience if guided, the last actions, the observation), each episode sampling from its own stream (the run's
   `rollout.generation.seed`, its trajectory id and the turn: `pipeline.actor.episodes.turn_seed`, so neither the
   batch nor the number of workers changes its tokens), parse each response into an action, step the
   environments. A guided episode joins once its experience is there, or with nothing after
   `CRL_ROLLOUT__RETRIEVAL_WAIT_S` (then its trajectory has no refs and a null bank offset); the loop waits on
   retrieval only when every episode in flight is waiting, and no longer than that;
4. publish the finished episodes with every turn's prompt and response token ids and sampling log-probs, then commit
   the consumed positions — held back to the oldest episode not yet finished, so a stop or a crash re-plays exactly
   the unfinished ones (their ids are deterministic, downstream dedupes).

It follows `crl.policy` (a newer actor version is loaded, sha256 checked, only when no episode is in flight, so every
trajectory is played by one version, which it records; an assignment that names a newer version than the one loaded,
the staleness bound, waits for it) and `crl.experience-ops` (the bank replica guided episodes are served from). The
runner polls between turns, so long episodes never make the worker leave its consumer group.

Deterministic mode (`scheduler.deterministic`, docs/determinism.md): an assignment is played by exactly the actor
version it names (loaded when no episode is in flight, before the next assignment is admitted); a guided one waits,
unadmitted, until the bank replica has applied the op log up to the assignment's `bank_position`; each retrieval is
served alone on the worker's thread and each episode generates alone (`EpisodePlayer(deterministic=True)`).

Search-and-ask (off by default, `CRL_ROLLOUT__SEARCH_AND_ASK`): a guided episode may answer `ask <question>` up to
`max_ask_calls` times; the bank is searched with the question (in the background, like the start retrieval: the
episode sits out until the answer is there, bounded by the same wait) and the experience found is shown on its next
turn and added to the episode's served refs (so it is credited like the first one).

The bank replica and the encoder are built at the first guided admission, on the worker's thread (once per process;
the replica waits up to `replica_wait_s` to catch up).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from pipeline.actor.episodes import EpisodePlayer
from pipeline.actor.metrics import episode_metrics, summary_line
from pipeline.actor.schedule import trajectory_event_id
from pipeline.models.base import limit_threads
from pipeline.models.policy_follower import PolicyFollower
from pipeline.runtime.context import WorkerContext
from pipeline.runtime.runner import Origin, Worker, WorkerIO
from pipeline.runtime.transport import Position
from schemas.base import Event, Producer
from schemas.tasks import EpisodeAssigned
from schemas.topics import EXPERIENCE_OPS_TOPIC, POLICY, TASKS, TRAJECTORIES
from schemas.training import PolicyPublished
from schemas.trajectories import TrajectoryCompleted

if TYPE_CHECKING:
    from pipeline.bank.replica import BankReplica
    from pipeline.bank.retrieval import Retriever

log = logging.getLogger(__name__)

class Rollout(Worker):
    name = "rollout"
    consumes = (TASKS,)
    consumption = "group"
    produces = (TRAJECTORIES,)
    follows = (POLICY, EXPERIENCE_OPS_TOPIC)
    instances = "rollout_workers"

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        self.settings = context.settings.rollout
        self.run_id = context.settings.resolved_run_id
        self.follower = PolicyFollower(context.follow, "actor")
        self.generation = self.settings.generation
        limit_threads(self.generation.threads)
        self.player = EpisodePlayer(self.settings, context.settings.envs, run_id=self.run_id,
                                    producer=Producer(worker=self.name, instance=context.instance),
                                    seed=self.generation.seed,
                                    deterministic=context.settings.scheduler.deterministic)
        self.queue: deque[tuple[EpisodeAssigned, Origin]] = deque()
        self.finished_window: list[TrajectoryCompleted] = []
        self._replica: BankReplica | None = None
        from threadpoolctl import threadpool_limits

        # OpenBLAS threads spinning after numpy's exact-search matmul slow torch in the same process (~1.6x).
        self._blas_limit = threadpool_limits(1, user_api="blas")

    @classmethod
    def build(cls, context: WorkerContext) -> Rollout:
        return cls(context)

    # -- positions ------------------------------------------------------------------------------------------------

    def committable(self, positions: dict[Position, int]) -> dict[Position, int]:
        pending: dict[Position, int] = {}
        for position, offset in [(e.position, e.offset) for e in self.player.active] + \
                [((o.topic, o.partition), o.offset) for _, o in self.queue]:
            pending[position] = min(offset, pending.get(position, offset))
        return {p: min(offset, pending.get(p, offset)) for p, offset in positions.items()}

    # -- the worker -----------------------------------------------------------------------------------------------

    def start(self, io: WorkerIO) -> None:
        self.follower.start()

    def handle(self, event: Event, origin: Origin) -> list[Event]:
        if isinstance(event, EpisodeAssigned) and event.run_id == self.run_id:
            self.queue.append((event, origin))
        return []

    def poll_timeout_ms(self) -> int | None:
        return 0 if self.player.active else None  # episodes in flight: play on, take what has arrived

    @property
    def busy(self) -> bool:
        return bool(self.player.active or self.queue)

    def after_poll(self, io: WorkerIO) -> None:
        self.queue = deque((a, o) for a, o in self.queue if io.owns((o.topic, o.partition)))
        self._follow_policy()
        self._admit()
        if self.player.active:
            finished = self.player.play_turn()
            for trajectory in finished:
                io.publish(trajectory.model_copy(update={
                    "event_id": trajectory_event_id(trajectory.assignment_event_id)}))
            if finished:
                io.commit()
                self._log_metrics(finished)

    def _newer_version(self) -> PolicyPublished | None:
        return self.follower.newer_than(self.player.version)

    def _follow_policy(self) -> None:
        if self.player.deterministic:
            return self._follow_assigned()
        newer = self._newer_version()
        if newer is not None and not self.player.active:
            self._load(newer)

    def _follow_assigned(self) -> None:
        """Deterministic mode: load the version the next assignment names, once no episode is in flight."""
        if self.player.active or not self.queue:
            return
        wanted = self.queue[0][0].policy_version
        if wanted != self.player.version and (event := self.follower.published(wanted)) is not None:
            self._load(event)

    def _load(self, event: PolicyPublished) -> None:
        policy = self.follower.load(event, self.generation.backend, self.generation.device,
                                    micro_batch_size=self.generation.micro_batch, seed=self.generation.seed,
                                    keeping=self.player.version, current=self.player.policy,
                                    precision=self.generation.precision)
        if policy is not None:
            self.player.policy, self.player.version = policy, event.version

    def _admit(self) -> None:
        if self.player.policy is None:
            return  # nothing loaded yet
        if not self.player.deterministic and self._newer_version() is not None:
            return  # a newer version waits for the episodes in flight to finish
        admitted: list[tuple[EpisodeAssigned, Position, int]] = []
        while self.queue and len(self.player.active) + len(admitted) < self.settings.max_concurrent_episodes:
            assignment, origin = self.queue[0]
            if assignment.policy_version > self.player.version:
                break  # the staleness bound: wait for that version (assignments keep their order)
            if self.player.deterministic and (assignment.policy_version != self.player.version
                                              or not self._bank_at(assignment)):
                break  # exactly its version, and the bank as of its position
            self.queue.popleft()
            admitted.append((assignment, (origin.topic, origin.partition), origin.offset))
        if any(assignment.guided for assignment, _, _ in admitted) and self.player.retriever is None:
            self.player.retriever = self._retriever()
        self.player.start(admitted)

    def _bank_at(self, assignment: EpisodeAssigned) -> bool:
        """Deterministic mode: whether a guided assignment's bank is there (the replica applied the op log up to its
        `bank_position`). Nothing of this run is written past that position while the step plays: the extractor
        distils a step only once every episode of it finished."""
        if not assignment.guided or assignment.bank_position is None:
            return True
        if self.player.retriever is None:
            self.player.retriever = self._retriever()
        assert self._replica is not None
        return self._replica.offset >= assignment.bank_position

    def _retriever(self) -> Retriever:
        """The bank replica and the encoder, built when the first guided episode arrives (warm-up needs neither)."""
        from pipeline.bank.embeddings import load_sentence_encoder
        from pipeline.bank.replica import BankReplica
        from pipeline.bank.retrieval import Retriever

        settings = self.context.settings
        replica = BankReplica(self.context.follow, self.context.log.log_id(EXPERIENCE_OPS_TOPIC),
                              settings.run_dir, settings.bank.exact_threshold, run_id=settings.resolved_run_id,
                              hnsw=settings.bank.hnsw_options()).start()
        self._replica = replica
        if not replica.wait_caught_up(self.settings.replica_wait_s):
            log.warning("bank replica not caught up after %.1fs; serving from offset %d (recorded per episode)",
                        self.settings.replica_wait_s, replica.offset)
        return Retriever(replica, load_sentence_encoder(settings.embedding.model), settings.retrieval)

    def _log_metrics(self, finished: list[TrajectoryCompleted]) -> None:
        self.finished_window += finished
        if len(self.finished_window) >= self.settings.metrics_every:
            metrics = episode_metrics(self.finished_window, "rollout")
            log.info("rollout metrics over %d episodes (actor version %d): %s", len(self.finished_window),
                     self.player.version, summary_line(metrics, "rollout"))
            self.finished_window = []

    def close(self) -> None:
        self.player.close()  # first: it stops the thread that serves retrievals from the retriever
        if self.player.retriever is not None:
            self.player.retriever.close()
        self._blas_limit.restore_original_limits()
