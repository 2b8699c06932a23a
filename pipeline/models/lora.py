"""LoRA adapters (peft) for either role: the trainer updates the adapter only, checkpoints after version 0 hold the
adapter alone and name their base checkpoint by its manifest sha256, and workers apply a newer adapter to the base
they already hold.

    model: {preset: smollm2-135m-instruct, lora: {rank: 8, alpha: 16}}

Version 0 of a LoRA run is the base model as a full checkpoint (after its warm start). The trainer then wraps it
(`with_lora`): low-rank A/B matrices on `target_modules`, A initialised from `lora.seed` (the caller's RNG stream is
left where it was), B zero, so version 0 and the wrapped model compute the same function. The same wrapping runs in
`crl replay train`, which therefore reproduces every step's weight hash as for full fine-tuning. The weight hash of a
LoRA version covers the whole assembled model (base and adapter tensors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from pipeline.errors import CheckpointError
from pipeline.models.settings import LoraSettings

if TYPE_CHECKING:
    from peft import PeftModel

    from pipeline.models.transformers_backend import TransformersPolicy

ADAPTER_FILE = "adapter.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def lora_config(settings: LoraSettings) -> dict[str, Any]:
    """The adapter's configuration as JSON-able data (what an adapter checkpoint records)."""
    # No adapter dropout: it would draw from the global RNG and a replay could not reproduce the step.
    return {"r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": 0.0,
            "target_modules": sorted(settings.target_modules), "bias": "none", "task_type": "CAUSAL_LM",
            "seed": settings.seed}


def wrap(model: torch.nn.Module, config: dict[str, Any]) -> PeftModel:
    """`model` with a LoRA adapter of `config` (from `lora_config` or an adapter checkpoint), seeded."""
    from peft import LoraConfig, get_peft_model

    options = {key: value for key, value in config.items() if key != "seed"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(config["seed"]))
        # `PeftMixedModel` only comes back for `mixed=True`
        return cast("PeftModel", get_peft_model(model, LoraConfig(**options)))


def with_lora(policy: TransformersPolicy, settings: LoraSettings) -> TransformersPolicy:
    """`policy` with its model wrapped in a fresh adapter; only the adapter's parameters require grad."""
    from pipeline.models.transformers_backend import TransformersPolicy

    config = lora_config(settings)
    wrapped = TransformersPolicy(wrap(policy.model, config), policy.tokenizer, device=str(policy.device),
                                 micro_batch_size=policy.micro_batch_size)
    wrapped.base_checkpoint, wrapped.adapter_config = policy.base_checkpoint, config
    return wrapped


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the adapter's tensors (peft's names, without the adapter name), contiguous on the CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    return {name: tensor.detach().cpu().contiguous().clone() for name, tensor in state.items()}


def load_adapter(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Set the adapter of a wrapped `model` to `tensors` in place (the base weights are untouched)."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, tensors)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise CheckpointError(f"adapter tensors do not fit the model: unexpected {sorted(unexpected)[:5]}")
