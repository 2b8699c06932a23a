"""The transformers backend: sampling and re-scoring with a `PreTrainedModel` on any torch device (CPU here).

    policy = TransformersPolicy.from_pretrained("/models/qwen2.5-0.5b-instruct", device="cpu")
    generations = policy.generate(["Action:"], SamplingParams(max_new_tokens=16), seeds=[7])

`generate` runs its own decoding loop instead of `model.generate`, for two properties the trainers rely on:

- exact log-probs: each recorded value is `log_softmax(logits / temperature)` at the sampled token, the quantity
  `token_logprobs` recomputes (see `pipeline.models.base`);
- reproducible, batch-independent sampling: row `i` draws its Gumbel noise from its own generator seeded by
  `seeds[i]`, and picks `argmax(logits / T + gumbel)` over the tokens top_k / top_p allow (Gumbel-max draws exactly
  from the softmax over the kept tokens). Its draws never depend on the other rows, so the same prompt with the same
  seed gives the same tokens whatever shares its batch, at any position and micro-batch (up to float ties: the
  padded, batched forward pass is not bitwise batch-invariant, see `tests/unit/models/test_models.py`).

Layouts. Generation: the prompts of one micro-batch are left-padded so every row's next token sits in the last
column; position ids come from the attention mask's cumulative sum, so padding shifts nothing. Scoring: left-padded
prompt then right-padded response, so every response starts at the same column and one `logits_to_keep` slice
covers all of them (the vocabulary-sized logits dominate memory, so only those positions are projected).

Sessions: a row given a session reuses the keys and values kept from that session's last prompt for their common
prefix; the layout is then [pad | reused prefix] [pad | the rest of the prompt], positions still from the mask's
cumulative sum. Decoding writes into cache storage allocated for `max_new_tokens` ahead. `for_generation` gives the
policy generating workers sample from: a copy with bfloat16 weights, or with a LoRA adapter merged in, or both.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from pipeline.errors import ConfigError, InvalidArgumentError
from pipeline.models.base import Generation, PolicyModel, SamplingParams, Scored, check_seeds

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase


GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in the local directory `path`, exactly as saved.

    A tokenizer saved as a generic one (`tokenizer_class` TokenizersBackend / PreTrainedTokenizerFast, as the tiny
    preset's is) is rebuilt from its `tokenizer.json` alone. `AutoTokenizer` would not do that for a `qwen2` config:
    it forces `Qwen2Tokenizer`, which swaps in Qwen's pre-tokenizer regex and adds an `<|endoftext|>` token, so the
    same text would encode differently. Any other class (a real Qwen or Llama model) loads through `AutoTokenizer`.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer_config = Path(path) / "tokenizer_config.json"
    declared = json.loads(tokenizer_config.read_text()).get("tokenizer_class") if tokenizer_config.is_file() else None
    if declared in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _preallocate(cache: Any, tokens: int) -> None:
    """Give every layer of a `DynamicCache` room for `tokens` more positions, so decoding writes each step's keys and
    values in place instead of concatenating the whole cache anew (a `torch.cat` per layer and step)."""
    from transformers.cache_utils import DynamicLayer

    for index, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer or not layer.is_initialized:
            continue  # sliding-window and other layer kinds keep their own update
        cache.layers[index] = _preallocated_layer_class()(cast(torch.Tensor, layer.keys),
                                                          cast(torch.Tensor, layer.values), tokens)


@functools.cache
def _preallocated_layer_class() -> type:
    """`DynamicLayer` with its storage allocated ahead (defined on first use: transformers loads lazily)."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
            super().__init__()
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
            shape = (*keys.shape[:-2], keys.shape[-2] + room, keys.shape[-1])
            self.key_buffer, self.value_buffer = keys.new_empty(shape), values.new_empty(shape)
            self._set(keys, values, 0)

        def _set(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
            end = start + keys.shape[-2]
            self.key_buffer[..., start:end, :] = keys
            self.value_buffer[..., start:end, :] = values
            self.length = end
            filled = self.key_buffer[..., :end, :], self.value_buffer[..., :end, :]
            self.keys, self.values = filled
            return filled

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self.length + key_states.shape[-2] > self.key_buffer.shape[-2]:  # out of room: grow by concatenating
                self.key_buffer = torch.cat([self.key_buffer[..., : self.length, :], key_states], dim=-2)
                self.value_buffer = torch.cat([self.value_buffer[..., : self.length, :], value_states], dim=-2)
                self.length = self.key_buffer.shape[-2]
                self.keys, self.values = self.key_buffer, self.value_buffer
                return self.key_buffer, self.value_buffer
            return self._set(key_states, value_states, self.length)

    return PreallocatedLayer


@dataclass
class KeptPrompt:
    """The keys and values of a session's last prompt, per layer `(heads, len(prompt_ids), head_dim)`."""

    prompt_ids: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class TransformersPolicy(PolicyModel):
    """A transformers causal LM and its tokenizer. `model` is public: trainers call `.model.parameters()` and
    `.model.train()`; `token_logprobs` is differentiable when grad is enabled. Both `generate` and `token_logprobs`
    run `micro_batch_size` rows per forward pass (the vocabulary-sized logits bound the memory)."""

    def __init__(
        self,
        model: PreTrainedModel | PeftModel,
        tokenizer: PreTrainedTokenizerBase,
        device: str = "cpu",
        micro_batch_size: int = 8,
    ) -> None:
        if micro_batch_size <= 0:
            raise InvalidArgumentError(f"micro_batch_size must be positive, got {micro_batch_size}")
        self.device = torch.device(device)
        # transformers decorates `PreTrainedModel.to` with `functools.wraps(Module.to)`, which mypy reads as the
        # unbound `Module.to` (expecting the module as its first argument).
        self.model: PreTrainedModel | PeftModel = model.to(self.device)  # type: ignore[arg-type]
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ConfigError("the tokenizer has neither a pad nor an eos token; padding needs one of them")
        self.pad_token_id: int = pad
        config_eos = model.config.eos_token_id
        config_eos = [] if config_eos is None else [config_eos] if isinstance(config_eos, int) else list(config_eos)
        tokenizer_eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self.eos_token_ids: frozenset[int] = frozenset(tokenizer_eos + config_eos)
        self.base_checkpoint: str | None = None
        """Manifest sha256 of the full checkpoint the weights (the base, for a LoRA policy) were loaded from."""
        self.checkpoint_files: dict[str, str] | None = None
        """The sha256 of every file of that checkpoint (its manifest's `files`): a later version whose config and
        tokenizer files are the same is copied into this model in place (`load_checkpoint(reuse=...)`)."""
        self.adapter_config: dict[str, Any] | None = None
        """The LoRA adapter's configuration (`pipeline.models.lora`), None for a plain model."""
        self.full_precision: TransformersPolicy | None = None
        """For a reduced-precision generation copy (`for_generation`), the float32 policy it was made from."""
        self.max_sessions = 256
        """Most sessions whose last prompt's keys and values `generate` keeps (the least recently used goes first)."""
        self._sessions: OrderedDict[Hashable, KeptPrompt] = OrderedDict()
        self.prompt_tokens_run = 0
        """Prompt tokens `generate` has run through the model so far (what sessions saved is not counted)."""
        self.prompt_tokens_reused = 0
        """Prompt tokens whose keys and values came from a session instead."""

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str = "cpu", *, dtype: torch.dtype = torch.float32, micro_batch_size: int = 8
    ) -> TransformersPolicy:
        """Load a model directory (config, weights, tokenizer) from local disk; nothing is downloaded."""
        from transformers import AutoModelForCausalLM

        if not Path(path).is_dir():
            raise ConfigError(f"model path {path} is not a local directory (nothing is downloaded at run time)")
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
            tokenizer = load_tokenizer(path)
        except OSError as exc:
            raise ConfigError(f"cannot load a causal LM and tokenizer from {path}: {exc}") from exc
        return cls(model, tokenizer, device=device, micro_batch_size=micro_batch_size)

    def for_generation(self, precision: str, *, reuse: TransformersPolicy | None = None,
                       pack: bool = True) -> TransformersPolicy:
        """The policy a generating worker samples from at `precision`: a copy of this one, with a LoRA adapter
        merged in (a decode step then runs no adapter matmuls), bfloat16 weights for bfloat16, and for float32 on a
        CPU every linear layer packed for oneDNN's matmuls (`pipeline.models.packed_linear`: decoding 1.33x faster
        for SmolLM2; `pack=False`, a model under `MIN_PARAMETERS` or a torch build that cannot leaves them plain).
        Where none of that applies (a plain model in float32 left unpacked) the policy itself. The copy names this
        policy as `full_precision`, which a later version is loaded onto (its hashes are over this policy's
        weights).

        `reuse`, an earlier copy made from this very policy, gets the current weights written into it in place
        instead of a new copy being made (the same model and tensors, new values; a packed layer's weight, oneDNN's
        opaque tensor, is packed anew): each adapted layer's weight as base plus the adapter's delta, the sum
        `merge_and_unload` forms, so the result is what a new copy would hold, bit for bit."""
        if precision not in ("float32", "bfloat16"):
            raise InvalidArgumentError(f"unknown precision {precision!r}; valid values: float32, bfloat16")
        import copy

        from peft import PeftModel

        from pipeline.models.packed_linear import pack_linears, worth_packing

        lora = isinstance(self.model, PeftModel)
        packed = pack and precision == "float32" and self.device.type == "cpu" and worth_packing(self.model)
        if precision == "float32" and not lora and not packed:
            return self
        dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
        if (reuse is not None and reuse.full_precision is self and _is_packed(reuse.model) == packed
                and _write_generation_weights(self.model, reuse.model, dtype)):
            reuse.end_sessions()
            reuse.base_checkpoint, reuse.adapter_config = self.base_checkpoint, self.adapter_config
            return reuse
        model: Any = copy.deepcopy(self.model)
        if lora:
            model = model.merge_and_unload()
        model.to(dtype)
        if packed:
            model = pack_linears(model, rows=self.micro_batch_size)
        copied = TransformersPolicy(model, self.tokenizer, device=str(self.device),
                                    micro_batch_size=self.micro_batch_size)
        copied.base_checkpoint, copied.adapter_config = self.base_checkpoint, self.adapter_config
        copied.full_precision = self
        copied.model.eval()
        return copied

    # -- generation -----------------------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[str | Sequence[int]], sampling: SamplingParams, seeds: Sequence[int],
        sessions: Sequence[Hashable | None] | None = None,
    ) -> list[Generation]:
        prompt_ids = [self._prompt_ids(prompt) for prompt in prompts]
        row_seeds = check_seeds(seeds, len(prompt_ids))
        if sessions is not None and len(sessions) != len(prompt_ids):
            raise InvalidArgumentError(f"{len(prompt_ids)} prompts but {len(sessions)} sessions")
        row_sessions = list(sessions) if sessions is not None else [None] * len(prompt_ids)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                generations: list[Generation] = []
                for start in range(0, len(prompt_ids), self.micro_batch_size):
                    rows = range(start, min(start + self.micro_batch_size, len(prompt_ids)))
                    generators = [self._generator(row_seeds[row]) for row in rows]
                    generations += self._generate_micro_batch([prompt_ids[r] for r in rows], generators, sampling,
                                                              [row_sessions[r] for r in rows])
                return generations
        finally:
            self.model.train(was_training)

    def end_sessions(self, sessions: Iterable[Hashable] | None = None) -> None:
        if sessions is None:
            self._sessions.clear()
            return
        for session in sessions:
            self._sessions.pop(session, None)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise InvalidArgumentError("a prompt must have at least one token to condition on")
        return ids

    def _generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    def _generate_micro_batch(
        self, prompt_ids: list[list[int]], generators: list[torch.Generator], sampling: SamplingParams,
        sessions: list[Hashable | None],
    ) -> list[Generation]:
        batch = len(prompt_ids)
        kept = [self._sessions.get(session) if session is not None else None for session in sessions]
        # Tokens of each prompt whose keys and values its session kept: the common prefix with the session's last
        # prompt, less one token (the last prompt token is always run, its logits start the response).
        reused = [min(_common_prefix(k.prompt_ids, ids), len(ids) - 1) if k is not None else 0
                  for k, ids in zip(kept, prompt_ids, strict=True)]
        past_width = max(reused)
        width = max(len(ids) - r for ids, r in zip(prompt_ids, reused, strict=True))
        # Layout per row: [pad | reused prefix] [pad | the rest of the prompt], both halves right-aligned.
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)  # (B, P)
        attention_mask = torch.zeros((batch, past_width + width), dtype=torch.long)  # (B, R+P)
        for i, (ids, r) in enumerate(zip(prompt_ids, reused, strict=True)):
            rest = ids[r:]
            input_ids[i, width - len(rest) :] = torch.tensor(rest, dtype=torch.long)
            attention_mask[i, past_width - r : past_width] = 1
            attention_mask[i, past_width + width - len(rest) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, past_width:]  # (B, P)
        cache = self._past(kept, reused, past_width) if past_width else None
        self.prompt_tokens_reused += sum(reused)
        self.prompt_tokens_run += sum(len(ids) for ids in prompt_ids) - sum(reused)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        self._keep(sessions, prompt_ids, reused, past_width, width, cache)
        _preallocate(cache, sampling.max_new_tokens)
        logits = out.logits[:, -1, :].float()  # (B, V)
        next_position = position_ids[:, -1:] + 1  # (B, 1)

        stop_ids = self.eos_token_ids | frozenset(sampling.stop_token_ids)
        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        stopped = [False] * batch
        for step in range(sampling.max_new_tokens):
            active = [i for i in range(batch) if not stopped[i]]
            chosen, chosen_logp = self._sample(logits[active], [generators[i] for i in active], sampling)
            next_ids = torch.full((batch, 1), self.pad_token_id, dtype=torch.long)  # (B, 1); finished rows: pad
            for row, token, logp in zip(active, chosen.tolist(), chosen_logp.tolist(), strict=True):
                tokens[row].append(token)
                logprobs[row].append(logp)
                next_ids[row, 0] = token
                if token in stop_ids or (sampling.stop and self._contains_stop(tokens[row], sampling.stop)):
                    stopped[row] = True
            if step == sampling.max_new_tokens - 1 or all(stopped):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=1)  # (B, P+t+1)
            out = self.model(input_ids=next_ids.to(self.device), attention_mask=attention_mask,
                             position_ids=next_position, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()  # (B, V)
            next_position = next_position + 1

        return [
            Generation(
                prompt_token_ids=tuple(prompt_ids[i]), token_ids=tuple(tokens[i]), text=self.decode(tokens[i]),
                logprobs=tuple(logprobs[i]), finish_reason="stop" if stopped[i] else "length",
            )
            for i in range(batch)
        ]

    def _past(self, kept: list[KeptPrompt | None], reused: list[int], width: int) -> DynamicCache:
        """A cache of `width` columns holding, right-aligned per row, the first `reused[i]` positions its session
        kept (zeros elsewhere, which the attention mask hides)."""
        from transformers import DynamicCache

        layers = []
        for layer in range(len(next(k for k in kept if k is not None).keys)):
            template = next(k for k in kept if k is not None).keys[layer]  # (H, T, D)
            heads, dim = template.shape[0], template.shape[2]
            keys = template.new_zeros((len(kept), heads, width, dim))  # (B, H, R, D)
            values = template.new_zeros((len(kept), heads, width, dim))
            for row, (k, r) in enumerate(zip(kept, reused, strict=True)):
                if k is not None and r:
                    keys[row, :, width - r :] = k.keys[layer][:, :r]
                    values[row, :, width - r :] = k.values[layer][:, :r]
            layers.append((keys, values))
        return DynamicCache(layers, config=self.model.config)

    def _keep(self, sessions: list[Hashable | None], prompt_ids: list[list[int]], reused: list[int], past_width: int,
              width: int, cache: Any) -> None:
        """Keep, per row with a session, the keys and values of its whole prompt (copied out of the batch cache)."""
        for row, (session, ids, r) in enumerate(zip(sessions, prompt_ids, reused, strict=True)):
            if session is None:
                continue
            rest = len(ids) - r
            columns = list(range(past_width - r, past_width)) + list(range(past_width + width - rest,
                                                                           past_width + width))
            index = torch.tensor(columns, device=self.device)
            keys = [layer.keys[row].index_select(1, index) for layer in cache.layers]  # each (H, T, D)
            values = [layer.values[row].index_select(1, index) for layer in cache.layers]
            self._sessions.pop(session, None)
            self._sessions[session] = KeptPrompt(tuple(ids), keys, values)
            while len(self._sessions) > self.max_sessions:
                self._sessions.pop(next(iter(self._sessions)))  # the least recently used

    def _contains_stop(self, tokens: list[int], stop: tuple[str, ...]) -> bool:
        # The whole response is decoded each time: a stop string can straddle tokens, and a byte-level token can
        # hold half a character, so only the decoded text says whether it appeared.
        text = self.decode(tokens)
        return any(s in text for s in stop)

    def _sample(
        self, logits: torch.Tensor, generators: list[torch.Generator], sampling: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token and its sampling log-prob for each row of `logits` (b, V); row j draws from `generators[j]`."""
        if sampling.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)  # (b, V)
            token = logits.argmax(dim=-1)  # (b,)
            return token, logp.gather(-1, token[:, None]).squeeze(-1)
        scaled = logits / sampling.temperature  # (b, V)
        logp = torch.log_softmax(scaled, dim=-1)  # (b, V), un-truncated: what gets recorded
        allowed = self._truncate(scaled, sampling.top_k, sampling.top_p)  # (b, V), -inf outside the kept set
        vocab = logits.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=g, device=self.device) for g in generators])  # (b, V)
        # tiny instead of 0 keeps the noise finite; rand never returns 1.
        gumbel = -torch.log(-torch.log(uniform.clamp(min=torch.finfo(uniform.dtype).tiny)))  # (b, V)
        token = (allowed + gumbel).argmax(dim=-1)  # (b,)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)

    @staticmethod
    def _truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
        """`scaled` (b, V) with the tokens top_k, then top_p, exclude set to -inf (the order transformers uses)."""
        if 0 < top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # (b, 1)
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if top_p < 1.0:
            ordered, order = torch.sort(scaled, dim=-1, descending=True)  # (b, V)
            probs = torch.softmax(ordered, dim=-1)
            # A token is dropped once the more likely tokens before it already reach top_p; the first always stays.
            drop_ordered = (probs.cumsum(dim=-1) - probs) >= top_p  # (b, V)
            drop = torch.zeros_like(drop_ordered).scatter(-1, order, drop_ordered)
            scaled = scaled.masked_fill(drop, float("-inf"))
        return scaled

    # -- scoring --------------------------------------------------------------------------------------------------

    def token_logprobs(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                       temperature: float = 1.0) -> list[torch.Tensor]:
        return self._score(prompt_ids, response_ids, temperature, entropy=False).logprobs

    def score(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
              temperature: float = 1.0) -> Scored:
        return self._score(prompt_ids, response_ids, temperature, entropy=True)

    def _score(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
               temperature: float, entropy: bool) -> Scored:
        if len(prompt_ids) != len(response_ids):
            raise InvalidArgumentError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        if temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {temperature}")
        scale = temperature if temperature > 0 else 1.0  # greedy samples record log-probs at temperature 1
        logprobs: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        for start in range(0, len(prompt_ids), self.micro_batch_size):
            prompts = [[int(t) for t in p] for p in prompt_ids[start : start + self.micro_batch_size]]
            responses = [[int(t) for t in r] for r in response_ids[start : start + self.micro_batch_size]]
            rows, row_entropies = self._score_micro_batch(prompts, responses, scale, entropy)
            logprobs += rows
            entropies += row_entropies
        return Scored(logprobs, entropies if entropy else None)

    def _score_micro_batch(
        self, prompts: list[list[int]], responses: list[list[int]], temperature: float, entropy: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if any(not p for p in prompts):
            raise InvalidArgumentError("a prompt must have at least one token to condition on")
        batch = len(prompts)
        prompt_width = max(len(p) for p in prompts)
        response_width = max(len(r) for r in responses)
        if response_width == 0:
            empty = [torch.zeros(0, dtype=torch.float32, device=self.device) for _ in range(batch)]
            return empty, list(empty) if entropy else []
        input_ids = torch.full((batch, prompt_width + response_width), self.pad_token_id, dtype=torch.long)  # (B, L)
        attention_mask = torch.zeros_like(input_ids)  # (B, L)
        for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            input_ids[i, prompt_width - len(prompt) : prompt_width + len(response)] = torch.tensor(prompt + response)
            attention_mask[i, prompt_width - len(prompt) : prompt_width + len(response)] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        # The logits at columns P-1 .. P+R-2 predict the response tokens at columns P .. P+R-1.
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, logits_to_keep=response_width + 1)
        logits = out.logits[:, :-1, :].float() / temperature  # (B, R, V)
        targets = input_ids[:, prompt_width:]  # (B, R)
        # gather - logsumexp instead of log_softmax: no second (B, R, V) tensor.
        normaliser = torch.logsumexp(logits, dim=-1)  # (B, R)
        logp = logits.gather(-1, targets[..., None]).squeeze(-1) - normaliser  # (B, R)
        rows = [logp[i, : len(response)] for i, response in enumerate(responses)]
        if not entropy:
            return rows, []
        with torch.no_grad():
            # H = logsumexp(z) - sum softmax(z) * z, over the vocabulary, at every response token.
            detached = logits.detach()
            spread = normaliser.detach() - (torch.softmax(detached, dim=-1) * detached).sum(-1)  # (B, R)
        return rows, [spread[i, : len(response)] for i, response in enumerate(responses)]


def _is_packed(model: Any) -> bool:
    from pipeline.models.packed_linear import PackedLinear

    return any(isinstance(module, PackedLinear) for module in model.modules())


def _write_generation_weights(source: Any, target: Any, dtype: torch.dtype) -> bool:
    """Write `source`'s weights into `target`, a plain model of `dtype` made from it by `for_generation` (LoRA
    adapters merged, linear layers perhaps packed), in place; False, with nothing written, where their names or
    shapes do not match or an adapter is of a kind peft merges otherwise (DoRA, an adapter bias, an embedding's).
    An adapted layer's weight is its base layer's plus each active adapter's delta in turn, as `merge_and_unload`
    adds them; a copy into bfloat16 rounds as `.to(torch.bfloat16)` does; a packed layer packs its weight anew."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from pipeline.models.packed_linear import PackedLinear

    root = source.get_base_model() if isinstance(source, PeftModel) else source
    adapted = {name: module for name, module in root.named_modules() if isinstance(module, LoraLayer)}
    if any(layer.lora_variant or any(layer.lora_bias.values())
           or any(adapter not in layer.lora_A for adapter in layer.active_adapters) for layer in adapted.values()):
        return False  # DoRA, an adapter bias or an embedding adapter: merged by peft itself, in a new copy
    plain = root.state_dict()

    def value(owner: str, leaf: str) -> tuple[Any, Any]:
        layer = adapted.get(owner)
        if layer is not None:
            return getattr(layer.get_base_layer(), leaf, None), layer if leaf == "weight" else None
        return plain.get(f"{owner}.{leaf}" if owner else leaf), None

    writes: list[tuple[Any, Any, Any]] = []  # (what to write into, the source value, the adapted layer or None)
    for owner, module in target.named_modules():
        if isinstance(module, PackedLinear):
            (weight, layer), (bias, _) = value(owner, "weight"), value(owner, "bias")
            if (not isinstance(weight, torch.Tensor) or weight.shape != (module.out_features, module.in_features)
                    or (bias is None) != (module.bias is None)):
                return False
            writes.append((module, (weight, bias), layer))
            continue
        persistent = [(leaf, buffer) for leaf, buffer in module.named_buffers(recurse=False)
                      if leaf not in module._non_persistent_buffers_set]  # the others derive from the config
        for leaf, tensor in [*module.named_parameters(recurse=False), *persistent]:
            found, layer = value(owner, leaf)
            if not isinstance(found, torch.Tensor) or found.shape != tensor.shape or tensor.dtype != dtype:
                return False
            writes.append((tensor, found, layer))

    def merged(weight: torch.Tensor, layer: Any) -> torch.Tensor:
        if layer is None:
            return weight
        weight = weight.clone()
        for adapter in layer.active_adapters:
            weight += layer.get_delta_weight(adapter)
        return weight

    with torch.no_grad():
        for into, found, layer in writes:
            if isinstance(into, PackedLinear):
                into.write(merged(found[0], layer), found[1])
            else:
                into.copy_(merged(found, layer))
    return True
