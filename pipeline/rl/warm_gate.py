"""Does a warm start hold what it is for? Its gate (`warm_start.gate`), checked on held-out data after every warm
start, computed or loaded from the cache:

    checks = extractor_gate(policy, warm, settings.envs.tasks, settings.envs, settings.extractor)
    checks = actor_gate(policy, warm, settings.envs.tasks, settings.envs, settings.rollout)
    print(gate_line("extractor", checks))   # "extractor warm start: gate passed: states_revealed 0.97 >= 0.90 ..."

The held-out data are data episodes of the config's tasks on the **eval split** (`play_data_episodes(split="eval")`),
tasks no warm start trains on (on the dark corridors, corridors of other names), drawn from `warm.seed +
HELD_OUT_SEED` with `warm.plays_per_task` plays per task.

- **Extractor** (`min_parse_ok`, `min_states_revealed`): it distils every held-out episode as the extractor worker
  would, half of them shown the lesson of another play of the same task (as in its warm start and in a run), and is
  held to the share of answers that parse, and the share of its lessons of episodes that revealed something (where
  the goal lies) that state it word for word (`distil_held_out`).
- **Actor** (`min_success_right`, `max_success_wrong`): on the tasks of the held-out episodes the solver played to
  a revealing end, it plays one episode guided by a right lesson (the rule-based lesson of that play) and one
  guided by a wrong one (the same lesson with its directions turned around, `reversed_directions`), with the rollout
  worker's own player and sampling (`play_with_lessons`). An actor that follows lessons succeeds with the first
  and fails with the second.

Sampling is seeded (each episode's stream is keyed by its id, as in a run), so the same weights give the same
checks. A missed gate does not stop a run: the trainer logs it as an error and publishes it on its
`WarmStartProgressed` (the live view and the report show it), and `benchmarks/learning.py` refuses to score the run.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.actor.episodes import EpisodePlayer
from pipeline.actor.settings import RolloutSettings
from pipeline.bank.retrieval import Query, Retrieval, RetrievedExperience, query_text
from pipeline.bank.settings import RetrievalSettings
from pipeline.envs.base import reversed_directions
from pipeline.envs.registry import env_spec
from pipeline.envs.settings import EnvSettings, TaskMix
from pipeline.errors import ConfigError, ParseError
from pipeline.extractor.protocol import (
    ANSWER_STOP,
    EXTRACTOR_SYSTEM,
    TrajectoryDigest,
    distill_prompt,
    parse_distill,
)
from pipeline.extractor.settings import ExtractorSettings
from pipeline.models.base import PolicyModel, SamplingParams
from pipeline.rl.settings import WarmStartGate, WarmStartSettings
from pipeline.rl.warm_data import DataEpisode, data_envs, lesson, play_data_episodes
from schemas.base import Producer
from schemas.tasks import EpisodeAssigned
from schemas.training import WarmStartGateCheck

HELD_OUT_SEED = 1_000
"""Added to the warm start's seed for the held-out episodes' draws."""
GATE_RUN_ID = "warm-start-gate"
"""The run id of the gate's episodes (it keys their sampling streams)."""


def held_out_episodes(tasks: Sequence[TaskMix], envs: EnvSettings, warm: WarmStartSettings, episodes: int,
                      expert_fraction: float | None = None) -> list[DataEpisode]:
    """`episodes` data episodes of `tasks` on the eval split, drawn as the warm start draws its own (`expert_fraction`:
    the warm start's unless given)."""
    return play_data_episodes(tasks, envs, episodes, warm.expert_fraction if expert_fraction is None else
                              expert_fraction, warm.seed + HELD_OUT_SEED, warm.plays_per_task, split="eval")


# -- the extractor ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Distilled:
    """One held-out episode as the extractor distilled it."""

    digest: TrajectoryDigest
    shown: tuple[str, ...]
    """The lessons it was shown (aliases 1..n)."""
    text: str
    """The answer as generated."""
    parsed: bool
    lessons: tuple[str, ...]
    """The texts of the adds and refines the answer holds (none when it did not parse)."""

    @property
    def fact(self) -> str:
        """What the episode revealed, as its lessons should state it ("" when it revealed nothing)."""
        return "; ".join(self.digest.revealed)

    @property
    def facts(self) -> tuple[str, ...]:
        """The statements a lesson of this episode may make: what it revealed; in a family with a rule across tasks,
        that as a lesson of each kind (the rule, the one task's fact, the over-general side), each true of this
        episode. () when it revealed nothing."""
        rule = env_spec(self.digest.env_id).task_rule
        if rule is None or not self.digest.revealed:
            return (self.fact,) if self.fact else ()
        stated = (rule().statement(self.digest.revealed, kind) for kind in rule().kinds)
        return tuple(statement for statement in stated if statement)

    @property
    def states_fact(self) -> bool | None:
        """Whether a lesson of the answer makes one of `facts` word for word (False when the answer holds no
        lesson: it kept nothing, or did not parse); None when the episode revealed nothing."""
        if not self.facts:
            return None
        return any(fact in text for fact in self.facts for text in self.lessons)


