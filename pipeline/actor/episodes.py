"""Playing episodes in batches: the rollout worker's engine, without Kafka (the benchmark and tests use it directly).

    player = EpisodePlayer(settings.rollout, settings.envs, run_id="r", producer=producer,
                           retriever=retriever)            # retriever: None when no slot is guided
    player.policy, player.version = policy, 0
    player.start([(assignment, ("crl.tasks", 0), offset), ...])   # reset envs; guided: retrieval queued, not awaited
    while player.active:
        finished = player.play_turn()                        # one batched generation over the episodes ready
    # or, with nothing else to do between turns: finished = player.play_to_end()

Retrieval is off the playing thread. `start` resets the environments and hands the guided episodes' queries to one
background thread (`BackgroundRetrieval`), which serves whatever is queued when it becomes free as one
`retrieve_many` batch: one encode of the distinct uncached texts, one index search, queries served in the order they
were queued. A guided episode stays in `active` (so the worker's commits hold back for it) but sits out the turns
until its experience is there; `play_turn` first takes in the retrievals that came back, then generates over every
episode that is ready. An episode still waiting after `RolloutSettings.retrieval_wait_s` joins with nothing: no
experience in its prompt, no refs, `bank_offset` None on its trajectory (a guided trajectory with a null bank offset
was served nothing because its retrieval did not come back in time; a bank with nothing for its family still records
the offset it searched). `play_turn` waits on retrieval only when every episode in flight is waiting, until the
first retrieval comes back or the first wait runs out (`stats.blocked_s` adds that time up). An `ask` goes the same
way: the episode sits out until the answer is there (or gets the no-answer reply after the same wait).

Determinism: every random draw of an episode comes from streams keyed by the run's sampling seed
(`rollout.generation.seed`, the player's `seed`) and the episode's identity, never by what shares its batch, how
many generate calls came before, how many workers play or when anything happened. Turn `t` of the episode with
trajectory id `<group_id>-k<slot>` samples with `turn_seed(seed, episode_id(assignment), t)`, its own row seed in
`PolicyModel.generate`. What else could vary is fixed upstream: the environment's task seed and whether the slot is
guided come from the schedule (`pipeline.actor.schedule`, pure functions of the settings and the step), and the
environments are seeded from the task seed alone (`TextEnv.reset(seed)`). Nothing else in an episode draws at
random: action parsing is a pure function of the response, and retrieval ranks by score with fixed tie-breaks
(`pipeline.bank.retrieval.diversify`); the experience served is a function of the bank state it was served from
(the recorded `bank_offset`) and of the retriever's serve counts (which episodes were served before it), not of a
random stream. So an episode's tokens and rewards are a function of its prompts, which are its observations and
what the bank served it, and of `(seed, episode id, turn)`: played alone,
in any batch, or by another worker, it draws the same tokens up to float near-ties in the batched forward pass
(the tiny model on CPU: none observed, `tests/workers/test_episode_streams.py`). A guided episode that waits for its
retrieval joins a later generate call; that changes its timings, not its tokens.

The prompt holds the goal, the served experience (guided episodes), the last actions and the observation (a chat
model gets it as the user message of its chat template, after `ACTOR_SYSTEM`); the recorded `Turn.observation` is
the environment's text alone, so the extractor never sees the experience it is asked to judge. Each episode is a
generation session (`PolicyModel.generate(..., sessions=...)`): its next prompt repeats the system message, goal and
experience of its last, so a backend that keeps a session's keys and values prefills only what the turn adds; the
session ends with the episode. Timings per episode: its share of each batched generation, its own env time, and the
time it waited for retrieval before it could play (`retrieval_s`: from admission, or from its `ask`, to joining).

An engine that fails (`EngineCrashedError`: a text world's JVM died or threw) fails the episode whose reset or step
hit it (a dead JVM: every episode on it, each at its next step), never the worker: it finishes at once, unsuccessful,
with the reason in `TrajectoryCompleted.env_error` (the turn whose step failed is recorded, as invalid); the
environment opens a fresh engine at its next reset, and the worker plays on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline.actor.settings import RolloutSettings
from pipeline.envs.base import TextEnv
from pipeline.envs.registry import make_env
from pipeline.envs.settings import EnvSettings
from pipeline.errors import EngineCrashedError, InvalidStateError
from pipeline.models.base import PolicyModel, SamplingParams, stream_seed
from pipeline.runtime.transport import Position
from schemas.base import Producer
from schemas.tasks import EpisodeAssigned
from schemas.trajectories import ExperienceRef, Timings, TrajectoryCompleted, Turn

if TYPE_CHECKING:
    from pipeline.bank.retrieval import Query, Retrieval, Retriever

log = logging.getLogger(__name__)

ASK = "ask"
NO_ANSWER = "nothing relevant in the experience bank"
"""What an `ask` is shown when the bank found nothing, or did not answer within `retrieval_wait_s`."""
ACTOR_SYSTEM = ("You play a text game. Read the goal and the observation, then reply with exactly one of the listed "
                "actions on one line.")
"""The system message a chat model is prompted with (`PolicyModel.prompt_ids`); models without a chat template, the
tiny preset, get the user text alone."""


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
    pending: Future[Retrieval] | None = None
    """The retrieval this episode waits for (its experience, or the answer to its `ask`); None: ready to play."""
    pending_since: float = 0.0
    """`time.monotonic()` when that retrieval was queued: the wait bound counts from there."""
    admitted_call: int = 0
    """The player's generate-call count when the episode was admitted (its first turn is this call if it did not
    wait)."""
    retrieval_timed_out: bool = False
    """Its start retrieval did not come back within `retrieval_wait_s`: it was played without an experience."""
    score: float | None = None
    """The environment's own progress score after the last step, where it keeps one."""
    env_error: str | None = None
    """Why its engine failed it (`EngineCrashedError`): the episode ended there, as a failure."""


