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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


# Loaded on first use, so that reading settings (`pipeline.models.settings`) does not import torch: the CLI, the
# scheduler, the archiver and the tracker start without it.
_HOME = {
    "CheckpointInfo": "pipeline.models.checkpoints",
    "Generation": "pipeline.models.base",
    "LoadedCheckpoint": "pipeline.models.checkpoints",
    "PolicyModel": "pipeline.models.base",
    "SamplingParams": "pipeline.models.base",
    "TinyModelSettings": "pipeline.models.tiny",
    "TransformersPolicy": "pipeline.models.transformers_backend",
    "build_tiny": "pipeline.models.tiny",
    "load_checkpoint": "pipeline.models.checkpoints",
    "load_optimizer_tensors": "pipeline.models.checkpoints",
    "manifest_sha256": "pipeline.models.checkpoints",
    "optimizer_tensors": "pipeline.models.checkpoints",
    "save_checkpoint": "pipeline.models.checkpoints",
    "tokenizer_corpus": "pipeline.models.tiny",
    "train_tokenizer": "pipeline.models.tiny",
    "weight_hash": "pipeline.models.checkpoints",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
