"""Policy models: one interface, two backends, a tiny CPU preset, and verified checkpoints.

- `base`: `PolicyModel` (generate with recorded sampling log-probs; differentiable `token_logprobs`),
  `SamplingParams`, `Generation`, and what a recorded log-prob means.
- `transformers_backend`: `TransformersPolicy`, any transformers causal LM on any torch device; the trainers use it.
- `vllm_backend`: `VllmPolicy`, the same interface on vLLM for GPU rollouts. Imported on demand only (vLLM is the
  optional `gpu` extra); `from pipeline.models.vllm_backend import VllmPolicy`.
- `tiny`: the tiny CPU preset, `build_tiny(TinyModelSettings())`, with a tokenizer trained on MiniHack text.
- `checkpoints`: safetensors checkpoints with a sha256 manifest; `save_checkpoint` / `load_checkpoint`.

    from pipeline.models import SamplingParams, TinyModelSettings, build_tiny
    policy = build_tiny(TinyModelSettings())
    print(policy.generate(["Action:"], SamplingParams(max_new_tokens=8), seeds=[0])[0].text)
"""

from pipeline.models.base import Generation, PolicyModel, SamplingParams
from pipeline.models.checkpoints import (
    CheckpointInfo,
    LoadedCheckpoint,
    load_checkpoint,
    load_optimizer_tensors,
    manifest_sha256,
    optimizer_tensors,
    save_checkpoint,
    weight_hash,
)
from pipeline.models.tiny import TinyModelSettings, build_tiny, tokenizer_corpus, train_tokenizer
from pipeline.models.transformers_backend import TransformersPolicy

__all__ = [
    "CheckpointInfo",
    "Generation",
    "LoadedCheckpoint",
    "PolicyModel",
    "SamplingParams",
    "TinyModelSettings",
    "TransformersPolicy",
    "build_tiny",
    "load_checkpoint",
    "load_optimizer_tensors",
    "manifest_sha256",
    "optimizer_tensors",
    "save_checkpoint",
    "tokenizer_corpus",
    "train_tokenizer",
    "weight_hash",
]
