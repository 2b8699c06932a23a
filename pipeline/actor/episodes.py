"""Playing episodes in batches: the rollout worker's engine, without Kafka (the benchmark and tests use it directly).

    player = EpisodePlayer(settings.rollout, settings.envs, run_id="r", producer=producer,
                           retriever=retriever)            # retriever: None when no slot is guided
    player.policy, player.version = policy, 0
    player.start([(assignment, ("crl.tasks", 0), offset), ...])   # reset envs; one batched retrieval for the guided
    while player.active:
        finished = player.play_turn()                        # one batched generation over every episode in flight

The prompt holds the goal, the served experience (guided episodes), the last actions and the observation (a chat
model gets it as the user message of its chat template, after `ACTOR_SYSTEM`); the recorded `Turn.observation` is
the environment's text alone, so the extractor never sees the experience it is
asked to judge. Timings per episode: its share of each batched generation and retrieval, and its own env time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline.actor.settings import RolloutSettings
from pipeline.envs.base import TextEnv
from pipeline.envs.registry import make_env
from pipeline.envs.settings import EnvSettings
from pipeline.errors import InvalidStateError
from pipeline.models.base import PolicyModel, SamplingParams
from pipeline.runtime.transport import Position
from schemas.base import Producer
from schemas.tasks import EpisodeAssigned
from schemas.trajectories import ExperienceRef, Timings, TrajectoryCompleted, Turn

if TYPE_CHECKING:
    from pipeline.bank.retrieval import Retriever

ASK = "ask"
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


class EpisodePlayer:
    """Episodes in flight, played one batched turn at a time with `policy` (set `policy` and `version` first)."""

    def __init__(self, settings: RolloutSettings, envs: EnvSettings, *, run_id: str,
                 producer: Producer, retriever: Retriever | None = None, seed: int = 0) -> None:
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

    def start(self, assignments: Sequence[tuple[EpisodeAssigned, Position, int]]) -> None:
        """Reset an environment per assignment; guided ones get their experience in one batched retrieval."""
        started_episodes = []
        for assignment, position, offset in assignments:
            env = self.envs.get(assignment)
            started = time.perf_counter()
            goal, observation = env.reset(assignment.seed)
            episode = Episode(assignment, position, offset, env, goal, observation)
            episode.env_s += time.perf_counter() - started
            started_episodes.append(episode)
        guided = [e for e in started_episodes if e.assignment.guided]
        if guided:
            self._retrieve(guided, [e.observation for e in guided])
        self.active += started_episodes

    def _retrieve(self, episodes: list[Episode], questions: list[str]) -> None:
        from pipeline.bank.retrieval import Query, query_text

        if self.retriever is None:
            raise InvalidStateError("guided episodes need a retriever")
        started = time.perf_counter()
        found = self.retriever.retrieve_many([Query(query_text(e.goal, q), e.assignment.task_family, e.assignment.step)
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

    def asks_left(self, episode: Episode) -> int:
        if not (self.settings.search_and_ask and episode.assignment.guided):
            return 0
        return self.settings.max_ask_calls - episode.asks

    def play_turn(self) -> list[TrajectoryCompleted]:
        """One batched generation over every episode in flight; returns the episodes that finished."""
        if self.policy is None:
            raise InvalidStateError("no policy loaded")
        prompts = [self.policy.prompt_ids(actor_prompt(e, self.settings.history_turns, self.asks_left(e)), ACTOR_SYSTEM)
                   for e in self.active]
        started = time.perf_counter()
        generations = self.policy.generate(prompts, self.sampling, seed=(self.seed + self.calls) % 2**31)
        self.calls += 1
        share = (time.perf_counter() - started) / len(self.active)
        questions: list[tuple[Episode, str]] = []
        for episode, generation in zip(self.active, generations, strict=True):
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
        revealed = episode.env.revealed()
        self.envs.put(a, episode.env)
        return TrajectoryCompleted(
            run_id=self.run_id, producer=self.producer, trajectory_id=f"{a.group_id}-k{a.slot}",
            assignment_event_id=str(a.event_id), step=a.step, split=a.split, env_id=a.env_id,
            task_family=a.task_family, seed=a.seed, group_id=a.group_id, slot=a.slot, guided=a.guided,
            goal=episode.goal, turns=tuple(episode.turns), reward=episode.outcome_reward, success=episode.success,
            num_actions=episode.actions, invalid_actions=episode.invalid, truncated=episode.truncated,
            final_observation=episode.observation, revealed=revealed,
            retrieved=tuple(episode.retrieved) if a.guided else (),
            bank_offset=episode.bank_offset if a.guided else None, policy_version=self.version,
            timings=Timings(generation_s=episode.generation_s, env_s=episode.env_s,
                            retrieval_s=episode.retrieval_s),
        )

    def close(self) -> None:
        self.envs.close()
