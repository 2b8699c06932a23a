"""Starting competence on a CPU: a short supervised warm start of the tiny preset before version 0 is published.

No pretrained LLM is reachable here, and a randomly initialised model neither names actions nor writes the
extractor's answer format, so neither RL signal would ever appear. Both trainers can therefore fine-tune their
freshly built policy for `warm_start.steps` AdamW steps (off by default; the tiny configs turn it on, paper-scale
configs start from pretrained models instead):

- **actor: behaviour cloning** from scripted solvers (`TextEnv.expert_action`: MiniHack Room heads for the stairs,
  the dark corridors' solver knows the layout, Sokoban follows its BFS solution, the text worlds follow their
  engines' gold paths, Coin Collector's solver knows where the coin is). Data episodes are played by the
  solver, by a solver that knows only what the episode has shown (`TextEnv.uninformed_actions`) or at random, so the
  states are varied; the prompt is the rollout worker's own (`render_actor_prompt`). A third of the prompts carry
  an informative lesson (of a play of the same task, stating what that task revealed) and are labelled with the
  solver's action; a third an irrelevant lesson (one that states nothing revealed) and a third none, labelled with
  the uninformed solver's action: the actor learns to follow an experience that says where the goal is and to
  guess where none does (`plays_per_task` > 1 makes tasks recur in the data). `label_noise` replaces a share of
  the labels with random actions, for a start that is competent but leaves RL room;
- **extractor: rule-based summaries.** The same data episodes are written up by `summarise` (outcome, length, and
  what the episode revealed, such as where the goal lies relative to the start; the first and most repeated action
  where it revealed nothing) in exactly the answer format the worker parses — `add` when nothing was shown, `refine`
  of alias 1 when an experience was and the episode revealed something, `[]` when it revealed nothing — and chunks
  of those lessons by `summarise_merge` (lessons that start with the same word are merged).

Everything is seeded, so the same settings give the same weights; the result is cached under
`warm_start.cache_dir` keyed by a hash of what the samples depend on (the warm-start settings, the tasks, the
environments' own options and task pools, the initial weights, the thread count and the source of the modules that
form the samples; not the run's task seed, which the data episodes do not use), and a cache hit loads
byte-identical weights. The trainer records the warm start's statistics in version 0's checkpoint metadata,
and `RunStarted` carries the settings. While it runs, it tells a `Progress` how far it has come (episodes played,
steps taken and their loss, then done or loaded from the cache); the trainer publishes that as
`WarmStartProgressed` (`pipeline.rl.warm_progress`), which the live view of `crl run` shows.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from infra.cache import exclusive_lock
from pipeline.envs.base import TextEnv
from pipeline.envs.registry import env_spec, make_env, task_pool
from pipeline.envs.settings import EnvSettings, TaskMix
from pipeline.errors import ConfigError
from pipeline.extractor.protocol import (
    EXTRACTOR_SYSTEM,
    INVALID,
    TrajectoryDigest,
    distill_prompt,
    merge_prompt,
    render_answer,
)
from pipeline.extractor.settings import ExtractorSettings
from pipeline.models.transformers_backend import TransformersPolicy
from pipeline.rl.settings import WarmStartSettings
from pipeline.rl.update import make_optimizer
from pipeline.rl.warm_progress import Progress, no_progress

log = logging.getLogger(__name__)

INVALID_RESPONSE = "wait"
"""What a random data episode sometimes answers: no environment accepts it, so invalid turns occur."""


# -- the rule-based summariser --------------------------------------------------------------------------------------


def lesson(digest: TrajectoryDigest, max_chars: int) -> str:
    """One lesson from one episode: outcome, length, and what it revealed (where the goal lies relative to the
    start); where it revealed nothing, the first or the most repeated action."""
    valid = [a for a in digest.actions if a != INVALID]
    facts = "; ".join(digest.revealed)
    if digest.success:
        text = f"Solved in {len(digest.actions)} actions. " + (
            f"{facts}." if facts else f"Start with {valid[0] if valid else 'a listed action'} and keep heading for "
            "the goal.")
    else:
        repeated = Counter(valid).most_common(1)[0][0] if valid else "invalid actions"
        text = f"Failed after {len(digest.actions)} actions ({digest.invalid} invalid). " + (
            f"{facts}." if facts else f"Do not repeat {repeated}; use listed actions and head for the goal.")
    return text[:max_chars]


def summarise(digest: TrajectoryDigest, shown: Sequence[str], max_chars: int) -> str:
    """The answer the rule-based summariser writes: refine the first experience shown with this episode's lesson,
    or add it when none was shown; an episode that revealed nothing leaves a shown experience as it is (`[]`), so a
    lesson that states where the goal is is not overwritten by one that cannot."""
    if shown and not digest.revealed:
        return render_answer([])
    text = lesson(digest, max_chars)
    return render_answer([{"op": "refine", "id": 1, "text": text}] if shown else [{"op": "add", "text": text}])


def summarise_merge(entries: Sequence[str], max_chars: int) -> str:
    """Merge the lessons that begin with the same word (the first one's text, generalised); keep the rest."""
    groups: dict[str, list[int]] = {}
    for alias, text in enumerate(entries, start=1):
        groups.setdefault(text.split(" ", 1)[0].lower(), []).append(alias)
    ops = []
    for aliases in groups.values():
        if len(aliases) >= 2:
            text = f"{len(aliases)} lessons agree: {entries[aliases[0] - 1]}"
            ops.append({"op": "merge", "ids": aliases, "text": text[:max_chars]})
    return render_answer(ops)


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


def _tasks(tasks: Sequence[TaskMix]) -> list[tuple[str, int]]:
    return [(t.env_id, t.max_turns or env_spec(t.env_id).max_turns) for t in tasks]


def play_data_episodes(tasks: Sequence[TaskMix], envs: EnvSettings, episodes: int, expert_fraction: float,
                       seed: int, plays_per_task: int = 1, progress: Progress = no_progress) -> list[DataEpisode]:
    """`episodes` episodes on train-pool seeds, round robin over `tasks`: the solver plays `expert_fraction` of
    them (where the environment has one), the solver that knows only what the episode has shown half of the rest, and
    random actions the others; every turn is labelled with both solvers' actions. With
    `plays_per_task` > 1 the seeds come from a pool of `episodes / plays_per_task` tasks, so a task is played
    several times and one play's lesson can inform another's (what memory tasks need)."""
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
                env = built[(env_id, max_turns)] = make_env(env_id, envs, max_turns=max_turns, split="train")
            task_seed = rng.choice(task_pool(env_id, "train", pool_size, seed))
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
            played.append(DataEpisode(digest, tuple(turns)))
            progress("data", len(played), episodes)
    finally:
        for env in built.values():
            env.close()
    return played


# -- supervised fine-tuning -----------------------------------------------------------------------------------------


def fine_tune(policy: TransformersPolicy, samples: Sequence[tuple[str, str]], *, steps: int, batch_size: int,
              lr: float, seed: int, system: str, progress: Progress = no_progress) -> list[float]:
    """`steps` AdamW steps of token-mean cross-entropy on the responses of (prompt, response) pairs, batches drawn
    with a seeded RNG; returns the loss of every step. Prompts are formed as the workers form them
    (`policy.prompt_ids(prompt, system)`: the chat template for a chat model), responses end as the model ends a
    turn."""
    if not samples:
        raise ConfigError("the warm start has no samples (no episode of the task mix had any)")
    rng = random.Random(seed)
    encoded = [(policy.prompt_ids(prompt, system), policy.response_ids(response)) for prompt, response in samples]
    optimizer = make_optimizer(policy.model, lr, 0.0, (0.9, 0.999), 1e-8)
    policy.model.train()
    losses: list[float] = []
    progress("train", 0, steps)
    for _ in range(steps):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        tokens = sum(len(response) for _, response in batch)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for start in range(0, len(batch), policy.micro_batch_size):
            chunk = batch[start:start + policy.micro_batch_size]
            logprobs = policy.token_logprobs([p for p, _ in chunk], [r for _, r in chunk])
            loss = -torch.cat(logprobs).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        optimizer.step()
        losses.append(total)
        progress("train", len(losses), steps, loss=total)
    policy.model.eval()
    return losses


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
    keeps them from guided episodes too). With `label_noise`, that share of the labels is an available action drawn
    at random instead: the actor imitates a noisy solver and starts competent but imperfect however long it
    trains, which leaves RL room."""
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
        task = _task_of(episode.digest)
        same = informative.get(task, [])
        irrelevant = silent or [text for text, e in zip(lessons, episodes, strict=True) if _task_of(e.digest) != task]
        for turn in episode.turns:
            if turn.label is None:
                continue
            draw = rng.random()
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


def _task_of(digest: TrajectoryDigest) -> tuple[str, str, str]:
    """What identifies a task to the agent: environment, goal and the first observation."""
    return digest.env_id, digest.goal, digest.first_observation


def extractor_samples(episodes: Sequence[DataEpisode], settings: ExtractorSettings,
                      seed: int) -> list[tuple[str, str]]:
    """(extractor prompt, rule-based answer): one distillation per episode, and one merge chunk per four episodes.
    Half the distillations are shown a lesson, as a guided episode is: the lesson of another play of the same task
    where there is one (retrieval serves a task its own lessons), else any episode's."""
    rng = random.Random(seed)
    lessons = [lesson(e.digest, settings.max_experience_chars) for e in episodes]
    plays: dict[tuple[str, str, str], list[int]] = {}
    for index, episode in enumerate(episodes):
        plays.setdefault(_task_of(episode.digest), []).append(index)
    samples = []
    for index, episode in enumerate(episodes):
        others = [i for i in plays[_task_of(episode.digest)] if i != index]
        shown = [lessons[rng.choice(others)] if others else rng.choice(lessons)] if rng.random() < 0.5 else []
        prompt = distill_prompt(episode.digest, shown, max_ops=settings.max_ops,
                                max_actions=settings.max_actions_shown)
        samples.append((prompt, summarise(episode.digest, shown, settings.max_experience_chars)))
    families = sorted({e.digest.task_family for e in episodes})
    for _ in range(len(episodes) // 4):
        family = rng.choice(families)
        pool = [text for text, e in zip(lessons, episodes, strict=True) if e.digest.task_family == family]
        entries = [rng.choice(pool) for _ in range(rng.randint(2, settings.merge_chunk))]
        samples.append((merge_prompt(family, entries), summarise_merge(entries, settings.max_experience_chars)))
    return samples


# -- the warm starts, cached ----------------------------------------------------------------------------------------


def _cache_key(kind: str, policy: TransformersPolicy, parts: dict[str, Any]) -> str:
    from pipeline.models.checkpoints import weight_hash

    sources = "".join(Path(inspect.getfile(module)).read_text() for module in _source_modules())
    payload = json.dumps({"kind": kind, "initial_weights": weight_hash(policy.model), "parts": parts,
                          "threads": torch.get_num_threads(),  # float sums, so the weights, depend on it
                          "source": hashlib.sha256(sources.encode()).hexdigest()}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _source_modules() -> list[ModuleType]:
    import sys

    import pipeline.actor.episodes
    import pipeline.envs.base
    import pipeline.envs.dark_corridor
    import pipeline.envs.minihack
    import pipeline.envs.registry
    import pipeline.envs.sokoban
    import pipeline.extractor.protocol
    import pipeline.models.base

    # What forms the samples: the prompts, the chat formatting (`PolicyModel.prompt_ids`), the environments and
    # their task pools.
    return [sys.modules[__name__], pipeline.extractor.protocol, pipeline.actor.episodes, pipeline.models.base,
            pipeline.envs.base, pipeline.envs.registry, pipeline.envs.minihack, pipeline.envs.dark_corridor,
            pipeline.envs.sokoban]


def _cached(kind: str, policy: TransformersPolicy, settings: WarmStartSettings, parts: dict[str, Any],
            train: Callable[[], dict[str, Any]], progress: Progress) -> tuple[TransformersPolicy, dict[str, Any]]:
    from pipeline.models.checkpoints import load_checkpoint, save_checkpoint

    def trained() -> dict[str, Any]:
        started = time.perf_counter()
        stats = train()
        stats["seconds"] = time.perf_counter() - started
        log.info("%s warm start: %d steps, loss %.3f -> %.3f in %.0fs; data episodes solved per family: %s", kind,
                 stats["steps"], stats["loss_first"], stats["loss_last"], stats["seconds"],
                 ", ".join(f"{f} {r:.2f}" for f, r in stats["episode_success_by_family"].items()))
        progress("done", stats["steps"], stats["steps"], loss=stats["loss_last"])
        return stats

    if settings.cache_dir is None:
        return policy, trained()
    key = _cache_key(kind, policy, {**parts, "warm_start": settings.model_dump(mode="json", exclude={"cache_dir"})})
    path = settings.cache_dir / f"{kind}-{key}"
    # Two processes missing the same entry (two runs, or tests side by side) compute it once: the second waits for
    # the first and loads what it wrote. Two writers would each save their own timing and refuse the other's entry.
    with exclusive_lock(settings.cache_dir / f".{kind}-{key}.lock"):
        if (path / "manifest.json").exists():
            loaded = load_checkpoint(path)
            log.info("%s warm start loaded from the cache %s", kind, path)
            stats = dict(loaded.manifest["metadata"]["warm_start"], cached=str(path))
            progress("done", stats["steps"], stats["steps"], loss=stats.get("loss_last"), cached=True)
            return loaded.policy, stats
        stats = trained()
        save_checkpoint(path, policy, metadata={"warm_start": stats})
    return policy, stats


def _env_options(envs: EnvSettings) -> dict[str, Any]:
    """What of the env settings the data episodes depend on: how environments are built, not which tasks a run
    draws or evaluates (seeds, pools, repeats), so runs that differ only in those share one cached warm start."""
    return envs.model_dump(mode="json", include={"invalid_action", "alfworld_data", "webshop_num_products",
                                                 "swebench_instances", "text_worlds"})


def _stats(losses: list[float], samples: int, episodes: Sequence[DataEpisode]) -> dict[str, Any]:
    families = sorted({e.digest.task_family for e in episodes})
    by_family = {family: [e.digest.success for e in episodes if e.digest.task_family == family]
                 for family in families}
    return {"steps": len(losses), "samples": samples, "episodes": len(episodes),
            "episode_success": sum(e.digest.success for e in episodes) / max(1, len(episodes)),
            "episode_success_by_family": {f: sum(s) / len(s) for f, s in by_family.items()},
            "loss_first": losses[0], "loss_last": losses[-1]}


def warm_start_actor(policy: TransformersPolicy, settings: WarmStartSettings, tasks: Sequence[TaskMix],
                     envs: EnvSettings, history_turns: int,
                     progress: Progress = no_progress) -> tuple[TransformersPolicy, dict[str, Any]]:
    """Behaviour cloning from the scripted solvers of the task mix; returns the policy and what it did."""
    from pipeline.actor.episodes import ACTOR_SYSTEM

    def train() -> dict[str, Any]:
        episodes = play_data_episodes(tasks, envs, settings.episodes, settings.expert_fraction, settings.seed,
                                      settings.plays_per_task, progress)
        samples = actor_samples(episodes, history_turns, settings.seed, label_noise=settings.label_noise)
        if not samples:
            raise ConfigError(f"behaviour cloning needs a scripted solver, and none of {[t.env_id for t in tasks]}"
                              " has one (MiniHack Room and Sokoban do); set actor_trainer.warm_start.steps: 0")
        losses = fine_tune(policy, samples, steps=settings.steps, batch_size=settings.batch_size, lr=settings.lr,
                           seed=settings.seed, system=ACTOR_SYSTEM, progress=progress)
        return _stats(losses, len(samples), episodes)

    parts = {"tasks": [t.model_dump(mode="json") for t in tasks], "envs": _env_options(envs),
             "history_turns": history_turns}
    return _cached("actor", policy, settings, parts, train, progress)


def warm_start_extractor(policy: TransformersPolicy, settings: WarmStartSettings, tasks: Sequence[TaskMix],
                         envs: EnvSettings, extractor: ExtractorSettings,
                         progress: Progress = no_progress) -> tuple[TransformersPolicy, dict[str, Any]]:
    """Fine-tuning on the rule-based summariser's answers; returns the policy and what it did."""
    def train() -> dict[str, Any]:
        episodes = play_data_episodes(tasks, envs, settings.episodes, settings.expert_fraction, settings.seed,
                                      settings.plays_per_task, progress)
        samples = extractor_samples(episodes, extractor, settings.seed)
        losses = fine_tune(policy, samples, steps=settings.steps, batch_size=settings.batch_size, lr=settings.lr,
                           seed=settings.seed, system=EXTRACTOR_SYSTEM, progress=progress)
        return _stats(losses, len(samples), episodes)

    parts = {"tasks": [t.model_dump(mode="json") for t in tasks], "envs": _env_options(envs),
             "extractor": extractor.model_dump(mode="json", include={"max_ops", "max_experience_chars",
                                                                     "max_actions_shown", "merge_chunk"})}
    return _cached("extractor", policy, settings, parts, train, progress)
