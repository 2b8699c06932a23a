"""The tiny CPU preset: a small Qwen2 or Llama causal LM with a byte-level BPE tokenizer trained here, on text the
MiniHack environments produce and the lines the agent prompts contain.

    policy = build_tiny(TinyModelSettings())                      # ~1M parameters, builds in a few seconds
    policy = build_tiny(TinyModelSettings(architecture="llama", seed=1))

Same settings -> byte-identical weights and vocabulary: the corpus comes from seeded episodes, the BPE trainer is
deterministic, and the weights are initialised under a forked RNG seeded with `settings.seed` (the caller's global
RNG is left untouched). The model is untrained: it exists so the whole pipeline (sampling, log-probs, the RL
updates, checkpoints) runs end to end on a laptop CPU.

`TinyModelSettings` is declared in `pipeline.settings` (settings are read once, at the edge) and re-exported here.
`vocab_size` is an upper bound: BPE stops merging when the corpus has no pair left, and the model's vocabulary is
the tokenizer's actual size (the default settings give 1292 tokens).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.errors import ConfigError
from pipeline.models.settings import TinyModelSettings
from pipeline.models.transformers_backend import TransformersPolicy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["CORPUS_ENVS", "TinyModelSettings", "build_tiny", "tokenizer_corpus", "train_tokenizer"]

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|eos|>"

CORPUS_ENVS = (
    "MiniHack-Room-Random-5x5-v0",
    "MiniHack-MazeWalk-9x9-v0",
    "MiniHack-KeyRoom-S5-v0",
    "MiniHack-River-Narrow-v0",
)
"""Played round robin for the tokenizer corpus."""
CORPUS_MAX_ACTIONS = 30
NLE_TASK_SUCCESSFUL = 2
"""`info["end_status"]` of an episode that reached its goal (-1: step limit, 1: death)."""

ACTION_NAMES = {
    "N": "north", "S": "south", "E": "east", "W": "west",
    "NE": "northeast", "NW": "northwest", "SE": "southeast", "SW": "southwest",
    "PICKUP": "pickup", "APPLY": "apply",
}
"""NLE action enum names -> the words prompts use."""

TEMPLATE_LINES = (
    "Goal: reach the staircase down",
    "Goal: pick up the key, open the door and reach the staircase down",
    "Goal: cross the river and reach the staircase down",
    "Observation:",
    "Action:",
    *(f"Action: {name}" for name in ACTION_NAMES.values()),
    "Outcome: SUCCESS",
    "Outcome: FAILURE",
    "SUCCESS",
    "FAILURE",
    "Experience:",
    "Experiences:",
    "Write lessons as ops.",
    '<answer>[{"op": "add", "text": "Head diagonally toward the > staircase; walls stop you."}]</answer>',
    '<answer>[{"op": "add", "text": "..."}, {"op": "refine", "id": 1, "text": "..."}]</answer>',
    '<answer>[{"op": "refine", "id": 2, "text": "Pick up the key before walking to the door."}]</answer>',
    "<answer>[]</answer>",
)
"""Fixed lines of the actor's and the extractor's prompts, so their words get tokens of their own."""


def _crop(chars: np.ndarray) -> str:
    """The non-blank bounding box of the `chars` screen (rows joined by newlines)."""
    rows, cols = np.nonzero(chars != ord(" "))
    if rows.size == 0:
        return ""
    box = chars[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    return "\n".join(bytes(row).decode("latin-1").rstrip() for row in box)


def _message(observation: dict[str, np.ndarray]) -> str:
    return bytes(observation["message"]).rstrip(b"\0").decode("latin-1").strip()


def tokenizer_corpus(settings: TinyModelSettings) -> list[str]:
    """The tokenizer's training text: `settings.corpus_episodes` seeded random-action MiniHack episodes (one string
    each: every step's cropped map, game message and action name), then `TEMPLATE_LINES`. Deterministic."""
    try:
        import gymnasium as gym
        import minihack  # noqa: F401  (registers the MiniHack-* environments)
    except ImportError as exc:
        raise ConfigError(f"the tiny preset's tokenizer corpus needs minihack and nle installed: {exc}") from exc

    rng = random.Random(settings.seed)
    envs = [gym.make(name, observation_keys=("chars", "message")) for name in CORPUS_ENVS]
    corpus: list[str] = []
    try:
        for episode in range(settings.corpus_episodes):
            env = envs[episode % len(envs)]
            # NLE's own env class (`actions`, a three-argument `seed`) hides behind gymnasium's generic `Env`.
            actions = [ACTION_NAMES[action.name] for action in env.unwrapped.actions]  # type: ignore[attr-defined]
            # reset(seed=...) does not seed NetHack itself; these two seeds fix the map and the dynamics.
            env.unwrapped.seed(rng.randrange(2**31), rng.randrange(2**31), reseed=False)  # type: ignore[attr-defined]
            observation, _ = env.reset()
            lines = [f"Environment: {CORPUS_ENVS[episode % len(envs)]}", "Goal: reach the staircase down"]
            for _ in range(CORPUS_MAX_ACTIONS):
                lines += ["Observation:", _crop(observation["chars"])]
                if message := _message(observation):
                    lines.append(f"Message: {message}")
                action = rng.randrange(len(actions))
                lines.append(f"Action: {actions[action]}")
                observation, _, terminated, truncated, info = env.step(action)
                if terminated or truncated:
                    lines.append("SUCCESS" if int(info["end_status"]) == NLE_TASK_SUCCESSFUL else "FAILURE")
                    break
            corpus.append("\n".join(lines))
    finally:
        for env in envs:
            env.close()
    return corpus + list(TEMPLATE_LINES)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer over `texts` with `<|pad|>` (id 0) and `<|eos|>` (id 1), no bos. Deterministic:
    the same texts in the same order give the same vocabulary and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD_TOKEN, EOS_TOKEN], show_progress=False,
        # every byte gets a token, so any text encodes (no unknown token is needed)
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(texts), trainer)
    # clean_up_tokenization_spaces would turn "a ." into "a." on decode and break the text round trip.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False
    )


def build_tiny(
    settings: TinyModelSettings, corpus: Sequence[str] | None = None, device: str = "cpu"
) -> TransformersPolicy:
    """The tiny preset's policy: tokenizer trained on `corpus` (default `tokenizer_corpus(settings)`), weights
    initialised from `settings.seed`; float32, no dropout, input and output embeddings tied, pad/eos ids in the
    config. The embedding has one row per token the tokenizer actually has (at most `settings.vocab_size`)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

    tokenizer = train_tokenizer(tokenizer_corpus(settings) if corpus is None else corpus, settings.vocab_size)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=settings.hidden_size, num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads, num_key_value_heads=settings.num_kv_heads,
        intermediate_size=settings.intermediate_size, max_position_embeddings=settings.max_position_embeddings,
        tie_word_embeddings=True, attention_dropout=0.0, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    config: PretrainedConfig
    if settings.architecture == "qwen2":
        config = Qwen2Config(**common)
    elif settings.architecture == "llama":
        config = LlamaConfig(**common)
    else:
        raise ConfigError(f"unknown tiny architecture {settings.architecture!r}; valid values: qwen2, llama")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return TransformersPolicy(model, tokenizer, device=device)
