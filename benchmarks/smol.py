"""SmolLM2-135M-Instruct on this CPU: generation throughput on real chat-formatted actor prompts, and one GRPO step
with full fine-tuning against one with LoRA, side by side in one run (each mode in its own process, so its peak
memory is its own).

    .venv/bin/python benchmarks/smol.py --quick    # 4 prompts, 1 timed step per mode after a warm-up step (~3 min)
    .venv/bin/python benchmarks/smol.py            # 8 prompts, 2 timed steps per mode

The prompts are what the rollout worker sends: MiniHack Room observations through `render_actor_prompt`, given as
the user message of SmolLM2's chat template after `ACTOR_SYSTEM` (`PolicyModel.prompt_ids`). The step is
`pipeline.rl.training.TrainerStep.run` exactly as the actor trainer runs it (deterministic CPU mode, the trainer's
micro-batch, AdamW, grad clip) on samples made of those prompts, the sampled responses and their recorded log-probs.
Prints `name=value` lines:
- `gen_new_tokens_per_s`, `gen_prompt_tokens_per_s`, `gen_s`, `prompt_tokens_mean`: one batched generation;
- `step_tokens_per_s_full`, `step_tokens_per_s_lora`, `step_s_full`, `step_s_lora`: prompt + response tokens through
  the model per second of an update;
- `peak_rss_mb_full`, `peak_rss_mb_lora`: the process's peak resident memory (model load, generation, our steps;
  taken before TRL's step runs in the same process);
- `lora_speedup` (full step time / LoRA step time) and `lora_memory_ratio` (LoRA peak / full peak);
- `trainable_params_full`, `trainable_params_lora`, `threads`;
- `trl_step_s_full`: the same full fine-tuning step on the same model and samples computed by TRL's `GRPOTrainer`
  (its forward and its GRPO loss, one pass over the whole batch), then the same clipping and AdamW; and
  `ours_over_trl_step_time` (our step time / TRL's: below 1 means ours is faster), or `unavailable` with the reason
  when TRL is not installed (`pip install -e ".[trl]"`) or its internals moved.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.trl_inputs import trl_inputs  # noqa: E402


def measure(mode: str, prompts: int, steps: int, threads: int) -> dict:
    from pipeline.actor.episodes import ACTOR_SYSTEM, render_actor_prompt
    from pipeline.envs.registry import make_env
    from pipeline.envs.settings import EnvSettings
    from pipeline.models.base import SamplingParams
    from pipeline.models.settings import LoraSettings, ModelSettings
    from pipeline.rl.settings import ActorTrainerSettings
    from pipeline.rl.training import TrainerStep, initial_policy
    from pipeline.rl.update import Sample

    lora = LoraSettings(rank=8, alpha=16) if mode == "lora" else LoraSettings()
    settings = ActorTrainerSettings(model=ModelSettings(preset="smollm2-135m-instruct", lora=lora), lr=1e-5,
                                    threads=threads, micro_batch_size=4)
    policy = initial_policy(settings.model)
    env = make_env("MiniHack-Room-Random-5x5-v0", EnvSettings(), max_turns=20)
    try:
        texts = []
        for seed in range(prompts):
            goal, observation = env.reset(seed)
            texts.append(render_actor_prompt("MiniHack-Room-Random-5x5-v0", goal, observation))
    finally:
        env.close()
    prompt_ids = [policy.prompt_ids(text, ACTOR_SYSTEM) for text in texts]
    update = TrainerStep(policy, settings, temperature=1.0)  # wraps the LoRA adapter when asked (identity at start)
    started = time.perf_counter()
    generations = update.policy.generate(prompt_ids, SamplingParams(max_new_tokens=16, temperature=1.0), seed=0)
    gen_s = time.perf_counter() - started
    samples = [Sample(tuple(g.prompt_token_ids), tuple(g.token_ids), tuple(g.logprobs), 1.0 if i % 2 else -1.0)
               for i, g in enumerate(generations)]
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    durations = []
    for _ in range(steps + 1):  # the first warms up allocators and kernels
        started = time.perf_counter()
        update.run(samples, "grpo")
        durations.append(time.perf_counter() - started)
    step_s = min(durations[1:])
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before TRL's step, ours alone
    trl = trl_step_s(update.policy, samples, steps) if mode == "full" else None
    return {
        "trl_step_s": trl,
        "gen_s": gen_s, "gen_new_tokens": sum(len(g.token_ids) for g in generations),
        "prompt_tokens": sum(len(p) for p in prompt_ids), "prompts": len(prompt_ids),
        "step_s": step_s, "step_tokens": tokens,
        "trainable_params": sum(p.numel() for p in update.policy.model.parameters() if p.requires_grad),
        "peak_rss_mb": peak_rss_mb,
    }


def trl_step_s(policy, samples, steps: int) -> float | str:
    """One GRPO step as TRL's `GRPOTrainer` computes it (its own forward, `_get_per_token_logps_and_entropies`, and
    its loss, `_compute_loss`, loss_type 'grpo', beta 0), then backward, clipping and AdamW as ours: the best time of
    `steps`, or why it could not run. The trainer object is a stand-in holding only what those two methods read."""
    try:
        from trl import GRPOTrainer
        from trl.trainer import add_fused_lm_head
    except ImportError as exc:
        return f"unavailable (TRL not installed: {exc.__class__.__name__}; pip install -e '.[trl]')"
    import contextlib
    import types
    from collections import defaultdict

    import torch

    inputs = trl_inputs(samples, policy.tokenizer.pad_token_id)
    stand_in = types.SimpleNamespace(
        loss_type="grpo", epsilon_low=0.2, epsilon_high=0.2, beta=0.0, top_entropy_quantile=1.0,
        aux_loss_enabled=False, off_policy_mask_threshold=None, importance_sampling_level="token",
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False), model=policy.model,
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, use_vllm=False, temperature=1.0,
        _metrics=defaultdict(lambda: defaultdict(list)), max_completion_length=inputs["completion_ids"].shape[1],
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                          reduce=lambda x, **_: x, sync_gradients=True,
                                          autocast=contextlib.nullcontext),
    )
    stand_in._get_per_token_logps_and_entropies = types.MethodType(
        GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__, stand_in)
    optimizer = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=1e-5, foreach=False)
    durations = []
    try:
        # What GRPOTrainer.__init__ does to the model: log-probs from a tiled LM head, no full logits.
        add_fused_lm_head(policy.model, temperature=1.0, outputs=("log_probs", "entropy"))
        for _ in range(steps + 1):
            started = time.perf_counter()
            policy.model.train()
            optimizer.zero_grad(set_to_none=True)
            loss = GRPOTrainer._compute_loss(stand_in, policy.model, inputs)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
            optimizer.step()
            durations.append(time.perf_counter() - started)
    except Exception as exc:  # noqa: BLE001 - TRL's internals move between releases; say so instead of failing
        return f"unavailable (TRL {exc.__class__.__name__}: {str(exc)[:160]})"
    return min(durations[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts, 1 timed step per mode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    prompts, steps = (4, 1) if args.quick else (8, 2)
    if args.child:
        print(json.dumps(measure(args.child, prompts, steps, args.threads)))
        return
    results = {}
    for mode in ("full", "lora"):
        command = [sys.executable, __file__, "--child", mode, "--threads", str(args.threads)]
        command += ["--quick"] if args.quick else []
        out = subprocess.run(command, check=True, capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    full, lora = results["full"], results["lora"]
    lines = {
        "gen_new_tokens_per_s": full["gen_new_tokens"] / full["gen_s"],
        "gen_prompt_tokens_per_s": full["prompt_tokens"] / full["gen_s"],
        "gen_s": full["gen_s"], "prompt_tokens_mean": full["prompt_tokens"] / full["prompts"],
        "step_tokens_per_s_full": full["step_tokens"] / full["step_s"],
        "step_tokens_per_s_lora": lora["step_tokens"] / lora["step_s"],
        "step_s_full": full["step_s"], "step_s_lora": lora["step_s"],
        "peak_rss_mb_full": full["peak_rss_mb"], "peak_rss_mb_lora": lora["peak_rss_mb"],
        "lora_speedup": full["step_s"] / lora["step_s"],
        "lora_memory_ratio": lora["peak_rss_mb"] / full["peak_rss_mb"],
        "trainable_params_full": full["trainable_params"], "trainable_params_lora": lora["trainable_params"],
        "trl_step_s_full": full["trl_step_s"],
        "ours_over_trl_step_time": (full["step_s"] / full["trl_step_s"] if isinstance(full["trl_step_s"], float)
                                    else full["trl_step_s"]),
        "threads": args.threads,
    }
    for name, value in lines.items():
        print(f"{name}={value:.3f}" if isinstance(value, float) else f"{name}={value}")


if __name__ == "__main__":
    main()
