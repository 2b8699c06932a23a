"""Throughput of one actor GRPO step and one extractor CISPO step on the tiny CPU preset, and our GRPO loss against
TRL's on the same tensors when TRL is installed.

    .venv/bin/python benchmarks/train_step.py --quick   # one step of each after a warm-up step, under a minute
    .venv/bin/python benchmarks/train_step.py           # the paper-shaped batch (8 groups x 8, 3 turns), 3 steps each

The batches are real: trajectories and generations sampled from the tiny preset itself (`pipeline.rl.synthetic`),
so the recorded log-probs are genuine and the ratio starts at ~1. A step is `pipeline.rl.policy_step.policy_step`
exactly as the trainers run it (deterministic CPU mode, micro-batches, AdamW, grad clip), timed from the first
forward to the optimiser step. Prints `name=value` lines:
- `tokens_per_s_actor`, `tokens_per_s_extractor`: prompt + response tokens through the model per second of a step;
- `loss_tokens_per_s_actor`, `loss_tokens_per_s_extractor`: response tokens (those carrying loss) per second;
- `step_s_actor`, `step_s_extractor`, `tokens_actor`, `tokens_extractor`, `params`, `threads`;
- `trl_loss_ratio` (our GRPO loss / TRL's GRPO loss on the same log-probs and advantages, `seq-mean-token-mean`,
  which is TRL's `loss_type="grpo"`), or `trl_loss_ratio=unavailable` with the reason when TRL is not installed
  (`pip install -e ".[trl]"`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.trl_inputs import trl_inputs
from pipeline.models.tiny import build_tiny
from pipeline.rl.advantages import batch_mean_advantages
from pipeline.rl.losses import policy_loss
from pipeline.rl.policy_step import Sample, deterministic_torch, make_optimizer, policy_step
from pipeline.rl.settings import ActorTrainerSettings
from pipeline.rl.synthetic import synthetic_extractions, synthetic_trajectories
from pipeline.rl.trainer import actor_advantages, actor_samples
from pipeline.settings import TinyModelSettings


def timed_steps(policy, samples: list[Sample], variant: str, steps: int, micro_batch_size: int) -> list[float]:
    optimizer = make_optimizer(policy.model, 1e-5, 0.0, (0.9, 0.999), 1e-8)
    durations = []
    for _ in range(steps + 1):  # the first one warms up allocators and kernels
        started = time.perf_counter()
        policy_step(policy, policy.model, optimizer, samples, variant=variant, aggregation="token-mean",
                    eps_low=0.2 if variant == "grpo" else 0.1, eps_high=0.2 if variant == "grpo" else 0.1,
                    temperature=1.0, micro_batch_size=micro_batch_size, max_grad_norm=1.0)
        durations.append(time.perf_counter() - started)
    return durations[1:]


def trl_loss_ratio(policy, samples: list[Sample]) -> str:
    """Our GRPO loss over TRL's `GRPOTrainer._compute_loss` (loss_type 'grpo') on the same tensors."""
    try:
        from trl import GRPOTrainer
    except ImportError as exc:
        return f"unavailable (TRL not installed: {exc.__class__.__name__})"
    import types
    from collections import defaultdict

    chunk = [s for s in samples if s.response_ids][:8]
    inputs = trl_inputs(chunk, policy.tokenizer.pad_token_id)
    width_r = inputs["completion_ids"].shape[1]
    old, advantages, completion_mask = inputs["old_per_token_logps"], inputs["advantages"], inputs["completion_mask"]
    with torch.no_grad():
        logps = policy.token_logprobs([s.prompt_ids for s in chunk], [s.response_ids for s in chunk], 1.0)
        ours = torch.zeros(len(chunk), width_r)
        for i, row in enumerate(logps):
            ours[i, : len(row)] = row
        our_loss = policy_loss("grpo", ours, old, advantages, completion_mask, eps_low=0.2, eps_high=0.2,
                               aggregation="seq-mean-token-mean").loss.item()
    # A stand-in for the trainer object: only what `_compute_loss` reads for loss_type='grpo', beta 0, no extras.
    stand_in = types.SimpleNamespace(
        loss_type="grpo", epsilon_low=0.2, epsilon_high=0.2, beta=0.0, top_entropy_quantile=1.0,
        aux_loss_enabled=False, off_policy_mask_threshold=None, importance_sampling_level="token",
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False), model=policy.model,
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)), use_vllm=False,
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                          reduce=lambda x, **_: x),
        temperature=1.0,
    )
    stand_in._get_per_token_logps_and_entropies = (
        lambda model, input_ids, attention_mask, logits_to_keep, **_: (ours, torch.zeros_like(ours), None))
    policy.model.eval()
    try:
        with torch.no_grad():
            trl_loss = GRPOTrainer._compute_loss(stand_in, policy.model, inputs)
    except Exception as exc:  # noqa: BLE001 - TRL's internals moved; say so instead of failing the benchmark
        return f"unavailable (TRL {exc.__class__.__name__}: {exc})"
    return f"{our_loss / float(trl_loss):.6f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small batch, one timed step each (< 1 minute)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    deterministic_torch(args.threads)
    groups, group_size, turns, steps, extractions = (4, 8, 2, 1, 32) if args.quick else (8, 8, 3, 3, 64)
    tiny = TinyModelSettings()
    actor = build_tiny(tiny)
    trajectories = sorted(
        synthetic_trajectories(actor, run_id="bench", step=1, groups=groups, group_size=group_size, seed=0,
                               turns=turns, max_new_tokens=16),
        key=lambda t: (t.group_id, t.slot))
    advantages = actor_advantages(trajectories, ActorTrainerSettings())
    # Every sample trains (a zero advantage would be skipped): give zero-variance groups a small signal.
    actor_batch = [Sample(s.prompt_ids, s.response_ids, s.behaviour_logprobs, s.advantage or 0.1)
                   for s in actor_samples(trajectories, advantages.tolist())]
    extractor = build_tiny(TinyModelSettings(seed=1))
    generations = synthetic_extractions(extractor, run_id="bench", count=extractions, seed=0, max_new_tokens=48)
    rewards = torch.tensor([1.0 if i % 3 else -1.0 for i in range(extractions)])
    extractor_batch = [Sample(tuple(g.prompt_token_ids), tuple(g.response_token_ids), tuple(g.sampling_logprobs), a)
                       for g, a in zip(generations, batch_mean_advantages(rewards).tolist(), strict=True)]

    params = sum(p.numel() for p in actor.model.parameters())
    print(f"params={params}")
    print(f"threads={args.threads}")
    for role, policy, batch, variant in (("actor", actor, actor_batch, "grpo"),
                                         ("extractor", extractor, extractor_batch, "cispo")):
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch)
        loss_tokens = sum(len(s.response_ids) for s in batch)
        seconds = statistics.median(timed_steps(policy, batch, variant, steps, micro_batch_size=8))
        print(f"tokens_{role}={tokens}")
        print(f"step_s_{role}={seconds:.3f}")
        print(f"tokens_per_s_{role}={tokens / seconds:.0f}")
        print(f"loss_tokens_per_s_{role}={loss_tokens / seconds:.0f}")
    print(f"trl_loss_ratio={trl_loss_ratio(actor, actor_batch)}")


if __name__ == "__main__":
    main()
