"""The policy-model interface both backends implement: sample responses with their log-probs, and re-score
responses differentiably for training.

    policy = build_tiny(TinyModelSettings())                   # or TransformersPolicy.from_pretrained(path)
    out = policy.generate(["Goal: reach the staircase down\nAction:"], SamplingParams(max_new_tokens=8), seeds=[0])
    logps = policy.token_logprobs([out[0].prompt_token_ids], [out[0].token_ids], temperature=1.0)

What a recorded log-prob means (the on-policy ratio depends on it):

- `Generation.logprobs[t]` is `log_softmax(logits / temperature)` at the sampled token: the **un-truncated tempered**
  distribution. `top_p` / `top_k` only restrict which tokens can be drawn; the recorded value is not renormalised over
  the kept tokens. `token_logprobs(prompt, response, temperature)` recomputes exactly this quantity, so on the policy
  that sampled, the ratio `exp(new - recorded)` is 1 up to float error (~1e-5), whatever top_p / top_k were.
- `temperature == 0` is greedy decoding (argmax); its log-probs are taken at temperature 1, and
  `token_logprobs(..., temperature=0)` does the same.
- Sampling is reproducible and independent of batch composition: every prompt comes with its own seed
  (`seeds[i]`, one per prompt) and draws from its own generator seeded by it, so the same prompt with the same seed
  gives the same response whatever else is in the batch, at whatever position, in one call or in several. Callers
  key a row's seed by what the row is, not by where it sits: `stream_seed(...)` over the run's seed and the
  identity of the episode turn or extraction (`pipeline.actor.episodes.turn_seed`,
  `pipeline.extractor.protocol.distill_seed` / `merge_seed`).

Chat models are prompted as chat models: `prompt_ids(user, system)` is, for a tokenizer with a chat template, the ids
of that template over a system and a user message with the generation prompt added (what `generate` is then given,
so the recorded `prompt_token_ids` are exactly what the model saw); for one without (the tiny preset) it is the ids
of the user text itself, as before. Generation stops at the model's end-of-turn / EOS tokens (tokenizer and config), and
`response_ids(text)` is a supervised target as the model would end it: the text, then its end-of-turn token.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

SEED_LIMIT = 2**63
"""Row seeds lie in [0, SEED_LIMIT): what a torch generator and a vLLM request both take."""


def stream_seed(*parts: str | int) -> int:
    """The 63-bit seed of the random stream named by `parts` (strings and ints, e.g. a domain, the run's seed, an
    episode's id, a turn index): a pure function, the same on every machine, process and Python version.

    It is the first 8 bytes of the BLAKE2b-64 digest of the parts written as a compact JSON array (so `("a", 1)`,
    `("a", "1")` and `("a1",)` are three different streams), read big-endian, with the top bit dropped:
    `int.from_bytes(blake2b(json.dumps(list(parts), separators=(",", ":")).encode(), digest_size=8).digest(),
    "big") >> 1`."""
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise InvalidArgumentError(f"stream parts are strings and ints, got {part!r}")
    encoded = json.dumps(list(parts), separators=(",", ":"), ensure_ascii=True).encode()
    return int.from_bytes(hashlib.blake2b(encoded, digest_size=8).digest(), "big") >> 1


def check_seeds(seeds: Sequence[int], rows: int) -> list[int]:
    """`seeds` as a list after checking there is one per prompt and each lies in [0, 2**63)."""
    seeds = list(seeds)
    if len(seeds) != rows:
        raise InvalidArgumentError(f"{rows} prompts but {len(seeds)} seeds (one seed per prompt)")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
            raise InvalidArgumentError(f"a row seed is an int in [0, 2**63), got {seed!r}")
    return seeds


class SamplingParams(BaseModel):
    """How `PolicyModel.generate` samples. The defaults are plain ancestral sampling of up to 32 tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(default=32, gt=0, description="Most tokens generated per prompt.")
    temperature: float = Field(
        default=1.0, ge=0, description="Softmax temperature; 0 means greedy (argmax), log-probs then at temperature 1.")
    top_p: float = Field(
        default=1.0, gt=0, le=1,
        description="Nucleus sampling: draw only from the smallest set of tokens whose tempered probability reaches "
        "top_p (1 = off). Recorded log-probs stay those of the un-truncated tempered distribution.")
    top_k: int = Field(default=0, ge=0, description="Draw only from the k most likely tokens (0 = off).")
    stop: tuple[str, ...] = Field(
        default=(),
        description="A row stops once its decoded response contains one of these; its tokens are kept up to and "
        "including the token that completed the stop string.")
    stop_token_ids: tuple[int, ...] = Field(
        default=(), description="Token ids that end a row (kept as its last token); the eos token always does.")

    @field_validator("stop")
    @classmethod
    def _stop_strings_are_not_empty(cls, stop: tuple[str, ...]) -> tuple[str, ...]:
        if "" in stop:
            raise ValueError("stop strings must be non-empty (an empty one would end every row at its first token)")
        return stop


@dataclass(frozen=True)
class Generation:
    """One sampled response."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    """Generated tokens, including the eos / stop token that ended the row, if any."""
    text: str
    """`decode(token_ids)`, special tokens skipped."""
    logprobs: tuple[float, ...]
    """One per token: the sampling log-prob (see the module docstring)."""
    finish_reason: Literal["stop", "length"]
    """`stop`: eos, a stop token or a stop string ended the row; `length`: `max_new_tokens` did."""


@dataclass(frozen=True)
class Scored:
    """Responses scored by a policy (`PolicyModel.score`)."""

    logprobs: list[torch.Tensor]
    """Per row, `(len(response),)`: the log-prob of each response token (with gradient when the model trains)."""
    entropies: list[torch.Tensor] | None
    """Per row, `(len(response),)`: the entropy in nats of the policy's next-token distribution at each response
    token, at the scoring temperature, detached; None where the backend does not compute it."""


class PolicyModel(ABC):
    """A causal LM with its tokenizer that samples with recorded log-probs and re-scores responses."""

    tokenizer: PreTrainedTokenizerBase

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        # One sequence in, one string out: transformers types `decode` for batches too (`str | list[str]`).
        return cast(str, self.tokenizer.decode(list(ids), skip_special_tokens=True))

    @property
    def chat(self) -> bool:
        """Whether the tokenizer carries a chat template (a pretrained instruct model; the tiny preset has none)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, user: str, system: str | None = None) -> list[int]:
        """What `generate` is given for one user message: the chat template's ids (system message first, the
        generation prompt added) for a chat model, else the ids of `user` as it is."""
        if not self.chat:
            return self.encode(user)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
        # One conversation, tokenized: a flat list of ids (the declared union also covers batches and text).
        return [int(token) for token in cast("list[int]", ids)]

    def response_ids(self, text: str) -> list[int]:
        """A supervised target response: the ids of `text`, then, for a chat model, its end-of-turn token."""
        ids = self.encode(text)
        if self.chat and self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        return ids

    @abstractmethod
    def generate(
        self, prompts: Sequence[str | Sequence[int]], sampling: SamplingParams, seeds: Sequence[int],
        sessions: Sequence[Hashable | None] | None = None,
    ) -> list[Generation]:
        """One `Generation` per prompt (text, encoded without special tokens, or token ids), in order.

        `seeds` (one per prompt, each in [0, 2**63)) seeds each row's own random stream: a row's draws depend on its
        prompt and its seed only, never on the other rows, their number or its position (`InvalidArgumentError`
        when the counts differ). Greedy rows (temperature 0) draw nothing.

        `sessions` (one per prompt, None for none) names the conversation a prompt continues, such as an episode
        played over several turns: a backend may keep the keys and values of a session's last prompt and prefill only
        what a new prompt adds after their common prefix. It changes what is computed, not what is sampled (up to
        float rounding); `end_sessions` lets a backend drop what it kept."""

    def end_sessions(self, sessions: Iterable[Hashable] | None = None) -> None:
        """Forget what `generate` kept for `sessions` (all of them for None); a no-op for backends that keep none."""

    @abstractmethod
    def token_logprobs(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                       temperature: float = 1.0) -> list[torch.Tensor]:
        """Per row a `(len(response_ids[i]),)` float32 tensor: `log p(response[t] | prompt, response[:t])` under
        `softmax(logits / temperature)` (temperature 0 counts as 1)."""

    def score(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
              temperature: float = 1.0) -> Scored:
        """`token_logprobs`, and where the backend has the whole distribution at hand, the entropy of the policy at
        each response token (detached: a diagnostic, never part of a loss). A backend without it returns None."""
        return Scored(self.token_logprobs(prompt_ids, response_ids, temperature), None)


def limit_threads(threads: int) -> None:
    """torch's CPU threads in this process: `threads`, or torch's own default (one per core) for 0."""
    if threads:
        import torch

        torch.set_num_threads(threads)
