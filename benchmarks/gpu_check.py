"""The project's CUDA paths on one NVIDIA GPU: generating with the transformers backend in bfloat16, a GRPO and a
CISPO step, and handing a full and a LoRA version to a generating worker in place.

    python benchmarks/gpu_check.py             # on a machine with one NVIDIA GPU (a few minutes; at most 8)
    python benchmarks/gpu_check.py --dry-run   # the same steps on this machine's CPU, small shapes (~10 s)

Meant for a machine that is offline and has torch, transformers, peft and safetensors installed. The project's code
needs pydantic besides (and its three small dependencies): `make gpu-wheels` downloads their wheels for CPython
3.10-3.13 into `.gpu-wheels/` (about 9 MB); bring that folder with the source tree, then run there:

    pip install --no-index --find-links .gpu-wheels pydantic && python benchmarks/gpu_check.py

No model is downloaded or carried: the model has SmolLM2-135M's architecture (Llama, 30 layers, hidden 576, 9
attention heads over 3 key/value heads, MLP 1536, 49,152 tokens, tied embeddings, rope theta 100,000) with random
weights from a fixed seed, and a word-level tokenizer over made-up tokens; prompts are token ids. Throughput and the
code paths are those of SmolLM2; what the model says is noise. `--dry-run` keeps the shapes of a layer but builds 2
layers and 4,096 tokens, and runs smaller batches, so the test suite can run it.

Every part runs even when an earlier one failed. Prints `name=value` lines:
- `device`, `device_name`, `torch`, `transformers`, `peft`, `params`;
- per generation batch B (8, 64, 256; --dry-run 8, 16): `gen_new_tokens_per_s_b<B>`, `gen_s_b<B>` (prompts of
  `--prompt-tokens` ids, up to `--new-tokens` new ones at temperature 1, one micro-batch), and at the first B
  `gen_logprob_mismatch_b<B>`: the mean absolute difference between the log-probs recorded while sampling from the
  bfloat16 copy and the float32 policy's recomputation of them (what the trainers' importance ratios start from);
- `train_grpo_s`, `train_grpo_loss`, `train_grpo_grad_norm`, and the same for `cispo`: one step of `TrainerStep`
  (bfloat16 autocast, deterministic kernels, AdamW, full fine-tuning) over the first batch's samples, as groups of
  8 with half of each guided, rewards drawn from a fixed seed; `train_weights_changed`;
- `handoff_full_s`, `handoff_full_in_place`, `handoff_full_matches`: a full version saved by the trainer and loaded
  into the bfloat16 copy a worker holds (`load_for_generation`, what `load_published` runs): the same tensors
  (data pointers) as before, holding the trainer's weights rounded to bfloat16;
- `handoff_lora_s`, `handoff_lora_in_place`, `handoff_lora_matches`: a rank-8 LoRA version on that base, loaded
  onto the float32 policy under the worker's copy (its adapter set in place, then merged into the bfloat16 copy
  the worker holds, in place too);
- `<part>_ok` for generation, train and handoff (with `<part>_error` when not), `peak_memory_gib` (CUDA),
  `total_s`, and `gpu_check_ok`. The exit status is 1 when a part failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

try:
    import pydantic  # noqa: F401  (the project's settings and events are pydantic models)
except ImportError:  # pragma: no cover - only on a machine that lacks it
    raise SystemExit("gpu_check needs pydantic: run `make gpu-wheels` where PyPI is reachable, bring .gpu-wheels/ "
                     "along, and `pip install --no-index --find-links .gpu-wheels pydantic` there") from None

from pipeline.models.checkpoints import load_for_generation, save_checkpoint
from pipeline.models.settings import LoraSettings, ModelSettings
from pipeline.models.transformers_backend import TransformersPolicy
from pipeline.rl.advantages import subgroup_advantages
from pipeline.rl.policy_step import Sample
from pipeline.rl.settings import TrainerSettings
from pipeline.rl.trainer_step import TrainerStep

SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
"""SmolLM2-135M-Instruct's configuration (its config.json), the fields that set shapes and arithmetic."""

PAD, BOS, EOS = 0, 1, 2
GROUP = 8


@dataclass(frozen=True)
class Plan:
    device: str
    layers: int
    vocab: int
    batches: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int


