"""Rollout worker: plays the episodes the scheduler assigns and publishes every one as a `TrajectoryCompleted`.

    crl worker rollout --run-dir runs/demo          # as many instances as you like: they share crl.tasks as a group

One loop, one thread:
1. poll `crl.tasks` (consumer group) without blocking while episodes are in flight; queue the assignments;
2. admit queued episodes up to `max_concurrent_episodes`: reset the environment from the task seed; guided slots
   retrieve the top experience for their query (goal + first observation) through the bank replica — all new guided
   episodes in one batched call (one embedding call, one index search) — and record the served refs and the bank
   offset they came from;
3. play one turn of every episode in flight with **one batched generation** (prompt: goal, the experience if
   guided, the last actions, the observation), parse each response into an action, step the environments;
4. publish the finished episodes with every turn's prompt and response token ids and sampling log-probs, then commit
   the consumed positions — held back to the oldest episode not yet finished, so a stop or a crash re-plays exactly
   the unfinished ones (their ids are deterministic, downstream dedupes).

Policy versions: a background follower reads `crl.policy`; a newer actor version is loaded (sha256 checked) only when
no episode is in flight, so every trajectory is played by one version, which it records. An assignment that names a
newer version than the one loaded (the staleness bound) waits for it. Between turns the loop polls Kafka, so long
episodes never make the worker leave its consumer group.

Search-and-ask (off by default, `CRL_ROLLOUT__SEARCH_AND_ASK`): a guided episode may answer `ask <question>` up to
`max_ask_calls` times; the bank is searched with the question and the experience found is shown on the next turn
and added to the episode's served refs (so it is credited like the first one).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass, field

from pipeline.envs.base import TextEnv
from pipeline.envs.registry import make_env
from pipeline.episode_metrics import episode_metrics, summary_line
from pipeline.errors import CheckpointError
from pipeline.launch import WorkerContext
from pipeline.models.base import PolicyModel, SamplingParams
from pipeline.policy_follower import PolicyFollower, load_published
from pipeline.runner import Origin, Source, SourceIO
from pipeline.transport import Position
from schemas.base import Producer
from schemas.tasks import EpisodeAssigned
from schemas.topics import TASKS
from schemas.training import PolicyPublished
from schemas.trajectories import ExperienceRef, Timings, TrajectoryCompleted, Turn

log = logging.getLogger(__name__)

ASK = "ask"


@dataclass
class Episode:
    """One episode in flight."""

    assignment: EpisodeAssigned
    position: Position
    offset: int
    env: TextEnv
    goal: str
    observation: str
    experience: str | None = None
    answer: str | None = None
    retrieved: list[ExperienceRef] = field(default_factory=list)
    bank_offset: int | None = None
    turns: list[Turn] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    asks: int = 0
    actions: int = 0
    invalid: int = 0
    generation_s: float = 0.0
    env_s: float = 0.0
    retrieval_s: float = 0.0
    outcome_reward: float = 0.0
    success: bool = False
    truncated: bool = False
    done: bool = False


def actor_prompt(episode: Episode, history_turns: int, asks_left: int) -> str:
    """The actor's prompt for the next turn. The experience and answers sit in the prompt only: the recorded
    observation is the environment's text alone."""
    a = episode.assignment
    lines = [f"Task: {a.env_id}. Goal: {episode.goal}"]
    if episode.experience:
        lines.append(f"Experience: {episode.experience}")
    if episode.answer:
        lines.append(f"Answer: {episode.answer}")
    if history_turns and episode.history:
        lines.append("Previous actions: " + ", ".join(episode.history[-history_turns:]))
    lines.append("Observation:")
    lines.append(episode.observation)
    if asks_left:
        lines.append(f"You may also write: {ASK} <question> ({asks_left} left)")
    lines.append("Action:")
    return "\n".join(lines)


class EnvPool:
    """Idle environments by (env id, turn limit), reused across episodes (building one costs ~50 ms)."""

    def __init__(self, context: WorkerContext) -> None:
        self.settings = context.settings.envs
        self.idle: dict[tuple[str, int, str], list[TextEnv]] = defaultdict(list)

    def get(self, assignment: EpisodeAssigned) -> TextEnv:
        key = (assignment.env_id, assignment.max_turns, assignment.split)
        if self.idle[key]:
            return self.idle[key].pop()
        return make_env(assignment.env_id, self.settings, max_turns=assignment.max_turns, split=assignment.split)

    def put(self, assignment: EpisodeAssigned, env: TextEnv) -> None:
        self.idle[(assignment.env_id, assignment.max_turns, assignment.split)].append(env)

    def close(self) -> None:
        for envs in self.idle.values():
            for env in envs:
                env.close()


