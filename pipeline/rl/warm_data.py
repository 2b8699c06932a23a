"""What the warm starts learn from: data episodes played by scripted solvers, the rule-based summariser that writes
their lessons, and the supervised samples both trainers fine-tune on (`pipeline.rl.warm_start`); the warm starts'
gates check the policies on held-out data episodes of the same kind (`pipeline.rl.warm_gate`).

    episodes = play_data_episodes(settings.envs.tasks, settings.envs, 768, 0.5, seed=0, plays_per_task=4)
    samples = extractor_samples(episodes, settings.extractor, seed=0)    # (prompt, rule-based answer) pairs

- **Data episodes** are played by the scripted solver (`TextEnv.expert_action`), by a solver that knows only what
  the episode has shown (`TextEnv.uninformed_actions`) or at random, so the states are varied; every turn is labelled
  with both solvers' actions.
- **The rule-based summariser** writes an episode's lesson: outcome, length, and what the episode revealed (such as
  where the goal lies relative to the start); the first and most repeated action where it revealed nothing.
- **Actor samples** are the rollout worker's own prompts, a third with an informative lesson (labelled with the
  solver's action), a third with an irrelevant one and a third with none (labelled with the uninformed solver's).
- **Extractor samples** are distillation prompts answered in exactly the format the worker parses, and merge chunks.
  `omit_facts` writes that share of the lessons of revealing episodes without what they revealed: a deliberately
  imperfect extractor, for experiments on what its outcome reward can correct.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.envs.base import TaskRule, TextEnv
from pipeline.envs.registry import env_spec, make_env, task_pool
from pipeline.envs.settings import EnvSettings, SignpostSettings, TaskMix
from pipeline.extractor.protocol import INVALID, TrajectoryDigest, distill_prompt, merge_prompt, render_answer
from pipeline.extractor.settings import ExtractorSettings
from pipeline.rl.warm_progress import Progress, no_progress
from schemas.base import Split

INVALID_RESPONSE = "wait"
"""What a random data episode sometimes answers: no environment accepts it, so invalid turns occur."""


# -- the rule-based summariser --------------------------------------------------------------------------------------


def lesson(digest: TrajectoryDigest, max_chars: int, *, state_facts: bool = True, kind: str | None = None) -> str:
    """One lesson from one episode: outcome, length, and what it revealed (where the goal lies relative to the
    start); where it revealed nothing, the first or the most repeated action. `state_facts` False: the outcome
    sentence alone where the episode revealed something (the lesson of a summariser that leaves it out). `kind`, in
    a family with a rule across tasks (`EnvSpec.task_rule`): what it revealed as a lesson of that kind ('rule',
    'instance' or 'over-general'); None: the rule."""
    valid = [a for a in digest.actions if a != INVALID]
    rule = env_spec(digest.env_id).task_rule
    stated = rule().statement(digest.revealed, kind or "rule") if rule is not None else None
    facts = stated or "; ".join(digest.revealed)
    if digest.success:
        outcome = f"Solved in {len(digest.actions)} actions."
        advice = f"{facts}." if facts else f"Start with {valid[0] if valid else 'a listed action'} and keep " \
            "heading for the goal."
    else:
        repeated = Counter(valid).most_common(1)[0][0] if valid else "invalid actions"
        outcome = f"Failed after {len(digest.actions)} actions ({digest.invalid} invalid)."
        advice = f"{facts}." if facts else f"Do not repeat {repeated}; use listed actions and head for the goal."
    text = outcome if facts and not state_facts else f"{outcome} {advice}"
    return text[:max_chars]


def summarise(digest: TrajectoryDigest, shown: Sequence[str], max_chars: int, *, state_facts: bool = True,
              kind: str | None = None) -> str:
    """The answer the rule-based summariser writes: refine the first experience shown with this episode's lesson,
    or add it when none was shown; an episode that revealed nothing leaves a shown experience as it is (`[]`), so a
    lesson that states where the goal is is not overwritten by one that cannot (`state_facts`, `kind`: as in
    `lesson`)."""
    if shown and not digest.revealed:
        return render_answer([])
    text = lesson(digest, max_chars, state_facts=state_facts, kind=kind)
    return render_answer([{"op": "refine", "id": 1, "text": text}] if shown else [{"op": "add", "text": text}])


def summarise_merge(entries: Sequence[str], max_chars: int) -> str:
    """Merge the lessons that give the same advice (the text after their first sentence, which states the outcome:
    "staircase down: 4 east of the start."), into one lesson of that advice; keep the rest. Lessons that differ in
    what they advise are never merged, so no merged lesson contradicts one of its sources."""
    groups: dict[str, list[int]] = {}
    for alias, text in enumerate(entries, start=1):
        groups.setdefault(_advice(text).lower(), []).append(alias)
    ops = []
    for aliases in groups.values():
        if len(aliases) >= 2:
            text = f"{len(aliases)} lessons agree: {_advice(entries[aliases[0] - 1])}"
            ops.append({"op": "merge", "ids": aliases, "text": text[:max_chars]})
    return render_answer(ops)


def _advice(text: str) -> str:
    """A lesson without its first sentence (the outcome), or the whole text when it has one sentence."""
    outcome, _, advice = text.partition(". ")
    return advice or outcome


# -- data episodes --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataTurn:
    observation: str
    history: tuple[str, ...]
    label: str | None
    """The scripted solver's action in this state (None: the environment has no solver)."""
    uninformed: tuple[str, ...] = ()
    """What the solver would do knowing only what the episode has shown (`TextEnv.uninformed_actions`)."""
    available: tuple[str, ...] = ()
    """The actions the environment offered in this state."""