def distil_held_out(policy: PolicyModel, episodes: Sequence[DataEpisode], extractor: ExtractorSettings,
                    seed: int = 0) -> list[Distilled]:
    """Distil every episode in one batched generation, half of them (drawn with `seed`) shown the rule-based lesson of
    another play of the same task where there is one, as the extractor worker prompts and parses; each answer samples
    from its own stream (`seed` + its index)."""
    rng = random.Random(seed)
    plays: dict[tuple[str, str], list[int]] = {}
    for index, episode in enumerate(episodes):
        plays.setdefault((episode.digest.env_id, episode.digest.goal), []).append(index)
    shown_all: list[tuple[str, ...]] = []
    prompts = []
    for index, episode in enumerate(episodes):
        others = [i for i in plays[(episode.digest.env_id, episode.digest.goal)] if i != index]
        shown: tuple[str, ...] = (lesson(episodes[rng.choice(others)].digest, extractor.max_experience_chars),) \
            if others and rng.random() < 0.5 else ()
        shown_all.append(shown)
        prompts.append(policy.prompt_ids(distill_prompt(episode.digest, shown, max_ops=extractor.max_ops,
                                                        max_actions=extractor.max_actions_shown), EXTRACTOR_SYSTEM))
    generation = extractor.generation
    generations = policy.generate(prompts, SamplingParams(
        max_new_tokens=generation.max_new_tokens, temperature=generation.temperature, top_p=generation.top_p,
        top_k=generation.top_k, stop=(ANSWER_STOP,)), seeds=[seed + i for i in range(len(prompts))])
    distilled = []
    for episode, shown, answer in zip(episodes, shown_all, generations, strict=True):
        try:
            ops = parse_distill(answer.text, len(shown), max_ops=extractor.max_ops,
                                max_chars=extractor.max_experience_chars)
        except ParseError:
            distilled.append(Distilled(episode.digest, shown, answer.text, False, ()))
            continue
        distilled.append(Distilled(episode.digest, shown, answer.text, True, tuple(op.text for op in ops)))
    return distilled


def extractor_gate(policy: PolicyModel, warm: WarmStartSettings, tasks: Sequence[TaskMix], envs: EnvSettings,
                   extractor: ExtractorSettings) -> tuple[WarmStartGateCheck, ...]:
    """The extractor's gate (`warm.gate`: `min_parse_ok`, `min_states_revealed`) on held-out episodes."""
    gate = _gate(warm)
    distilled = distil_held_out(policy, held_out_episodes(tasks, envs, warm, gate.episodes), extractor)
    stating = [d.states_fact for d in distilled if d.states_fact is not None]
    measured = {"min_parse_ok": (sum(d.parsed for d in distilled), len(distilled)),
                "min_states_revealed": (sum(stating), len(stating))}
    return _checks(gate, "extractor", measured)


# -- the actor --------------------------------------------------------------------------------------------------------


class FixedLessons:
    """A retriever that serves each task the lesson written for it (the player's `retrieve_many` interface), keyed
    by the task's retrieval query (`query_text`, the default key)."""

    settings = RetrievalSettings()

    def __init__(self, lessons: Mapping[str, str]) -> None:
        self.lessons = lessons

    def retrieve_many(self, queries: Sequence[Query]) -> list[Retrieval]:
        return [Retrieval((RetrievedExperience("fixed-lesson", 1, "none", self.lessons[query.text], 1.0),), 0)
                for query in queries]


@dataclass(frozen=True)
class Task:
    """One task to play: environment, seed, turn limit, and the lesson its guided episode is served (None: free)."""

    env_id: str
    seed: int
    max_turns: int
    lesson: str | None = None


def play_with_lessons(policy: PolicyModel, tasks: Sequence[Task], rollout: RolloutSettings, envs: EnvSettings,
                      split: str = "eval") -> list[bool]:
    """Play each task once with the rollout worker's player and sampling, guided by its lesson where it has one;
    returns each episode's success, in order."""
    player = EpisodePlayer(rollout, data_envs(envs), run_id=GATE_RUN_ID,
                           producer=Producer(worker="warm-start-gate", instance="gate-0"), seed=rollout.generation.seed)
    player.policy, player.version = policy, 0
    lessons: dict[str, str] = {}
    for task in tasks:
        if task.lesson is not None:
            assignment = _assignment(task, 0, split)
            env = player.envs.get(assignment)
            lessons[query_text(*env.reset(task.seed))] = task.lesson
            player.envs.put(assignment, env)
    player.retriever = FixedLessons(lessons)  # type: ignore[assignment]  # the player's retrieve_many interface
    assignments = [(_assignment(task, index, split), ("warm-start-gate", 0), index) for index, task in enumerate(tasks)]
    success: dict[str, bool] = {}
    try:
        for start in range(0, len(assignments), rollout.max_concurrent_episodes):
            player.start(assignments[start:start + rollout.max_concurrent_episodes])
            success.update((t.group_id, t.success) for t in player.play_to_end())
    finally:
        player.close()
    return [success[assignment.group_id] for assignment, _, _ in assignments]