class Rollout(Source):
    name = "rollout"
    inputs = (TASKS,)
    consumption = "group"

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        self.settings = context.settings.rollout
        self.kafka = context.settings.resolve_kafka()
        self.run_id = context.settings.resolved_run_id
        self.producer = Producer(worker=self.name, instance=context.instance)
        self.follower = PolicyFollower(self.kafka, "actor", client_id=f"{context.instance}-policy")
        self.envs = EnvPool(context)
        self.sampling = SamplingParams(
            max_new_tokens=self.settings.max_new_tokens, temperature=context.settings.actor_trainer.temperature,
            top_p=self.settings.top_p, top_k=self.settings.top_k, stop=("\n",))
        self.policy: PolicyModel | None = None
        self.version = -1
        self.bad_versions: set[int] = set()
        self.queue: deque[tuple[EpisodeAssigned, Origin]] = deque()
        self.active: list[Episode] = []
        self.finished_window: list[TrajectoryCompleted] = []
        self.seed_base = (self.settings.seed * 1_000_003 + zlib.crc32(context.instance.encode())) % 2**31
        self.calls = 0
        self._retriever = None
        self._replica = None
        from threadpoolctl import threadpool_limits

        # OpenBLAS threads spinning after numpy's exact-search matmul slow torch in the same process (~1.6x).
        self._blas_limit = threadpool_limits(1, user_api="blas")

    @classmethod
    def build(cls, context: WorkerContext) -> Rollout:
        return cls(context)

    # -- positions ------------------------------------------------------------------------------------------------

    def committable(self, positions: dict[Position, int]) -> dict[Position, int]:
        pending: dict[Position, int] = {}
        for position, offset in [(e.position, e.offset) for e in self.active] + \
                [((o.topic, o.partition), o.offset) for _, o in self.queue]:
            pending[position] = min(offset, pending.get(position, offset))
        return {p: min(offset, pending.get(p, offset)) for p, offset in positions.items()}

    # -- the loop -------------------------------------------------------------------------------------------------

    def run(self, io: SourceIO) -> None:
        self.follower.start()
        while not io.stopping:
            for event, origin in io.poll(0 if self.active else None):
                if isinstance(event, EpisodeAssigned) and event.run_id == self.run_id:
                    self.queue.append((event, origin))
            self.queue = deque((a, o) for a, o in self.queue if io.owns((o.topic, o.partition)))
            self._follow_policy()
            self._admit()
            if self.active:
                finished = self._play_turn()
                for trajectory in finished:
                    io.publish(trajectory)
                if finished:
                    io.commit()
                    self._log_metrics(finished)

    def _follow_policy(self) -> None:
        newest = self.follower.newest()
        if newest is None or newest.version <= self.version or newest.version in self.bad_versions or self.active:
            return
        self._load(newest)

    def _load(self, event: PolicyPublished) -> None:
        started = time.perf_counter()
        try:
            policy = load_published(event, self.settings.backend, self.settings.device,
                                    micro_batch_size=self.settings.generation_micro_batch, seed=self.seed_base)
        except CheckpointError as exc:
            self.bad_versions.add(event.version)
            log.error("actor version %d refused (%s); keeping version %d", event.version, exc, self.version)
            return
        self.policy, self.version = policy, event.version
        log.info("actor version %d loaded in %.2fs (sha256 %s checked)", event.version,
                 time.perf_counter() - started, event.sha256[:12])

    def _admit(self) -> None:
        newest = self.follower.newest()
        if self.policy is None or (newest is not None and newest.version > self.version
                                   and newest.version not in self.bad_versions):
            return  # nothing loaded yet, or a newer version waits for the episodes in flight to finish
        admitted: list[Episode] = []
        while self.queue and len(self.active) + len(admitted) < self.settings.max_concurrent_episodes:
            assignment, origin = self.queue[0]
            if assignment.policy_version > self.version:
                break  # the staleness bound: wait for that version (assignments keep their order)
            self.queue.popleft()
            env = self.envs.get(assignment)
            started = time.perf_counter()
            goal, observation = env.reset(assignment.seed)
            episode = Episode(assignment, (origin.topic, origin.partition), origin.offset, env, goal, observation)
            episode.env_s += time.perf_counter() - started
            admitted.append(episode)
        guided = [e for e in admitted if e.assignment.guided]
        if guided:
            self._retrieve(guided, [e.observation for e in guided])
        self.active += admitted

    # -- retrieval ------------------------------------------------------------------------------------------------

    def _retriever_ready(self):  # type: ignore[no-untyped-def]
        if self._retriever is None:
            from pipeline.bank.replica import BankReplica
            from pipeline.embeddings import load_sentence_encoder
            from pipeline.retrieval import Retriever

            settings = self.context.settings
            self._replica = BankReplica(self.kafka, settings.run_dir, settings.bank.exact_threshold).start()
            if not self._replica.wait_caught_up(self.settings.replica_wait_s):
                log.warning("bank replica not caught up after %.1fs; serving from offset %d (recorded per episode)",
                            self.settings.replica_wait_s, self._replica.offset)
            encoder = load_sentence_encoder(settings.embedding.model)
            self._retriever = Retriever(self._replica, encoder, settings.retrieval)
        return self._retriever

    def _retrieve(self, episodes: list[Episode], questions: list[str]) -> None:
        from pipeline.retrieval import query_text

        retriever = self._retriever_ready()
        started = time.perf_counter()
        found = retriever.retrieve_many([(query_text(e.goal, q), e.assignment.task_family)
                                         for e, q in zip(episodes, questions, strict=True)])
        share = (time.perf_counter() - started) / len(episodes)
        for episode, retrieval in zip(episodes, found, strict=True):
            episode.retrieval_s += share
            episode.bank_offset = retrieval.bank_offset
            text = retrieval.experiences[0].text if retrieval.experiences else None
            if episode.turns:
                episode.answer = text or "nothing relevant in the experience bank"
            else:
                episode.experience = text
            for experience in retrieval.experiences:
                if experience.ref() not in episode.retrieved:
                    episode.retrieved.append(experience.ref())

    # -- one turn of every episode in flight ------------------------------------------------------------------------

    def _asks_left(self, episode: Episode) -> int:
        if not (self.settings.search_and_ask and episode.assignment.guided):
            return 0
        return self.settings.max_ask_calls - episode.asks

    def _play_turn(self) -> list[TrajectoryCompleted]:
        assert self.policy is not None
        prompts = [actor_prompt(e, self.settings.history_turns, self._asks_left(e)) for e in self.active]
        started = time.perf_counter()
        generations = self.policy.generate(prompts, self.sampling, seed=(self.seed_base + self.calls) % 2**31)
        self.calls += 1
        share = (time.perf_counter() - started) / len(self.active)
        questions: list[tuple[Episode, str]] = []
        for episode, generation in zip(self.active, generations, strict=True):
            episode.generation_s += share
            shown = episode.observation
            response = generation.text
            first_line = next((line.strip() for line in response.splitlines() if line.strip()), "")
            if self._asks_left(episode) and first_line.lower().startswith(ASK + " ") and first_line[4:].strip():
                question = first_line[4:].strip()
                episode.asks += 1
                questions.append((episode, question))
                action, valid, reward = f"{ASK} {question}", True, 0.0
            else:
                started = time.perf_counter()
                outcome = episode.env.step(response)
                episode.env_s += time.perf_counter() - started
                episode.actions += 1
                episode.invalid += not outcome.info.valid
                action, valid, reward = outcome.info.action, outcome.info.valid, outcome.reward
                episode.observation = outcome.observation
                episode.history.append(action if valid else "(invalid)")
                if outcome.done:
                    episode.done, episode.success = True, outcome.info.success
                    episode.truncated, episode.outcome_reward = outcome.info.truncated, outcome.reward
            episode.turns.append(Turn(
                observation=shown, prompt_token_ids=generation.prompt_token_ids,
                response_token_ids=generation.token_ids, sampling_logprobs=generation.logprobs,
                response_text=response, action=action, valid=valid, reward=reward))
        if questions:
            self._retrieve([e for e, _ in questions], [q for _, q in questions])
        finished = [e for e in self.active if e.done]
        self.active = [e for e in self.active if not e.done]
        return [self._trajectory(e) for e in finished]

    def _trajectory(self, episode: Episode) -> TrajectoryCompleted:
        a = episode.assignment
        self.envs.put(a, episode.env)
        return TrajectoryCompleted(
            run_id=self.run_id, producer=self.producer, trajectory_id=f"{a.group_id}-k{a.slot}",
            assignment_event_id=str(a.event_id), step=a.step, split=a.split, env_id=a.env_id,
            task_family=a.task_family, seed=a.seed, group_id=a.group_id, slot=a.slot, guided=a.guided,
            goal=episode.goal, turns=tuple(episode.turns), reward=episode.outcome_reward, success=episode.success,
            num_actions=episode.actions, invalid_actions=episode.invalid, truncated=episode.truncated,
            retrieved=tuple(episode.retrieved) if a.guided else (),
            bank_offset=episode.bank_offset if a.guided else None, policy_version=self.version,
            timings=Timings(generation_s=episode.generation_s, env_s=episode.env_s,
                            retrieval_s=episode.retrieval_s),
        )

    def _log_metrics(self, finished: list[TrajectoryCompleted]) -> None:
        self.finished_window += finished
        if len(self.finished_window) >= self.settings.metrics_every:
            metrics = episode_metrics(self.finished_window, "rollout")
            log.info("rollout metrics over %d episodes (actor version %d): %s", len(self.finished_window),
                     self.version, summary_line(metrics, "rollout"))
            self.finished_window = []

    def close(self) -> None:
        self.follower.stop()
        if self._retriever is not None:
            self._retriever.close()
        if self._replica is not None:
            self._replica.stop()
        self.envs.close()
        self._blas_limit.restore_original_limits()