@dataclass(frozen=True)
class DataEpisode:
    digest: TrajectoryDigest
    turns: tuple[DataTurn, ...]
    task_seed: int = 0
    """The task's seed (`TextEnv.reset`), so the task can be played again."""


def _tasks(tasks: Sequence[TaskMix]) -> list[tuple[str, int]]:
    return [(t.env_id, t.max_turns or env_spec(t.env_id).max_turns) for t in tasks]


def data_envs(envs: EnvSettings) -> EnvSettings:
    """The env settings data episodes are played with, and their tasks replayed by the gates: the run's, with a
    signpost per corridor in signpost corridors and none flipped."""
    return envs.model_copy(update={"signpost": SignpostSettings(landmark="per-task")})


def play_data_episodes(tasks: Sequence[TaskMix], envs: EnvSettings, episodes: int, expert_fraction: float,
                       seed: int, plays_per_task: int = 1, progress: Progress = no_progress,
                       split: Split = "train") -> list[DataEpisode]:
    """`episodes` episodes on `split`-pool seeds (train: what warm starts learn from; eval: tasks they never saw,
    what their gates check them on), round robin over `tasks`: the solver plays `expert_fraction` of them (where the
    environment has one), the solver that knows only what the episode has shown half of the rest, and random actions
    the others; every turn is labelled with both solvers' actions. With `plays_per_task` > 1 the seeds come from a
    pool of `episodes / plays_per_task` tasks, so a task is played several times and one play's lesson can inform
    another's (what memory tasks need). Signpost corridors are played with a signpost per corridor and none
    flipped, so the warm starts learn to read and copy any furnishing, lean toward no run's, and runs of every seed
    share them (`data_envs`)."""
    envs = data_envs(envs)
    progress("data", 0, episodes)
    rng = random.Random(seed)
    pool_size = 1000 if plays_per_task == 1 else max(1, episodes // plays_per_task)
    built: dict[tuple[str, int], TextEnv] = {}
    played: list[DataEpisode] = []
    try:
        for index in range(episodes):
            env_id, max_turns = _tasks(tasks)[index % len(tasks)]
            env = built.get((env_id, max_turns))
            if env is None:
                env = built[(env_id, max_turns)] = make_env(env_id, envs, max_turns=max_turns, split=split)
            task_seed = rng.choice(task_pool(env_id, split, pool_size, seed))
            goal, observation = env.reset(task_seed)
            first = observation
            draw = rng.random()
            player = "expert" if draw < expert_fraction else \
                "uninformed" if draw < expert_fraction + (1 - expert_fraction) / 2 else "random"
            actions: list[str] = []
            turns: list[DataTurn] = []
            success, truncated = False, False
            while True:
                label, uninformed = env.expert_action(), env.uninformed_actions()
                turns.append(DataTurn(observation, tuple(actions), label, uninformed, env.available_actions()))
                if player == "expert" and label is not None:
                    response = label
                elif player == "uninformed" and uninformed:
                    response = rng.choice(uninformed)
                elif rng.random() < 0.1:
                    response = INVALID_RESPONSE
                else:
                    response = rng.choice(env.available_actions())
                outcome = env.step(response)
                actions.append(outcome.info.action if outcome.info.valid else INVALID)
                observation = outcome.observation
                if outcome.done:
                    success, truncated = outcome.info.success, outcome.info.truncated
                    break
            digest = TrajectoryDigest(env_id=env_id, task_family=env_spec(env_id).task_family, goal=goal,
                                      first_observation=first, actions=tuple(actions), success=success,
                                      truncated=truncated, revealed=env.revealed())
            played.append(DataEpisode(digest, tuple(turns), task_seed))
            progress("data", len(played), episodes)
    finally:
        for env in built.values():
            env.close()
    return played



# -- samples -----------------------------------------------------------------------------------------------------------


def actor_samples(episodes: Sequence[DataEpisode], history_turns: int, seed: int, max_chars: int = 400,
                  label_noise: float = 0.0) -> list[tuple[str, str]]:
    """(actor prompt, " <action>\\n") for every labelled turn, a third of the prompts with an informative experience,
    a third with an irrelevant one, a third with none:

    - informative: the lesson of a play of the same task (the same environment, goal and start) that states what
      the task revealed, such as where the goal lies; labelled with the solver's action, which it agrees with;
    - irrelevant: a lesson that states nothing revealed (another task's where there is none); labelled, like the
      prompts with no experience, with the action of the solver that knows only what the episode has shown
      (`DataTurn.uninformed`: one of its equally good guesses at random).

    So the actor learns to follow an experience that says where the goal is and to guess on its own where none
    does. Lessons of another task that state where its goal was are never shown: on a memory task they would
    contradict the label half the time and teach the actor to distrust every lesson (retrieval's similarity floor
    keeps them from guided episodes too). In a family with a rule across tasks (`EnvSpec.task_rule`) the
    informative third is instead a lesson of any kind ('rule', 'instance', 'over-general') pointing either way, its
    side drawn at random and labelled with the action it says to take (`TaskRule.action_for`: that side, or for a
    rule the action naming its landmark): the actor learns to do what a lesson says, so what a lesson is worth on
    an unseen task is whether it holds there. With
    `label_noise`, that share of the labels is an available action drawn at random instead: the actor imitates a
    noisy solver and starts competent but imperfect however long it trains, which leaves RL room."""
    from pipeline.actor.episodes import render_actor_prompt

    rng = random.Random(seed)
    lessons = [lesson(e.digest, max_chars) for e in episodes]
    informative: dict[tuple[str, str, str], list[str]] = {}
    for episode, text in zip(episodes, lessons, strict=True):
        if episode.digest.revealed:
            informative.setdefault(_task_of(episode.digest), []).append(text)
    silent = [text for text, e in zip(lessons, episodes, strict=True) if not e.digest.revealed]
    samples = []
    for episode in episodes:
        rule = env_spec(episode.digest.env_id).task_rule
        task = _task_of(episode.digest)
        same = informative.get(task, [])
        irrelevant = silent or [text for text, e in zip(lessons, episodes, strict=True) if _task_of(e.digest) != task]
        for turn in episode.turns:
            if turn.label is None:
                continue
            draw = rng.random()
            experience: str | None
            if rule is not None and draw < 1 / 3:
                experience, label = _pointing_lesson(rule(), episode.digest, rng, max_chars)
            else:
                experience = (rng.choice(same) if draw < 1 / 3 and same else
                              rng.choice(irrelevant) if 1 / 3 <= draw < 2 / 3 and irrelevant else None)
                label = turn.label if experience is not None and draw < 1 / 3 else \
                    rng.choice(turn.uninformed) if turn.uninformed else turn.label
            if label_noise and turn.available and rng.random() < label_noise:
                label = rng.choice(turn.available)
            prompt = render_actor_prompt(episode.digest.env_id, episode.digest.goal, turn.observation,
                                         experience=experience, history=list(turn.history),
                                         history_turns=history_turns)
            samples.append((prompt, f" {label}\n"))
    return samples


def _pointing_lesson(rule: TaskRule, digest: TrajectoryDigest, rng: random.Random,
                     max_chars: int) -> tuple[str, str]:
    """(lesson, the action it says to take): a lesson of a kind drawn at random about a goal lying on a side drawn at
    random, written as the summariser would after a successful play of this task."""
    side, distance, kind = rng.choice(rule.sides), rng.choice(rule.distances), rng.choice(rule.kinds)
    revealed = rule.revealed_for(digest.first_observation, side, distance)
    pointing = dataclasses.replace(digest, revealed=revealed, success=True, actions=(side,) * distance)
    return lesson(pointing, max_chars, kind=kind), rule.action_for(revealed, kind)


def _task_of(digest: TrajectoryDigest) -> tuple[str, str, str]:
    """What identifies a task to the agent: environment, goal and the first observation."""
    return digest.env_id, digest.goal, digest.first_observation


def extractor_samples(episodes: Sequence[DataEpisode], settings: ExtractorSettings, seed: int,
                      omit_facts: float = 0.0, merges: bool = True, rule_share: float = 1.0) -> list[tuple[str, str]]:
    """(extractor prompt, rule-based answer): one distillation per episode, and, where the run merges (`merges`),
    one merge chunk per four episodes. Half the distillations are shown a lesson, as a guided episode is: the lesson
    of another play of the same task where there is one (retrieval serves a task its own lessons), else any
    episode's. `omit_facts`: that share of the answers for episodes that revealed something leave it out (drawn from
    a stream of its own, so the prompts and every other answer are those of `omit_facts` 0); the lessons shown are
    always the summariser's full ones. `rule_share`, in a family with a rule across tasks: that share of the
    revealing episodes' lessons state the rule, the rest the one task's fact or an over-general rule, half each
    (drawn from a stream of its own; the lessons shown are the ones so drawn, as the extractor would have written
    them).

    Merge chunks are left out of a run that never merges: they teach copying from the right one of several lessons,
    and beside the distillations, whose copying is the one skill a run without merges needs, they delay it (on the
    dark corridors, from about 250 steps to well past 1,200 on some seeds; docs/benchmarks.md)."""
    rng = random.Random(seed)
    omit = random.Random(f"{seed}/omit-facts")
    kinds = lesson_kinds(episodes, rule_share, seed)
    lessons = [lesson(e.digest, settings.max_experience_chars, kind=kind) for e, kind in zip(episodes, kinds,
                                                                                            strict=True)]
    plays: dict[tuple[str, str, str], list[int]] = {}
    for index, episode in enumerate(episodes):
        plays.setdefault(_task_of(episode.digest), []).append(index)
    samples = []
    for index, episode in enumerate(episodes):
        others = [i for i in plays[_task_of(episode.digest)] if i != index]
        shown = [lessons[rng.choice(others)] if others else rng.choice(lessons)] if rng.random() < 0.5 else []
        prompt = distill_prompt(episode.digest, shown, max_ops=settings.max_ops,
                                max_actions=settings.max_actions_shown)
        state_facts = not (omit_facts and episode.digest.revealed and omit.random() < omit_facts)
        samples.append((prompt, summarise(episode.digest, shown, settings.max_experience_chars,
                                          state_facts=state_facts, kind=kinds[index])))
    families = sorted({e.digest.task_family for e in episodes})
    for _ in range(len(episodes) // 4 if merges else 0):
        family = rng.choice(families)
        pool = [text for text, e in zip(lessons, episodes, strict=True) if e.digest.task_family == family]
        entries = [rng.choice(pool) for _ in range(rng.randint(2, settings.merge_chunk))]
        samples.append((merge_prompt(family, entries), summarise_merge(entries, settings.max_experience_chars)))
    return samples


def lesson_kinds(episodes: Sequence[DataEpisode], rule_share: float, seed: int) -> list[str | None]:
    """The kind of each episode's rule-based lesson: None outside families with a rule across tasks and for
    episodes that revealed nothing; else 'rule' with probability `rule_share`, 'instance' or 'over-general' (half
    each) otherwise, from a stream of its own."""
    draw = random.Random(f"{seed}/lesson-kinds")
    kinds: list[str | None] = []
    for episode in episodes:
        if env_spec(episode.digest.env_id).task_rule is None or not episode.digest.revealed:
            kinds.append(None)
            continue
        value = draw.random()
        kinds.append("rule" if value < rule_share else
                     "instance" if value < rule_share + (1 - rule_share) / 2 else "over-general")
    return kinds