def episode_id(assignment: EpisodeAssigned) -> str:
    """The episode's identity within its run, `<group_id>-k<slot>`: its trajectory id. The scheduler derives the group
    id from the step and the group's index (`pipeline.actor.schedule`), so the id does not depend on the run id (a
    run directory's name carries its start time) nor on the assignment's event id (random outside the scheduler)."""
    return f"{assignment.group_id}-k{assignment.slot}"


def turn_seed(seed: int, episode: str, turn: int) -> int:
    """The row seed of turn `turn` (0 for the first generation, asks included) of the episode `episode` (its
    `episode_id`) in a run whose sampling seed is `seed` (`rollout.generation.seed`):
    `stream_seed("actor-turn", seed, episode, turn)`, 63 bits. A pure function of those three, so the episode
    samples the same tokens whatever shares its generate calls and whichever worker plays it."""
    return stream_seed("actor-turn", seed, episode, turn)


def actor_prompt(episode: Episode, history_turns: int, asks_left: int) -> str:
    """The actor's prompt for the next turn. The experience and answers sit in the prompt only: the recorded
    observation is the environment's text alone."""
    return render_actor_prompt(episode.assignment.env_id, episode.goal, episode.observation,
                               experience=episode.experience, answer=episode.answer, history=episode.history,
                               history_turns=history_turns, asks_left=asks_left)


def render_actor_prompt(env_id: str, goal: str, observation: str, *, experience: str | None = None,
                        answer: str | None = None, history: list[str] | None = None, history_turns: int = 0,
                        asks_left: int = 0) -> str:
    """`actor_prompt` from its parts (the behaviour-cloning warm start builds the same prompts)."""
    lines = [f"Task: {env_id}. Goal: {goal}"]
    if experience:
        lines.append(f"Experience: {experience}")
    if answer:
        lines.append(f"Answer: {answer}")
    if history_turns and history:
        lines.append("Previous actions: " + ", ".join(history[-history_turns:]))
    lines.append("Observation:")
    lines.append(observation)
    if asks_left:
        lines.append(f"You may also write: {ASK} <question> ({asks_left} left)")
    lines.append("Action:")
    return "\n".join(lines)


