"""The vLLM backend: the `PolicyModel` interface on vLLM, for rollouts on a CUDA machine.

    pip install 'complementary-rl[gpu]'
    policy = VllmPolicy("/checkpoints/actor/v000003", seed=0)

vLLM is the optional `gpu` extra (it needs CUDA and its own torch), so this module imports it only inside
`VllmPolicy.__init__` and is never imported by `pipeline.models` itself. Training always runs on the transformers
backend: `token_logprobs` here returns plain tensors without grad, for checks only.

Alignment with the transformers backend:
- row `i` gets the per-request seed `seeds[i]`, so its draws do not depend on the batch (vLLM's kernels differ, so
  the tokens are not the ones the transformers backend draws for that seed; nor are vLLM's batched kernels
  guaranteed batch-invariant, so a float near-tie can still resolve differently in another batch);
- the engine runs with `logprobs_mode="processed_logprobs"`: a recorded log-prob is taken after temperature scaling,
  i.e. `log_softmax(logits / T)`, the quantity `TransformersPolicy.token_logprobs(..., T)` recomputes. vLLM also
  applies top_k / top_p before that log-softmax, so with truncation on it records the renormalised truncated
  log-prob (>= ours); with top_p = 1 and top_k = 0 (the trainers' setting) both backends record the same quantity.
  Greedy rows (temperature 0) record untempered log-probs in both.

A new full version of the same architecture goes into the running engine in place (`load_version`): its files are
checked against the manifest in the pass that reads them (`read_verified`), then the state dict is handed to the
model's own `load_weights` on every worker (`LLM.collective_rpc`), and the prefix cache, which holds keys and values
of the old weights, is reset. Not run in this project's CI (vLLM needs CUDA): the call follows vLLM's documented
worker API (`collective_rpc` with a callable receiving the worker, `model_runner.model.load_weights(weights=...)`)
and the RL examples built on it.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import ConfigError, InvalidArgumentError, InvalidStateError
from pipeline.models.base import Generation, PolicyModel, SamplingParams, check_seeds
from pipeline.models.transformers_backend import load_tokenizer

GPU_EXTRA_HINT = "the vllm backend needs the 'gpu' extra on a CUDA machine: pip install 'complementary-rl[gpu]'"


class VllmPolicy(PolicyModel):
    """A vLLM engine over a local model directory (a checkpoint written by `save_checkpoint` works)."""

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        gpu_memory_utilization: float = 0.85,
        dtype: str = "auto",
        max_model_len: int | None = None,
    ) -> None:
        try:
            import vllm
        except ImportError as exc:
            raise ConfigError(GPU_EXTRA_HINT) from exc
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=model_path, tokenizer=model_path, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype, max_model_len=max_model_len, logprobs_mode="processed_logprobs", enable_prefix_caching=True,
        )
        # Prompts go in as token ids, encoded by the tokenizer exactly as saved (vLLM's own loader would pick
        # Qwen2Tokenizer for the tiny preset and encode differently; see `load_tokenizer`).
        self.tokenizer = load_tokenizer(model_path)
        manifest = Path(model_path) / "manifest.json"
        self.checkpoint_files: dict[str, str] | None = (
            json.loads(manifest.read_bytes())["files"] if manifest.is_file() else None)
        """The sha256 of the files of the checkpoint the engine serves (None for a plain model directory)."""

    def load_version(self, path: Path, expected_sha256: str) -> bool:
        """Serve the full checkpoint at `path` from the running engine, its weights loaded in place. False (nothing
        changed) when its config or tokenizer differ from the version served: the caller starts a new engine.
        `CheckpointError` when a file does not match the manifest, before the engine is touched."""
        from pipeline.models.checkpoints import MODEL_FILE, read_verified, safetensors_tensors, same_architecture

        _, manifest, files = read_verified(Path(path), expected_sha256, optimizer=False)
        if "base" in manifest or not same_architecture(self.checkpoint_files, manifest):
            return False
        state = safetensors_tensors(files[MODEL_FILE], Path(path) / MODEL_FILE)
        try:
            self.llm.collective_rpc(_load_weights, args=(list(state.items()),))
            self.llm.reset_prefix_cache()  # cached keys and values were computed with the old weights
        except Exception as exc:
            raise InvalidStateError(f"vLLM did not take the weights of {path} in place: {exc!r}") from exc
        self.checkpoint_files = dict(manifest["files"])
        return True

    def generate(
        self, prompts: Sequence[str | Sequence[int]], sampling: SamplingParams, seeds: Sequence[int],
        sessions: Sequence[Hashable | None] | None = None,
    ) -> list[Generation]:
        # `sessions` is not needed: vLLM's automatic prefix caching reuses any shared prefix, in a session or not.
        prompt_ids = [self.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        row_seeds = check_seeds(seeds, len(prompt_ids))
        params = [
            self._vllm.SamplingParams(
                n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_new_tokens,
                stop=list(sampling.stop), stop_token_ids=list(sampling.stop_token_ids),
                include_stop_str_in_output=True, seed=seed, logprobs=0,
            )
            for seed in row_seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        generations = []
        for ids, output in zip(prompt_ids, outputs, strict=True):
            completion = output.outputs[0]
            tokens = tuple(completion.token_ids)
            logprobs = tuple(step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True))
            generations.append(Generation(
                prompt_token_ids=tuple(ids), token_ids=tokens, text=self.decode(tokens), logprobs=logprobs,
                finish_reason="length" if completion.finish_reason == "length" else "stop",
            ))
        return generations

    def token_logprobs(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                       temperature: float = 1.0) -> list[torch.Tensor]:
        """Scores through vLLM's prompt log-probs (no grad). Those are computed from the raw logits, so only
        temperature 1 (or 0, which means 1) is supported; training uses `TransformersPolicy.token_logprobs`."""
        if temperature not in (0.0, 1.0):
            raise InvalidArgumentError(f"the vllm backend scores at temperature 1 only (got {temperature}); use the "
                             "transformers backend for tempered log-probs")
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        sequences = [[int(t) for t in p] + [int(t) for t in r] for p, r in zip(prompt_ids, response_ids, strict=True)]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in sequences], params, use_tqdm=False)
        result = []
        for prompt, sequence, output in zip(prompt_ids, sequences, outputs, strict=True):
            # prompt_logprobs[j] scores sequence[j] given sequence[:j] (entry 0 is None).
            scored = output.prompt_logprobs[len(prompt) :]
            result.append(torch.tensor(
                [step[token].logprob for step, token in zip(scored, sequence[len(prompt) :], strict=True)],
                dtype=torch.float32,
            ))
        return result


def _load_weights(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Run on each vLLM worker (`collective_rpc`): the model's own loader maps transformers names onto vLLM's fused
    layers and copies each tensor into the parameter it belongs to, on the worker's device."""
    worker.model_runner.model.load_weights(weights=weights)
