"""The tensors TRL's `GRPOTrainer` reads for a batch, built from our samples (shared by `train_step.py` and
`smol.py`, which time or compare TRL's step on the same samples as ours)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.rl.policy_step import Sample


def trl_inputs(samples: Sequence[Sample], pad: int) -> dict[str, torch.Tensor]:
    """Prompts left-padded, completions right-padded, their masks, the behaviour log-probs and the advantages."""
    width_p = max(len(s.prompt_ids) for s in samples)
    width_r = max(len(s.response_ids) for s in samples)
    return {
        "prompt_ids": torch.tensor([[pad] * (width_p - len(s.prompt_ids)) + list(s.prompt_ids) for s in samples]),
        "prompt_mask": torch.tensor([[0] * (width_p - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in samples]),
        "completion_ids": torch.tensor([list(s.response_ids) + [pad] * (width_r - len(s.response_ids))
                                        for s in samples]),
        "completion_mask": torch.tensor([[1] * len(s.response_ids) + [0] * (width_r - len(s.response_ids))
                                         for s in samples]),
        "old_per_token_logps": torch.tensor([list(s.behaviour_logprobs) + [0.0] * (width_r - len(s.response_ids))
                                             for s in samples]),
        "advantages": torch.tensor([s.advantage for s in samples]),
    }