def smollm2_shaped(plan: Plan, seed: int = 0) -> TransformersPolicy:
    """A float32 policy of SmolLM2-135M's architecture (`plan.layers` layers, `plan.vocab` tokens), random weights
    from `seed`, with a word-level tokenizer over made-up tokens `t<i>`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    names = ["<pad>", "<s>", "</s>"] + [f"t{i}" for i in range(3, plan.vocab)]
    backend = Tokenizer(WordLevel({name: i for i, name in enumerate(names)}, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": plan.layers, "vocab_size": plan.vocab},
                         pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()
    return TransformersPolicy(model, tokenizer, device=plan.device)


def _prompts(plan: Plan, count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, plan.vocab, (count, plan.prompt_tokens), generator=generator)
    return [[BOS, *row] for row in ids.tolist()]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_generation(plan: Plan, trainer_policy: TransformersPolicy, out: dict[str, Any]) -> list[Sample]:
    """Generate at every batch size with the bfloat16 copy; returns the first batch as training samples."""
    from pipeline.models.base import SamplingParams

    worker = trainer_policy.for_generation("bfloat16")
    sampling = SamplingParams(max_new_tokens=plan.new_tokens, temperature=1.0)
    worker.micro_batch_size = max(plan.batches)
    worker.generate(_prompts(plan, 2, seed=99), SamplingParams(max_new_tokens=4), seeds=[0, 1])  # kernels warm
    first: list[Any] = []
    for batch in plan.batches:
        prompts = _prompts(plan, batch, seed=batch)
        _sync(plan.device)
        started = time.perf_counter()
        generations = worker.generate(prompts, sampling, seeds=list(range(batch)))
        _sync(plan.device)
        spent = time.perf_counter() - started
        new = sum(len(g.token_ids) for g in generations)
        out[f"gen_new_tokens_per_s_b{batch}"] = new / spent
        out[f"gen_s_b{batch}"] = spent
        if not first:
            first = generations
            with torch.no_grad():
                rescored = trainer_policy.token_logprobs([g.prompt_token_ids for g in generations],
                                                         [g.token_ids for g in generations])
            differences = [abs(float(value) - recorded) for g, row in zip(generations, rescored, strict=True)
                           for value, recorded in zip(row.tolist(), g.logprobs, strict=True)]
            out[f"gen_logprob_mismatch_b{batch}"] = sum(differences) / len(differences)
    generator = torch.Generator().manual_seed(7)
    rewards = torch.randint(0, 2, (len(first),), generator=generator).float()
    group_ids = torch.arange(len(first)) // GROUP
    guided = (torch.arange(len(first)) % GROUP) < GROUP // 2
    advantages = subgroup_advantages(rewards, group_ids, guided).tolist()
    return [Sample(g.prompt_token_ids, g.token_ids, g.logprobs, advantage, sequence=i)
            for i, (g, advantage) in enumerate(zip(first, advantages, strict=True))]


def _settings(plan: Plan, lora_rank: int = 0) -> TrainerSettings:
    return TrainerSettings(model=ModelSettings(device=plan.device, precision="bfloat16",
                                               lora=LoraSettings(rank=lora_rank, alpha=2 * lora_rank or 16)),
                           lr=1e-4, micro_batch_size=8)


def check_training(plan: Plan, policy: TransformersPolicy, samples: list[Sample], out: dict[str, Any]) -> TrainerStep:
    if not any(s.advantage for s in samples):
        raise RuntimeError("every advantage is 0: the drawn rewards left no subgroup with a signal")
    step = TrainerStep(policy, _settings(plan), temperature=1.0)
    before = {name: tensor.detach().clone() for name, tensor in step.policy.model.state_dict().items()}
    for variant in ("grpo", "cispo"):
        _sync(plan.device)
        started = time.perf_counter()
        result = step.run(samples, variant)
        _sync(plan.device)
        out[f"train_{variant}_s"] = time.perf_counter() - started
        out[f"train_{variant}_loss"] = result.loss
        out[f"train_{variant}_grad_norm"] = result.grad_norm
        if not (torch.isfinite(torch.tensor(result.loss)) and torch.isfinite(torch.tensor(result.grad_norm))):
            raise RuntimeError(f"{variant} step: loss {result.loss}, grad norm {result.grad_norm}")
    after = step.policy.model.state_dict()
    out["train_weights_changed"] = any(not torch.equal(before[name], after[name]) for name in before)
    return step


def _pointers(policy: TransformersPolicy | None) -> list[int]:
    """Where each tensor of the policy's state lives: unchanged when a version was loaded in place."""
    return [] if policy is None else [t.data_ptr() for t in policy.model.state_dict().values()]


def _matches(worker: TransformersPolicy, trainer: TransformersPolicy) -> bool:
    """The worker's weights are the trainer's as the worker keeps them (rounded to its dtype; a LoRA adapter merged)."""
    from peft import PeftModel

    source: Any = trainer.model
    if isinstance(source, PeftModel):
        import copy

        source = copy.deepcopy(source).merge_and_unload()
    held = worker.model.state_dict()
    return all(torch.equal(held[name], tensor.to(held[name].dtype)) for name, tensor in source.state_dict().items())


