"""Starting competence on a CPU: a short supervised warm start of the tiny preset before version 0 is published.

No pretrained LLM is reachable here, and a randomly initialised model neither names actions nor writes the
extractor's answer format, so neither RL signal would ever appear. Both trainers can therefore fine-tune their
freshly built policy for `warm_start.steps` AdamW steps (off by default; the tiny configs turn it on, paper-scale
configs start from pretrained models instead), on data episodes of the run's tasks (`pipeline.rl.warm_data`):

- **actor: behaviour cloning** from scripted solvers (`TextEnv.expert_action`: MiniHack Room heads for the stairs,
  the dark corridors' solver knows the layout, Sokoban follows its BFS solution, the text worlds follow their
  engines' gold paths, Coin Collector's solver knows where the coin is), on the rollout worker's own prompts
  (`render_actor_prompt`), a third with an informative lesson, a third an irrelevant one, a third none: the actor
  learns to follow an experience that says where the goal is and to guess where none does (`plays_per_task` > 1
  makes tasks recur in the data). `label_noise` replaces a share of the labels with random actions, for a start
  that is competent but leaves RL room;
- **extractor: rule-based summaries** of the same data episodes (`summarise`: outcome, length, and what the episode
  revealed) in exactly the answer format the worker parses — `add` when nothing was shown, `refine` of alias 1 when
  an experience was and the episode revealed something, `[]` when it revealed nothing — and merge chunks of those
  lessons (`summarise_merge`). `omit_facts` leaves what the episode revealed out of that share of the lessons;
  `rule_share`, where a rule holds across tasks, states the rule in that share and the one task's fact or an
  over-general rule in the rest.

Each warm start with a `warm_start.gate` is then checked on held-out data (`pipeline.rl.warm_gate`), computed or
loaded; the checks are logged (an error when missed), kept in the statistics version 0's checkpoint records, and
sent with the `done` progress.

Everything is seeded, so the same settings give the same weights; the result is cached under
`warm_start.cache_dir` keyed by a hash of everything the weights depend on: the warm-start settings (the gate
aside), the tasks, the environments' own options, the initial weights, the thread count, the source of every module
that forms the samples or trains on them (`WARM_START_CODE`), and the libraries, torch build and CPU that compute
them (`code_fingerprint`); not the run's task seed, which the data episodes do not use. A cache hit loads
byte-identical weights, and an entry made by other code or on another machine is never reused: a skill that only
just appears in one setting may not in another. The trainer records the warm start's statistics in version 0's
checkpoint metadata, and `RunStarted` carries the settings. While it runs, it tells a `Progress` how far it has come
(episodes played, steps taken and their loss, then done or loaded from the cache, with the gate); the trainer
publishes that as `WarmStartProgressed` (`pipeline.rl.warm_progress`), which the live view of `crl run` shows.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import platform
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from infra.cache import exclusive_lock
from pipeline.envs.settings import EnvSettings, TaskMix
from pipeline.errors import ConfigError
from pipeline.extractor.protocol import EXTRACTOR_SYSTEM
from pipeline.extractor.settings import ExtractorSettings
from pipeline.models.transformers_backend import TransformersPolicy
from pipeline.rl.policy_step import make_optimizer
from pipeline.rl.settings import WarmStartSettings
from pipeline.rl.warm_data import DataEpisode, actor_samples, extractor_samples, play_data_episodes
from pipeline.rl.warm_gate import actor_gate, extractor_gate, gate_line, gate_passed
from pipeline.rl.warm_progress import Progress, no_progress
from schemas.training import WarmStartGateCheck

if TYPE_CHECKING:
    from pipeline.actor.settings import RolloutSettings

log = logging.getLogger(__name__)


# -- supervised fine-tuning -----------------------------------------------------------------------------------------


def fine_tune(policy: TransformersPolicy, samples: Sequence[tuple[str, str]], *, steps: int, batch_size: int,
              lr: float, seed: int, system: str, progress: Progress = no_progress,
              precision: str = "float32") -> list[float]:
    """`steps` AdamW steps of token-mean cross-entropy on the responses of (prompt, response) pairs, batches drawn
    with a seeded RNG; returns the loss of every step. Prompts are formed as the workers form them
    (`policy.prompt_ids(prompt, system)`: the chat template for a chat model), responses end as the model ends a
    turn.

    `precision` bfloat16, as the role's trainer runs with `model.precision: bfloat16`: the forward and backward passes
    under autocast (the weights, gradients and AdamW state stay float32; a weight is cast once a step), fused AdamW
    (`make_optimizer(fused=True)`: 0.10 s instead of 0.48 s a step over SmolLM2's parameters), deterministic mode's
    filling of every new tensor off (a guard against kernels that read memory they did not write; none on this path
    does, and the fills took 5% of a step), and attention through plain matmuls (`eager`: the CPU's fused attention
    kernel is slower backwards in bfloat16 than in float32; at warm-start lengths the matmuls are 8% faster), the
    model's own implementation set back afterwards. The result is still a pure function of the inputs and the thread
    count. float32 trains exactly as it always has (AdamW's loop, fills on), so its warm starts keep their bits and
    the figures measured on them."""
    if not samples:
        raise ConfigError("the warm start has no samples (no episode of the task mix had any)")
    rng = random.Random(seed)
    encoded = [(policy.prompt_ids(prompt, system), policy.response_ids(response)) for prompt, response in samples]
    half = precision == "bfloat16"
    optimizer = make_optimizer(policy.model, lr, 0.0, (0.9, 0.999), 1e-8, fused=half)
    policy.model.train()
    losses: list[float] = []
    progress("train", 0, steps)
    with _bfloat16_training(policy) if half else nullcontext():
        for _ in range(steps):
            batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
            tokens = sum(len(response) for _, response in batch)
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            with torch.autocast(policy.device.type, dtype=torch.bfloat16, enabled=half):
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


@contextmanager
def _bfloat16_training(policy: TransformersPolicy) -> Iterator[None]:
    """Eager attention and deterministic mode's fills off inside (`fine_tune` under bfloat16), then both as they
    were."""
    import torch.utils.deterministic

    attention = policy.model.config._attn_implementation
    # A property of the module object torch puts there, which the type stubs do not declare.
    fills = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    if attention != "eager":
        policy.model.set_attn_implementation("eager")
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fills  # type: ignore[attr-defined]
        if attention != "eager":
            policy.model.set_attn_implementation(attention)


# -- the warm starts, cached ----------------------------------------------------------------------------------------


WARM_START_CODE = ("pipeline/actor", "pipeline/envs", "pipeline/extractor", "pipeline/models", "pipeline/rl",
                   "pipeline/errors.py")
"""The project's code a warm start's weights depend on, relative to the repository root, every `.py` file under each
folder: what forms the samples (environments, task pools, prompts, the rule-based summariser, chat formatting) and
what trains on them (the model backends, the optimiser, the log-probs, the tiny preset). A test checks that every
module of the project a warm start imports is one of them or cannot change the weights."""


REPOSITORY = Path(__file__).resolve().parents[2]


@functools.cache
def code_fingerprint(root: Path = REPOSITORY) -> dict[str, str]:
    """What a warm start's weights depend on beyond its settings: the sha256 of `WARM_START_CODE`'s source, and the
    libraries and machine that compute it (torch's version and build, the CPU instructions its kernels dispatch
    to, transformers and tokenizers, NumPy and NetHack's environment). Float sums differ between builds and CPUs,
    and a warm start that only just learns a skill may learn it on one and not on another, so a cache entry made
    under any of them differs is not reused. `root`: the repository whose source is hashed."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for path in source_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    libraries = {}
    for name in ("torch", "transformers", "tokenizers", "numpy", "nle", "minihack", "peft"):
        try:
            libraries[name] = version(name)
        except PackageNotFoundError:
            libraries[name] = "absent"
    return {"source": digest.hexdigest(), **libraries,
            "torch_build": hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16],
            "cpu": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine()}


def source_files(root: Path) -> list[Path]:
    """The `.py` files of `WARM_START_CODE` under `root`, in a fixed order."""
    files: list[Path] = []
    for part in WARM_START_CODE:
        path = root / part
        files += [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    return files


def _cache_key(kind: str, policy: TransformersPolicy, parts: dict[str, Any]) -> str:
    from pipeline.models.checkpoints import weight_hash

    payload = json.dumps({"kind": kind, "initial_weights": weight_hash(policy.model), "parts": parts,
                          "threads": torch.get_num_threads(),  # float sums, so the weights, depend on it
                          "code": code_fingerprint()}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


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
        return stats

    if settings.cache_dir is None:
        return policy, trained()
    key = _cache_key(kind, policy, {**parts, "warm_start": settings.model_dump(mode="json",
                                                                               exclude={"cache_dir", "gate"})})
    path = settings.cache_dir / f"{kind}-{key}"
    # Two processes missing the same entry (two runs, or tests side by side) compute it once: the second waits for
    # the first and loads what it wrote. Two writers would each save their own timing and refuse the other's entry.
    with exclusive_lock(settings.cache_dir / f".{kind}-{key}.lock"):
        if (path / "manifest.json").exists():
            loaded = load_checkpoint(path)
            log.info("%s warm start loaded from the cache %s", kind, path)
            return loaded.policy, dict(loaded.manifest["metadata"]["warm_start"], cached=str(path))
        stats = {**trained(), "code": code_fingerprint()}
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
                     envs: EnvSettings, rollout: RolloutSettings, progress: Progress = no_progress, *,
                     precision: str = "float32") -> tuple[TransformersPolicy, dict[str, Any]]:
    """Behaviour cloning from the scripted solvers of the task mix, then its gate; returns the policy and what it
    did. `rollout`: how the rollout worker prompts (`history_turns`) and plays (the gate); `precision`: the actor
    trainer's `model.precision` (`fine_tune`)."""
    from pipeline.actor.episodes import ACTOR_SYSTEM

    def train() -> dict[str, Any]:
        episodes = play_data_episodes(tasks, envs, settings.episodes, settings.expert_fraction, settings.seed,
                                      settings.plays_per_task, progress)
        samples = actor_samples(episodes, rollout.history_turns, settings.seed, label_noise=settings.label_noise)
        if not samples:
            raise ConfigError(f"behaviour cloning needs a scripted solver, and none of {[t.env_id for t in tasks]}"
                              " has one (MiniHack Room and Sokoban do); set actor_trainer.warm_start.steps: 0")
        losses = fine_tune(policy, samples, steps=settings.steps, batch_size=settings.batch_size, lr=settings.lr,
                           seed=settings.seed, system=ACTOR_SYSTEM, progress=progress, precision=precision)
        return _stats(losses, len(samples), episodes)

    parts = {"tasks": [t.model_dump(mode="json") for t in tasks], "envs": _env_options(envs),
             "history_turns": rollout.history_turns, "precision": precision}
    policy, stats = _cached("actor", policy, settings, parts, train, progress)
    return policy, _gated("actor", stats, settings, progress,
                          lambda: actor_gate(policy, settings, tasks, envs, rollout))


def warm_start_extractor(policy: TransformersPolicy, settings: WarmStartSettings, tasks: Sequence[TaskMix],
                         envs: EnvSettings, extractor: ExtractorSettings, progress: Progress = no_progress, *,
                         merges: bool = True, precision: str = "float32") -> tuple[TransformersPolicy, dict[str, Any]]:
    """Fine-tuning on the rule-based summariser's answers (merge chunks among them where the run merges), then its
    gate; returns the policy and what it did. `precision`: the extractor trainer's `model.precision` (`fine_tune`)."""
    def train() -> dict[str, Any]:
        episodes = play_data_episodes(tasks, envs, settings.episodes, settings.expert_fraction, settings.seed,
                                      settings.plays_per_task, progress)
        samples = extractor_samples(episodes, extractor, settings.seed, omit_facts=settings.omit_facts,
                                    merges=merges, rule_share=settings.rule_share)
        losses = fine_tune(policy, samples, steps=settings.steps, batch_size=settings.batch_size, lr=settings.lr,
                           seed=settings.seed, system=EXTRACTOR_SYSTEM, progress=progress, precision=precision)
        return _stats(losses, len(samples), episodes)

    parts = {"tasks": [t.model_dump(mode="json") for t in tasks], "envs": _env_options(envs),
             "extractor": extractor.model_dump(mode="json", include={"max_ops", "max_experience_chars",
                                                                     "max_actions_shown", "merge_chunk"}),
             "merges": merges, "precision": precision}
    policy, stats = _cached("extractor", policy, settings, parts, train, progress)
    return policy, _gated("extractor", stats, settings, progress,
                          lambda: extractor_gate(policy, settings, tasks, envs, extractor))


def _gated(role: str, stats: dict[str, Any], settings: WarmStartSettings, progress: Progress,
           check: Callable[[], tuple[WarmStartGateCheck, ...]]) -> dict[str, Any]:
    """Check the gate where the settings set one (on the weights computed or loaded: the gate is never cached),
    say what it found, and report the warm start done."""
    checks = None
    if settings.gate is not None:
        checks = check()
        passed = gate_passed(checks)
        (log.info if passed else log.error)("%s", gate_line(role, checks))
        stats = {**stats, "gate": [c.model_dump(mode="json") for c in checks], "gate_passed": passed}
    progress("done", stats["steps"], stats["steps"], loss=stats.get("loss_last"), cached="cached" in stats,
             gate=checks)
    return stats