def _assignment(task: Task, index: int, split: str) -> EpisodeAssigned:
    return EpisodeAssigned(run_id=GATE_RUN_ID, producer=Producer(worker="warm-start-gate", instance="gate-0"), step=0,
                           split=split, env_id=task.env_id, task_family=env_spec(task.env_id).task_family,
                           seed=task.seed, group_id=f"gate-{index:05d}", slot=0, group_size=1,
                           guided=task.lesson is not None, policy_version=0, max_turns=task.max_turns)


def lesson_tasks(episodes: Sequence[DataEpisode], max_turns: Mapping[str, int],
                 max_chars: int) -> tuple[list[Task], list[Task]]:
    """(right, wrong): for each task of `episodes` with a play that revealed something, the task guided by that
    play's rule-based lesson, and, where its facts name directions, guided by the lesson with them turned around
    (`max_turns`: each environment's turn limit). In a family with a rule across tasks the lessons state the rule
    (`lesson`'s default), and the turned one names the furnishing on the other side (`TaskRule.turned_around`)."""
    right, wrong, seen = [], [], set()
    for episode in episodes:
        digest = episode.digest
        if (digest.env_id, episode.task_seed) in seen or not digest.revealed:
            continue
        seen.add((digest.env_id, episode.task_seed))
        limit = max_turns[digest.env_id]
        right.append(Task(digest.env_id, episode.task_seed, limit, lesson(digest, max_chars)))
        rule = env_spec(digest.env_id).task_rule
        turned = rule().turned_around(digest.revealed, digest.first_observation) if rule is not None else \
            tuple(reversed_directions(fact) for fact in digest.revealed)
        if turned != digest.revealed:
            wrong.append(Task(digest.env_id, episode.task_seed, limit,
                              lesson(dataclasses.replace(digest, revealed=turned), max_chars)))
    return right, wrong


def actor_gate(policy: PolicyModel, warm: WarmStartSettings, tasks: Sequence[TaskMix], envs: EnvSettings,
               rollout: RolloutSettings, max_chars: int = 400) -> tuple[WarmStartGateCheck, ...]:
    """The actor's gate (`warm.gate`: `min_success_right`, `max_success_wrong`) on held-out tasks."""
    gate = _gate(warm)
    limits = {t.env_id: t.max_turns or env_spec(t.env_id).max_turns for t in tasks}
    right, wrong = lesson_tasks(held_out_episodes(tasks, envs, warm, gate.episodes, expert_fraction=1.0), limits,
                                max_chars)
    bounds = gate.bounds("actor")
    if "min_success_right" in bounds and not right:
        raise ConfigError(f"warm_start.gate.min_success_right needs tasks whose plays reveal where the goal lies; "
                          f"no held-out play of {sorted(limits)} revealed anything")
    if "max_success_wrong" in bounds and not wrong:
        raise ConfigError(f"warm_start.gate.max_success_wrong needs revealed facts with directions to turn around; "
                          f"the held-out plays of {sorted(limits)} revealed none")
    measured = {}
    if "min_success_right" in bounds:
        outcomes = play_with_lessons(policy, right, rollout, envs)
        measured["min_success_right"] = (sum(outcomes), len(outcomes))
    if "max_success_wrong" in bounds:
        outcomes = play_with_lessons(policy, wrong, rollout, envs)
        measured["max_success_wrong"] = (sum(outcomes), len(outcomes))
    return _checks(gate, "actor", measured)


# -- the verdict ------------------------------------------------------------------------------------------------------


def _gate(warm: WarmStartSettings) -> WarmStartGate:
    if warm.gate is None:
        raise ConfigError("this warm start sets no gate (warm_start.gate)")
    return warm.gate


def _checks(gate: WarmStartGate, role: str, measured: Mapping[str, tuple[int, int]]) -> tuple[WarmStartGateCheck, ...]:
    checks = []
    for name, bound in gate.bounds(role).items():
        hits, samples = measured[name]
        value = hits / samples if samples else 0.0
        passed = samples > 0 and (value >= bound if name.startswith("min_") else value <= bound)
        checks.append(WarmStartGateCheck(name=name, value=value, bound=bound, samples=samples, passed=passed))
    return tuple(checks)


def gate_passed(checks: Sequence[WarmStartGateCheck]) -> bool:
    return all(check.passed for check in checks)


def gate_line(role: str, checks: Sequence[WarmStartGateCheck]) -> str:
    """The gate in one line: "extractor warm start gate passed: states_revealed 0.97 >= 0.90 (58), ..." or
    "... gate MISSED: ..." (a check on no samples fails: it showed nothing)."""
    verdict = "passed" if gate_passed(checks) else "MISSED"
    return f"{role} warm start gate {verdict}: " + ", ".join(describe(check) for check in checks)


def describe(check: WarmStartGateCheck) -> str:
    """"states_revealed 0.97 >= 0.90 (58)", with "MISSED" after a check that failed."""
    relation = ">=" if check.name.startswith("min_") else "<="
    return (f"{check.name[4:]} {check.value:.2f} {relation} {check.bound:.2f} ({check.samples})"
            + ("" if check.passed else " MISSED"))