def check_handoff(plan: Plan, step: TrainerStep, samples: list[Sample], root: Path, out: dict[str, Any]) -> None:
    base = save_checkpoint(root / "v000000", step.policy)
    held = load_for_generation(base.path, base.manifest_sha256, plan.device, precision="bfloat16")
    pointers = _pointers(held)
    step.run(samples, "grpo")
    _sync(plan.device)
    started = time.perf_counter()
    full = save_checkpoint(root / "v000001", step.policy)
    loaded = load_for_generation(full.path, full.manifest_sha256, plan.device, current=held, precision="bfloat16")
    _sync(plan.device)
    out["handoff_full_s"] = time.perf_counter() - started
    out["handoff_full_in_place"] = loaded is held and _pointers(loaded) == pointers
    out["handoff_full_matches"] = _matches(loaded, step.policy)

    lora_step = TrainerStep(step.policy, _settings(plan, lora_rank=8), temperature=1.0)
    lora_step.run(samples, "grpo")
    first = save_checkpoint(root / "v000002", lora_step.policy, base=full)
    worker = load_for_generation(first.path, first.manifest_sha256, plan.device, precision="bfloat16")
    beneath, pointers, copy_pointers = worker.full_precision, _pointers(worker.full_precision), _pointers(worker)
    lora_step.run(samples, "grpo")
    _sync(plan.device)
    started = time.perf_counter()
    info = save_checkpoint(root / "v000003", lora_step.policy, base=full)
    loaded = load_for_generation(info.path, info.manifest_sha256, plan.device, current=worker, precision="bfloat16")
    _sync(plan.device)
    out["handoff_lora_s"] = time.perf_counter() - started
    out["handoff_lora_in_place"] = (beneath is not None and loaded.full_precision is beneath
                                    and _pointers(beneath) == pointers
                                    and loaded is worker and _pointers(loaded) == copy_pointers)
    out["handoff_lora_matches"] = _matches(loaded, lora_step.policy)
    if not all(out[f"handoff_{kind}_{what}"] for kind in ("full", "lora") for what in ("in_place", "matches")):
        raise RuntimeError("a version was not handed over in place, or not with the trainer's weights")


def _part(name: str, out: dict[str, Any], action: Callable[[], Any]) -> Any:
    try:
        result = action()
    except Exception as exc:  # noqa: BLE001 - every part runs and reports, whatever failed before it
        traceback.print_exc()
        out[f"{name}_ok"] = False
        out[f"{name}_error"] = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
        return None
    out[f"{name}_ok"] = True
    return result


def run(plan: Plan) -> dict[str, Any]:
    import peft
    import transformers

    started = time.perf_counter()
    out: dict[str, Any] = {"device": plan.device, "torch": torch.__version__, "transformers": transformers.__version__,
                           "peft": peft.__version__}
    if plan.device.startswith("cuda"):
        out["device_name"] = torch.cuda.get_device_name(0)
        torch.cuda.reset_peak_memory_stats()
    else:
        out["device_name"] = "cpu"
    policy = smollm2_shaped(plan)
    out["params"] = sum(p.numel() for p in policy.model.parameters())
    samples = _part("generation", out, lambda: check_generation(plan, policy, out))
    if samples is None:  # the training steps still run, on samples of the float32 policy
        samples = _part("generation_fallback", out, lambda: _fallback_samples(plan, policy))
    step = _part("train", out, lambda: check_training(plan, policy, samples or [], out))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        _part("handoff", out, lambda: check_handoff(plan, step or TrainerStep(policy, _settings(plan), 1.0),
                                                    samples or [], Path(scratch), out))
    if plan.device.startswith("cuda"):
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out["total_s"] = time.perf_counter() - started
    out["gpu_check_ok"] = all(out.get(f"{part}_ok") for part in ("generation", "train", "handoff"))
    return out


def _fallback_samples(plan: Plan, policy: TransformersPolicy) -> list[Sample]:
    from pipeline.models.base import SamplingParams

    generations = policy.generate(_prompts(plan, GROUP, seed=1), SamplingParams(max_new_tokens=plan.new_tokens),
                                  seeds=list(range(GROUP)))
    return [Sample(g.prompt_token_ids, g.token_ids, g.logprobs, 1.0 if i % 2 else -1.0, sequence=i)
            for i, g in enumerate(generations)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the CPU half: the same steps on the CPU, small shapes")
    parser.add_argument("--device", default=None, help="torch device (default: cuda; --dry-run: cpu)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length in tokens (256; --dry-run 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="most new tokens per row (64; --dry-run 8)")
    args = parser.parse_args(argv)
    device = args.device or ("cpu" if args.dry_run else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"no CUDA device here (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                         "run with --dry-run for the CPU half")
    if args.dry_run:
        plan = Plan(device, layers=2, vocab=4096, batches=(GROUP, 2 * GROUP), prompt_tokens=args.prompt_tokens or 16,
                    new_tokens=args.new_tokens or 8)
        torch.set_num_threads(min(2, torch.get_num_threads()))
    else:
        plan = Plan(device, layers=SMOLLM2_135M["num_hidden_layers"], vocab=SMOLLM2_135M["vocab_size"],
                    batches=(8, 64, 256), prompt_tokens=args.prompt_tokens or 256, new_tokens=args.new_tokens or 64)
    out = run(plan)
    for name, value in out.items():
        print(f"{name}={value:.4f}" if isinstance(value, float) else f"{name}={value}", flush=True)
    return 0 if out["gpu_check_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
