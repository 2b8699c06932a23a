"""One role's update step, built the same way wherever a step runs: the trainer workers (`PolicyTrainer.step`,
`pipeline.rl.trainer`), `crl replay train` (`pipeline.audit.training_replay`) and `benchmarks/gpu_check.py`. It needs
torch, transformers, peft and pydantic only (no broker client), so it runs wherever a model can.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeline.models.checkpoints import LoadedCheckpoint, load_optimizer_tensors
from pipeline.models.lora import is_lora, with_lora
from pipeline.models.transformers_backend import TransformersPolicy
from pipeline.rl.policy_step import GradientGroup, Sample, StepResult, deterministic_torch, make_optimizer, policy_step
from pipeline.rl.settings import TrainerSettings


class TrainerStep:
    """One role's optimiser and update, built the same way wherever a step runs: the trainer workers
    (`PolicyTrainer.step`) and `crl replay train` (`pipeline.audit.training_replay`) both construct it here and call
    `run`, so a replay cannot drift from training.

    Deterministic CPU kernels at the recorded thread count; a full model is wrapped in a seeded LoRA adapter first
    when the settings ask for one (`model.lora.rank > 0`); gradient checkpointing when set; AdamW from the trainer
    settings over what trains, resumed from the optimiser state a checkpoint holds when there is one; log-probs
    recomputed at the sampling `temperature` of the role's generation section.
    """

    def __init__(self, policy: TransformersPolicy, settings: TrainerSettings, temperature: float,
                 optimizer_tensors: dict[str, torch.Tensor] | None = None,
                 optimizer_param_groups: list[dict[str, Any]] | None = None) -> None:
        deterministic_torch(settings.threads)
        # Gradients a warm start left behind would count in the first step's clipping norm (and hold memory);
        # a policy loaded from disk has none, so training and replay start alike.
        policy.model.zero_grad(set_to_none=True)
        lora = settings.model.lora
        if lora.rank > 0 and not is_lora(policy.model):
            policy = with_lora(policy, lora)
        if settings.model.gradient_checkpointing:
            policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.policy = policy
        self.settings = settings
        self.temperature = temperature
        self.optimizer = make_optimizer(policy.model, settings.lr, settings.weight_decay, settings.adam_betas,
                                        settings.adam_eps)
        if optimizer_tensors is not None:
            load_optimizer_tensors(self.optimizer, optimizer_tensors, optimizer_param_groups or [])

    @classmethod
    def resumed(cls, loaded: LoadedCheckpoint, settings: TrainerSettings, temperature: float) -> TrainerStep:
        """The step that continues from a loaded checkpoint: its weights and its optimiser state."""
        return cls(loaded.policy, settings, temperature, loaded.optimizer_tensors, loaded.optimizer_param_groups)

    def run(self, samples: Sequence[Sample], variant: str, group: GradientGroup | None = None) -> StepResult:
        """One update over `samples` with loss `variant` ("grpo" | "cispo"); with `model.precision` bfloat16 the
        forward and backward passes run under CPU autocast (the weights, gradients and AdamW stay float32). With a
        `group`, this rank trains its shard and the gradients are summed over the ranks (`policy_step`)."""
        s = self.settings
        with torch.autocast(self.policy.device.type, dtype=torch.bfloat16,
                            enabled=s.model.precision == "bfloat16"):
            return policy_step(self.policy, self.policy.model, self.optimizer, samples, variant=variant,
                               aggregation=s.aggregation, eps_low=s.eps_low, eps_high=s.eps_high,
                               temperature=self.temperature, micro_batch_size=s.micro_batch_size,
                               max_grad_norm=s.max_grad_norm, norm_tokens=s.norm_tokens, group=group)