class EnvPool:
    """Idle environments by (env id, turn limit, split), reused across episodes (building one costs ~50 ms)."""

    def __init__(self, settings: EnvSettings) -> None:
        self.settings = settings
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


@dataclass
class _Request:
    retriever: Retriever
    query: Query
    future: Future[Retrieval]


class BackgroundRetrieval:
    """Retrievals served on one background thread, in the order they were queued. Whatever is queued when the
    thread becomes free (for one retriever) is served as one `retrieve_many` batch: one encode of the distinct uncached
    texts and one index search, as a synchronous batch would be; each request's future gets its `Retrieval` or the
    batch's exception."""

    def __init__(self) -> None:
        self._queue: list[_Request] = []
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.batches = 0
        self.queries = 0
        self.busy_s = 0.0
        """Seconds spent in `retrieve_many` (off the playing thread)."""

    def submit(self, retriever: Retriever, queries: Sequence[Query]) -> list[Future[Retrieval]]:
        requests = [_Request(retriever, query, Future()) for query in queries]
        with self._condition:
            if self._closed:
                raise InvalidStateError("the episode player is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="episode-retrieval", daemon=True)
                self._thread.start()
            self._queue += requests
            self._condition.notify()
        return [request.future for request in requests]

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._closed:
                    self._condition.wait()
                if self._closed:
                    return
                retriever = self._queue[0].retriever
                batch = []
                while self._queue and self._queue[0].retriever is retriever:
                    batch.append(self._queue.pop(0))
            started = time.perf_counter()
            try:
                found = retriever.retrieve_many([request.query for request in batch])
            except BaseException as exc:  # noqa: BLE001 - each waiting episode raises it where it joins
                for request in batch:
                    request.future.set_exception(exc)
            else:
                for request, retrieval in zip(batch, found, strict=True):
                    request.future.set_result(retrieval)
            self.busy_s += time.perf_counter() - started
            self.batches += 1
            self.queries += len(batch)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the batch being served; requests not yet served are cancelled. Idempotent."""
        with self._condition:
            self._closed = True
            for request in self._queue:
                request.future.cancel()
            self._queue.clear()
            self._condition.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)


@dataclass
class RetrievalStats:
    """How retrieval affected the playing loop (totals since the player was built)."""

    blocked_s: float = 0.0
    """Seconds `play_turn` waited on retrieval because every episode in flight was waiting."""
    late_starts: int = 0
    """Episodes whose first turn came after the generate call they were admitted at."""
    calls_late: int = 0
    """Generate calls those episodes missed while waiting, summed."""
    timeouts: int = 0
    """Retrievals given up after `retrieval_wait_s` (starts and asks)."""


class EpisodePlayer:
    """Episodes in flight, played one batched turn at a time with `policy` (set `policy` and `version` first)."""

    def __init__(self, settings: RolloutSettings, envs: EnvSettings, *, run_id: str,
                 producer: Producer, retriever: Retriever | None = None, seed: int = 0,
                 deterministic: bool = False) -> None:
        """`seed` is the run's sampling seed (`rollout.generation.seed`): with each episode's id and turn it keys
        the episode's sampling streams (`turn_seed`). `deterministic` (`scheduler.deterministic`): each retrieval
        is served on the playing thread, alone and diversified by its slot (`Retriever.retrieve_slot`), and each
        episode generates alone, so not even the float rounding of a batched forward pass (its log-probs, which
        the trainer's importance ratios use) depends on what else is in flight."""
        self.settings = settings
        self.envs = EnvPool(envs)
        self.run_id = run_id
        self.producer = producer
        self.retriever = retriever
        generation = settings.generation
        self.sampling = SamplingParams(max_new_tokens=generation.max_new_tokens, temperature=generation.temperature,
                                       top_p=generation.top_p, top_k=generation.top_k, stop=("\n",))
        self.policy: PolicyModel | None = None
        self.version = -1
        self.active: list[Episode] = []
        self.seed = seed
        self.calls = 0
        self.background = BackgroundRetrieval()
        self.stats = RetrievalStats()
        self.deterministic = deterministic

    @property
    def waiting(self) -> list[Episode]:
        """Episodes in flight waiting for a retrieval."""
        return [e for e in self.active if e.pending is not None]

    def start(self, assignments: Sequence[tuple[EpisodeAssigned, Position, int]]) -> None:
        """Reset an environment per assignment; guided ones queue their retrieval (in the background) and join the
        batch when it is there. Returns without waiting for it. The guided environments are reset first, so their
        retrieval runs while the free ones are reset; the episodes join `active` in the order given."""
        if self.retriever is None and any(assignment.guided for assignment, _, _ in assignments):
            raise InvalidStateError("guided episodes need a retriever")
        started_episodes: dict[int, Episode] = {}
        for guided in (True, False):
            for index, (assignment, position, offset) in enumerate(assignments):
                if assignment.guided != guided:
                    continue
                env = self.envs.get(assignment)
                started = time.perf_counter()
                try:
                    goal, observation = env.reset(assignment.seed)
                except EngineCrashedError as exc:
                    # The episode fails here with the reason; the env opens a fresh engine at its next reset.
                    episode = Episode(assignment, position, offset, env, "", "", admitted_call=self.calls,
                                      done=True, env_error=str(exc))
                    self._crashed(episode, exc)
                else:
                    episode = Episode(assignment, position, offset, env, goal, observation, admitted_call=self.calls)
                episode.env_s += time.perf_counter() - started
                started_episodes[index] = episode
            playing = [e for e in started_episodes.values() if not e.done and e.assignment.guided]
            if guided and playing:
                self._request(playing, [e.observation for e in playing], start=True)
        self.active += [started_episodes[index] for index in range(len(assignments))]

    def take_failed(self) -> list[TrajectoryCompleted]:
        """The episodes whose engine failed at their reset (`start`), as finished trajectories; `play_turn` returns
        them too, so a caller that only plays turns misses none."""
        failed = [e for e in self.active if e.done]
        self.active = [e for e in self.active if not e.done]
        return [self._trajectory(e) for e in failed]

    @staticmethod
    def _crashed(episode: Episode, exc: EngineCrashedError) -> None:
        log.warning("%s seed %d: %s; the episode fails, the next one gets a fresh engine",
                    episode.assignment.env_id, episode.assignment.seed, exc)
        episode.done, episode.success, episode.env_error = True, False, str(exc)
        episode.outcome_reward = episode.env.failure_reward

    def _request(self, episodes: list[Episode], questions: list[str], *, start: bool) -> None:
        """Queue one retrieval per episode (`start`: its start query, keyed as `retrieval.key` says, from its first
        observation; else the question it asked, with its goal); they wait for it."""
        from pipeline.bank.retrieval import Query, query_text

        if self.retriever is None:
            raise InvalidStateError("guided episodes need a retriever")
        key = self.retriever.settings.key if start else "goal-and-first-observation"
        if self.deterministic:
            for episode, question in zip(episodes, questions, strict=True):
                future: Future[Retrieval] = Future()
                query = Query(query_text(episode.goal, question, key), episode.assignment.task_family,
                              episode.assignment.step)
                # a start retrieval is diversified by the slot (guided slots come first); an ask as if alone
                future.set_result(self.retriever.retrieve_slot(query, 0 if episode.turns else episode.assignment.slot))
                episode.pending, episode.pending_since = future, time.monotonic()
            return
        futures = self.background.submit(self.retriever, [
            Query(query_text(e.goal, q, key), e.assignment.task_family, e.assignment.step)
            for e, q in zip(episodes, questions, strict=True)])
        now = time.monotonic()
        for episode, future in zip(episodes, futures, strict=True):
            episode.pending, episode.pending_since = future, now

    def _take_in(self) -> None:
        """Serve the episodes whose retrieval came back; give up on those past `retrieval_wait_s`."""
        now = time.monotonic()
        for episode in self.waiting:
            assert episode.pending is not None
            waited = now - episode.pending_since
            if episode.pending.done():
                retrieval = episode.pending.result()  # a failed retrieval raises here, as it did synchronously
                episode.pending, episode.retrieval_s = None, episode.retrieval_s + waited
                self._serve(episode, retrieval)
            elif waited >= self.settings.retrieval_wait_s:
                # The late result is dropped when it comes (the retriever has counted it as served all the same).
                episode.pending, episode.retrieval_s = None, episode.retrieval_s + waited
                self.stats.timeouts += 1
                if episode.turns:
                    episode.answer = NO_ANSWER
                else:
                    episode.retrieval_timed_out = True

    @staticmethod
    def _serve(episode: Episode, retrieval: Retrieval) -> None:
        episode.bank_offset = retrieval.bank_offset
        text = retrieval.experiences[0].text if retrieval.experiences else None
        if episode.turns:
            episode.answer = text or NO_ANSWER
        else:
            episode.experience = text
        for experience in retrieval.experiences:
            if experience.ref() not in episode.retrieved:
                episode.retrieved.append(experience.ref())

    def _ready(self) -> list[Episode]:
        """The episodes that play this turn. When every episode in flight waits for a retrieval, wait (bounded by
        the first wait to run out) until one of them can play."""
        self._take_in()
        ready = [e for e in self.active if e.pending is None]
        while self.active and not ready:
            started = time.monotonic()
            deadline = min(e.pending_since for e in self.waiting) + self.settings.retrieval_wait_s
            wait([e.pending for e in self.waiting if e.pending is not None], timeout=max(0.0, deadline - started),
                 return_when=FIRST_COMPLETED)
            self.stats.blocked_s += time.monotonic() - started
            self._take_in()
            ready = [e for e in self.active if e.pending is None]
        return ready

    def asks_left(self, episode: Episode) -> int:
        if not (self.settings.search_and_ask and episode.assignment.guided):
            return 0
        return self.settings.max_ask_calls - episode.asks

    def play_to_end(self) -> list[TrajectoryCompleted]:
        """Play turns until no episode is in flight; returns the episodes in the order they finished."""
        finished: list[TrajectoryCompleted] = []
        while self.active:
            finished += self.play_turn()
        return finished

    def play_turn(self) -> list[TrajectoryCompleted]:
        """One batched generation over every episode in flight that is not waiting for a retrieval (waiting, bounded,
        only when all of them are); returns the episodes that finished."""
        if self.policy is None:
            raise InvalidStateError("no policy loaded")
        failed = self.take_failed()
        ready = self._ready()
        if not ready:
            return failed
        for episode in ready:
            if not episode.turns and self.calls > episode.admitted_call:
                self.stats.late_starts += 1
                self.stats.calls_late += self.calls - episode.admitted_call
        prompts = [self.policy.prompt_ids(actor_prompt(e, self.settings.history_turns, self.asks_left(e)), ACTOR_SYSTEM)
                   for e in ready]
        started = time.perf_counter()
        # Each episode is a session: its next prompt shares the system message, goal and experience with its last,
        # whose keys and values the policy kept (`PolicyModel.generate`), so only the rest is prefilled again.
        # Each row samples from its episode's own stream for this turn, whatever else is in the batch.
        seeds = [turn_seed(self.seed, episode_id(e.assignment), len(e.turns)) for e in ready]
        sessions = [e.assignment.event_id for e in ready]
        if self.deterministic:  # one row per call: no batch shape in its arithmetic
            generations = [self.policy.generate([prompt], self.sampling, seeds=[seed], sessions=[session])[0]
                           for prompt, seed, session in zip(prompts, seeds, sessions, strict=True)]
        else:
            generations = self.policy.generate(prompts, self.sampling, seeds=seeds, sessions=sessions)
        self.calls += 1
        share = (time.perf_counter() - started) / len(ready)
        questions: list[tuple[Episode, str]] = []
        for episode, generation in zip(ready, generations, strict=True):
            episode.generation_s += share
            shown = episode.observation
            response = generation.text
            first_line = next((line.strip() for line in response.splitlines() if line.strip()), "")
            if self.asks_left(episode) and first_line.lower().startswith(ASK + " ") and first_line[4:].strip():
                question = first_line[4:].strip()
                episode.asks += 1
                questions.append((episode, question))
                action, valid, reward = f"{ASK} {question}", True, 0.0
            else:
                started = time.perf_counter()
                try:
                    outcome = episode.env.step(response)
                except EngineCrashedError as exc:
                    episode.env_s += time.perf_counter() - started
                    # The turn was generated, so it is recorded; no action reached a working engine.
                    episode.actions += 1
                    episode.invalid += 1
                    self._crashed(episode, exc)
                    episode.turns.append(Turn(
                        observation=shown, prompt_token_ids=generation.prompt_token_ids,
                        response_token_ids=generation.token_ids, sampling_logprobs=generation.logprobs,
                        response_text=response, action="", valid=False, reward=0.0))
                    continue
                episode.env_s += time.perf_counter() - started
                episode.actions += 1
                episode.invalid += not outcome.info.valid
                action, valid, reward = outcome.info.action, outcome.info.valid, outcome.reward
                episode.observation = outcome.observation
                episode.score = outcome.info.score if outcome.info.score is not None else episode.score
                episode.history.append(action if valid else "(invalid)")
                if outcome.done:
                    episode.done, episode.success = True, outcome.info.success
                    episode.truncated, episode.outcome_reward = outcome.info.truncated, outcome.reward
            episode.turns.append(Turn(
                observation=shown, prompt_token_ids=generation.prompt_token_ids,
                response_token_ids=generation.token_ids, sampling_logprobs=generation.logprobs,
                response_text=response, action=action, valid=valid, reward=reward))
        if questions:
            self._request([e for e, _ in questions], [q for _, q in questions], start=False)
        finished = [e for e in self.active if e.done]
        self.active = [e for e in self.active if not e.done]
        self.policy.end_sessions(e.assignment.event_id for e in finished)
        return failed + [self._trajectory(e) for e in finished]

    def _trajectory(self, episode: Episode) -> TrajectoryCompleted:
        a = episode.assignment
        revealed = episode.env.revealed() if episode.env_error is None else ()
        self.envs.put(a, episode.env)
        return TrajectoryCompleted(
            run_id=self.run_id, producer=self.producer, trajectory_id=episode_id(a),
            assignment_event_id=str(a.event_id), step=a.step, split=a.split, env_id=a.env_id,
            task_family=a.task_family, seed=a.seed, group_id=a.group_id, slot=a.slot, guided=a.guided,
            goal=episode.goal, turns=tuple(episode.turns), reward=episode.outcome_reward, success=episode.success,
            num_actions=episode.actions, invalid_actions=episode.invalid, truncated=episode.truncated,
            final_observation=episode.observation, revealed=revealed,
            retrieved=tuple(episode.retrieved) if a.guided else (),
            bank_offset=episode.bank_offset if a.guided else None, policy_version=self.version,
            timings=Timings(generation_s=episode.generation_s, env_s=episode.env_s,
                            retrieval_s=episode.retrieval_s),
            score=episode.score, env_error=episode.env_error,
        )

    def close(self) -> None:
        """Stop the retrieval thread and close every environment, idle or in flight (the last one to close stops its
        engine's JVM)."""
        self.background.close()
        for episode in self.active:
            episode.env.close()
        self.envs.close()
