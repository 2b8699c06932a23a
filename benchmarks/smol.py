"""SmolLM2-135M-Instruct on this CPU, before and after in one run: generation, the update, the loop, against the
machine's own limits measured by a probe in the same run.

    .venv/bin/python benchmarks/smol.py --quick    # 4 update prompts, 1 timed step per mode, one loop run (~15 min)
    .venv/bin/python benchmarks/smol.py            # 8 update prompts, 2 timed steps, the loop before and after too
    .venv/bin/python benchmarks/smol.py --decoding # the probe, generation before and after, llama.cpp (~4 min)

Each measurement runs in its own process (its peak memory is its own), on `--threads` threads (2):
- `probe`: the machine. `mem_read_gb_per_s` (summing a 1 GiB float32 tensor), `matmul_gflops_fp32` and
  `matmul_gflops_bf16` (a (512, 576) x (576, 1536) matmul: SmolLM2's hidden and MLP widths). From them, with the model's
  134.5M parameters N: `gen_new_tokens_per_s_bound` (a batch-8 decode step reads the bf16 weights once: 8 x read rate /
  2N bytes), `gen_prompt_tokens_per_s_bound` (prefill: bf16 rate / 2N FLOPs a token) and
  `step_tokens_per_s_lora_bound` (a LoRA update: forward 2N + backward through the activations 2N, no weight
  gradients for frozen layers: bf16 rate / 4N). Attention is left out of the bounds (short prompts), so they are
  a little high. Each figure below is printed with `_share` of its bound.
- `before`: the settings as they were before bfloat16 and sessions, measured again: float32 weights for generation
  and updates, every turn's prompt prefilled whole (the decode loop's preallocated cache is in both).
- `after`: what the SmolLM2 configs' `auto` picks on a CPU with AVX-512 BF16: generation from a bfloat16 copy
  (`generation.precision`), updates under bfloat16 autocast on float32 weights (`model.precision`), turns of an
  episode continuing their session.

Generation, for both: 8 real chat-formatted MiniHack Room actor prompts (`render_actor_prompt` under `ACTOR_SYSTEM`,
~130 tokens) in one batch. `gen_prompt_tokens_per_s`: prompt tokens over the time of a generation of one token (the
prefill); `gen_new_tokens_per_s`: tokens generated over the time of a 32-token generation less that prefill (rows
that end early still count as rows of the batch). `turn_prompt_tokens_run_share`: of a second turn's prompt tokens
(the first turn's prompt, its response, a new observation), the share that still runs through the model.

Updates: `pipeline.rl.trainer.TrainerStep.run` as the actor trainer runs it (deterministic CPU mode, micro-batch 4,
AdamW, grad clip) on samples of update prompts and their sampled 16-token responses; `step_tokens_per_s_*` counts
prompt + response tokens per second (best of the timed steps after one warm-up step). Modes: `full` (float32, full
fine-tuning, TRL's step beside it), `lora` (float32, LoRA rank 8: the before) and `lora_bf16` (the after).

`logprob_mismatch`: the after's recorded sampling log-probs (bfloat16 generation copy) against the trainer's
recomputation of the same tokens (float32 weights under bfloat16 autocast), mean absolute difference per token;
`logprob_mismatch_kl`: KL(rollout || trainer) of the two next-token distributions over the whole vocabulary, both
teacher-forced over the same sequences, mean per response token; `logprob_mismatch_fp32`: the same mean difference
with float32 on both sides (float rounding only).

`llamacpp_new_tokens_per_s`: what a user might run instead, side by side: llama.cpp (`llama-cpp-python`, built
from source by `pip install -e ".[llamacpp]"`; `unavailable` without it) decoding the preset's own GGUF file, its
Q4_1 weights as shipped, on the same 8 prompt token ids, batched as 8 sequences of one context, greedy, timed the same
way; `llamacpp_over_ours` is its ratio to `gen_new_tokens_per_s` (`_before`: to float32 generation, what the
SmolLM2 configs' `auto` picked on a CPU without AVX-512 BF16 before packing; `_packed`: to packed float32, what
it picks now). `llamacpp_logprob_mismatch`: its log-probs of
the tokens it chose against the float32 trainer's recomputation (mean absolute difference per token; the trainer's
weights are the same GGUF's, dequantized). Its arithmetic is 4-bit weights with 8-bit activations: every trained
version would have to be quantized again for it, so what it samples is not the policy the trainer updates.

`gen_packed_new_tokens_per_s`, `gen_packed_prompt_tokens_per_s`: float32 generation as a generating worker runs
it on a CPU without AVX-512 BF16 (what `auto` picks there), from a copy whose linear layers oneDNN has packed
(`pipeline.models.packed_linear`), sessions on; `gen_packed_speedup` is its decode rate over `_before`'s (float32,
plain weights) and `gen_packed_logprob_mismatch` its recorded log-probs against the trainer's (float32 both).

`gen_lora_new_tokens_per_s`: float32 decoding of a LoRA policy (rank 8, B drawn small so the adapter acts), as
a generating worker now runs it, from a float32 copy with the adapter merged and its layers packed
(`for_generation`); `_before`: through peft's adapter layers, as it ran before; both on the same 8 prompts,
alternately, best of two; `gen_lora_speedup` is their ratio. `gen_lora_same_rows` (rows whose 32 sampled tokens
agree) and `gen_lora_logprob_max_diff` (largest log-prob difference on those rows) compare the two;
`lora_merge_copy_s` is making the merged copy, `lora_merge_in_place_s` writing a new adapter into it in place,
packing included (what each later version costs a worker).

`loop_step_s`: one `crl run configs/smol-minihack-room.yaml` step of one group of 8 MiniHack episodes (SmolLM2 actor
and extractor, LoRA): the time between the actor's updates of steps 1 and 2 in a 3-step run (no evaluation, no
merge; the warm starts are cached under ~/.cache/complementary-rl and do not count). `loop_step_s_before`: the same
run with every precision float32 (without `--quick` only: it takes ~10 minutes a step).

Also printed, as before: `step_s_*`, `peak_rss_mb_*`, `lora_speedup` (full / float32 LoRA step time),
`lora_memory_ratio`, `trainable_params_*`, `trl_step_s_full` and `ours_over_trl_step_time` (TRL's `GRPOTrainer`
forward and loss on the same model and samples, or `unavailable` with the reason), `threads`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.trl_inputs import trl_inputs  # noqa: E402

PARAMETERS = 134_515_008
MODES = ("full", "lora", "lora_bf16")


def actor_prompts(count: int, policy) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from pipeline.actor.episodes import ACTOR_SYSTEM, render_actor_prompt
    from pipeline.envs.registry import make_env
    from pipeline.envs.settings import EnvSettings

    env = make_env("MiniHack-Room-Random-5x5-v0", EnvSettings(), max_turns=20)
    try:
        texts = []
        for seed in range(count):
            goal, observation = env.reset(seed)
            texts.append(render_actor_prompt("MiniHack-Room-Random-5x5-v0", goal, observation))
    finally:
        env.close()
    return [policy.prompt_ids(text, ACTOR_SYSTEM) for text in texts]


def probe(threads: int) -> dict:
    """The machine's memory read rate and matmul rates at SmolLM2's shapes."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(256 * 1024 * 1024)  # 1 GiB of float32
    data.sum()
    started = time.perf_counter()
    for _ in range(5):
        data.sum()
    read = 5 * data.numel() * 4 / (time.perf_counter() - started) / 1e9
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(512, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        for _ in range(5):
            a @ b
        repeats, started = 50, time.perf_counter()
        for _ in range(repeats):
            a @ b
        rates[name] = repeats * 2 * 512 * 576 * 1536 / (time.perf_counter() - started) / 1e9
    return {"mem_read_gb_per_s": read, "matmul_gflops_fp32": rates["fp32"], "matmul_gflops_bf16": rates["bf16"]}


def generation(precision: str, threads: int, packed: bool = False) -> dict:
    """Prefill and decode rates of one batch of 8 actor prompts, the session share of a second turn, and the
    log-prob mismatch against the trainer's recomputation. `packed`: float32 from the generation copy with packed
    linear layers (`for_generation`'s default on a CPU); otherwise float32 from the trainer's own model."""
    import torch

    from pipeline.models.base import SamplingParams
    from pipeline.models.settings import ModelSettings
    from pipeline.rl.trainer import initial_policy

    torch.set_num_threads(threads)
    trainer_policy = initial_policy(ModelSettings(preset="smollm2-135m-instruct"))
    policy = trainer_policy.for_generation(precision, pack=packed)
    if packed and policy is trainer_policy:
        raise RuntimeError("this torch build does not pack linear layers (pipeline.models.packed_linear)")
    prompts = actor_prompts(8, policy)
    policy.generate(prompts[:2], SamplingParams(max_new_tokens=2), seeds=[0, 1])  # warm-up
    started = time.perf_counter()
    policy.generate(prompts, SamplingParams(max_new_tokens=1), seeds=range(len(prompts)))
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    generations = policy.generate(prompts, SamplingParams(max_new_tokens=32), seeds=range(len(prompts)))
    generate_s = time.perf_counter() - started
    new_tokens = sum(len(g.token_ids) for g in generations)
    result = {"prompt_tokens": sum(len(p) for p in prompts), "prefill_s": prefill_s, "generate_s": generate_s,
              "new_tokens": new_tokens, "decode_steps": max(len(g.token_ids) for g in generations)}
    # A second turn: what a session saves. Turn 1 then turn 2 (turn 1's prompt, its answer, a new observation).
    sessions = list(range(len(prompts))) if precision == "bfloat16" or packed else None  # the before: every turn whole
    first = policy.generate(prompts, SamplingParams(max_new_tokens=6, stop=("\n",)), seeds=range(len(prompts)),
                            sessions=sessions)
    follow_up = policy.encode("\nObservation: you moved. Action:")
    second = [list(g.prompt_token_ids) + list(g.token_ids) + follow_up for g in first]
    run_before = policy.prompt_tokens_run
    policy.generate(second, SamplingParams(max_new_tokens=6, stop=("\n",)),
                    seeds=range(len(prompts), 2 * len(prompts)), sessions=sessions)
    result["turn_prompt_tokens_run_share"] = (policy.prompt_tokens_run - run_before) / sum(len(p) for p in second)
    # Recorded log-probs against the trainer's recomputation of the same tokens.
    scored = [g for g in generations if g.token_ids]
    prompt_ids, response_ids = [g.prompt_token_ids for g in scored], [g.token_ids for g in scored]
    recorded = torch.cat([torch.tensor(g.logprobs) for g in scored])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
        recomputed = torch.cat(trainer_policy.token_logprobs(prompt_ids, response_ids))
        trainer_logits = _response_logits(trainer_policy, prompt_ids, response_ids)
    with torch.no_grad():
        rollout_logits = _response_logits(policy, prompt_ids, response_ids)
    rollout_logp, trainer_logp = torch.log_softmax(rollout_logits, -1), torch.log_softmax(trainer_logits, -1)
    result["logprob_mismatch"] = float((recorded - recomputed).abs().mean())
    result["logprob_mismatch_kl"] = float((rollout_logp.exp() * (rollout_logp - trainer_logp)).sum(-1).mean())
    return result


def lora_generation(threads: int) -> dict:
    """Float32 decoding of a LoRA policy (rank 8 on SmolLM2's projections, its B matrices drawn small so the
    adapter changes the outputs) through peft's adapter layers (before) and from the float32 copy with the adapter
    merged (after), alternately twice each on the same 8 prompts, best of two; the copy's tokens and log-probs
    against the adapter's, and how long making the copy and writing a new adapter into it in place take."""
    import torch

    from pipeline.models.base import SamplingParams
    from pipeline.models.lora import with_lora
    from pipeline.models.settings import LoraSettings, ModelSettings
    from pipeline.rl.trainer import initial_policy

    torch.set_num_threads(threads)
    adapted = with_lora(initial_policy(ModelSettings(preset="smollm2-135m-instruct")),
                        LoraSettings(rank=8, alpha=16, seed=0))
    draws = torch.Generator().manual_seed(0)

    def new_adapter() -> None:
        with torch.no_grad():
            for name, tensor in adapted.model.named_parameters():
                if "lora_B" in name:
                    tensor.copy_(torch.randn(tensor.shape, generator=draws) * 0.02)

    new_adapter()
    started = time.perf_counter()
    merged = adapted.for_generation("float32")
    copy_s = time.perf_counter() - started
    new_adapter()
    started = time.perf_counter()
    if adapted.for_generation("float32", reuse=merged) is not merged:
        raise RuntimeError("the new adapter was not written into the merged copy in place")
    in_place_s = time.perf_counter() - started
    prompts = actor_prompts(8, adapted)
    rates: dict[str, list[float]] = {"before": [], "after": []}
    outputs = {}
    for policy in (adapted, merged):
        policy.generate(prompts[:2], SamplingParams(max_new_tokens=2), seeds=[0, 1])  # warm-up
    for _ in range(2):
        for name, policy in (("before", adapted), ("after", merged)):
            started = time.perf_counter()
            policy.generate(prompts, SamplingParams(max_new_tokens=1), seeds=range(len(prompts)))
            prefill_s = time.perf_counter() - started
            started = time.perf_counter()
            outputs[name] = policy.generate(prompts, SamplingParams(max_new_tokens=32), seeds=range(len(prompts)))
            generate_s = time.perf_counter() - started
            rates[name].append(decode_rate({"new_tokens": sum(len(g.token_ids) for g in outputs[name]),
                                            "generate_s": generate_s, "prefill_s": prefill_s}))
    same = [a.token_ids == b.token_ids for a, b in zip(outputs["before"], outputs["after"], strict=True)]
    diffs = [abs(x - y) for a, b in zip(outputs["before"], outputs["after"], strict=True) if a.token_ids == b.token_ids
             for x, y in zip(a.logprobs, b.logprobs, strict=True)]
    return {"before": max(rates["before"]), "after": max(rates["after"]), "same_rows": sum(same),
            "logprob_max_diff": max(diffs, default=float("nan")), "copy_s": copy_s, "in_place_s": in_place_s}


def llamacpp(threads: int) -> dict:
    """What a user would pick instead: llama.cpp decoding the preset's own GGUF (its Q4_1 weights, as shipped) on the
    same 8 prompt token ids, batched as 8 sequences of one context, greedy, timed as `generation` times ours."""
    import ctypes

    import numpy as np
    import torch

    try:
        import llama_cpp as lc
    except ImportError as exc:
        return {"unavailable": f"{exc} (pip install -e '.[llamacpp]' builds it from source)"}
    from pipeline.models.presets import preset
    from pipeline.models.settings import ModelSettings
    from pipeline.rl.trainer import initial_policy

    torch.set_num_threads(threads)
    policy = initial_policy(ModelSettings(preset="smollm2-135m-instruct"))  # float32: the trainer's weights
    prompts = actor_prompts(8, policy)
    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(str(preset("smollm2-135m-instruct").source()).encode(), model_params)
    context_params = lc.llama_context_default_params()
    context_params.n_ctx = 8 * 256
    context_params.n_batch = context_params.n_ubatch = 8 * 256
    context_params.n_seq_max = 8
    context_params.n_threads = context_params.n_threads_batch = threads
    context = lc.llama_init_from_model(model, context_params)
    vocabulary = lc.llama_model_get_vocab(model)
    vocab = lc.llama_vocab_n_tokens(vocabulary)
    batch = lc.llama_batch_init(8 * 256, 0, 8)

    def decode(rows: list[tuple[int, list[int], int]]) -> list[int]:
        """Run each row's tokens (sequence, tokens, first position); the logits of each row's last token, its index."""
        batch.n_tokens = 0
        last = []
        for sequence, tokens, start in rows:
            for offset, token in enumerate(tokens):
                i = batch.n_tokens
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + offset, 1
                batch.seq_id[i][0] = sequence
                batch.logits[i] = offset == len(tokens) - 1
                batch.n_tokens += 1
            last.append(batch.n_tokens - 1)
        if lc.llama_decode(context, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return last

    responses: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]

    def greedy(row: int, index: int) -> int:
        """The most likely next token of `row`, recorded with its log-prob."""
        logits = np.ctypeslib.as_array(ctypes.cast(lc.llama_get_logits_ith(context, index),
                                                   ctypes.POINTER(ctypes.c_float)), shape=(vocab,))
        token = int(logits.argmax())
        shifted = logits.astype(np.float64) - logits[token]
        responses[row].append(token)
        logprobs[row].append(float(-np.log(np.exp(shifted).sum())))
        return token

    def generate(max_new_tokens: int) -> int:
        """New tokens, each row's up to its end-of-generation token; as in ours, a row that ended stays in the batch."""
        lc.llama_memory_clear(lc.llama_get_memory(context), True)
        for row in range(len(prompts)):
            responses[row], logprobs[row] = [], []
        last = decode([(row, ids, 0) for row, ids in enumerate(prompts)])
        ended = [False] * len(prompts)
        new = 0
        for step in range(max_new_tokens):
            chosen = [greedy(row, index) for row, index in enumerate(last)]
            new += sum(not done for done in ended)
            ended = [done or lc.llama_vocab_is_eog(vocabulary, token)
                     for done, token in zip(ended, chosen, strict=True)]
            if step == max_new_tokens - 1:
                break
            last = decode([(row, [token], len(prompts[row]) + step) for row, token in enumerate(chosen)])
        return new

    try:
        generate(2)  # warm-up
        started = time.perf_counter()
        generate(1)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        new_tokens = generate(32)
        generate_s = time.perf_counter() - started
        # Each row up to its end token (the vocabulary belongs to the model, freed below).
        kept = [response[: next((i + 1 for i, t in enumerate(response) if lc.llama_vocab_is_eog(vocabulary, t)),
                                len(response))] for response in responses]
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(context)
        lc.llama_model_free(model)
    # Its recorded log-probs against the float32 trainer's of the same tokens.
    with torch.no_grad():
        ours = torch.cat(policy.token_logprobs(prompts, kept))
    theirs = torch.tensor([logp for row, response in zip(logprobs, kept, strict=True) for logp in row[:len(response)]])
    return {"prefill_s": prefill_s, "generate_s": generate_s, "new_tokens": new_tokens,
            "logprob_mismatch": float((theirs - ours).abs().mean()), "version": getattr(lc, "__version__", "?")}


def _line(name: str, value: object) -> str:
    """`name=value`, a float to 3 decimals, or to 3 significant digits below 0.01 (log-prob differences)."""
    if isinstance(value, float):
        return f"{name}={value:.3f}" if abs(value) >= 0.01 or value == 0 else f"{name}={value:.3g}"
    return f"{name}={value}"


def decode_rate(measured: dict) -> float:
    """New tokens per second of a 32-token generation, its prefill left out."""
    return measured["new_tokens"] / (measured["generate_s"] - measured["prefill_s"])


def _response_logits(policy, prompt_ids, response_ids):  # type: ignore[no-untyped-def]
    """Teacher-forced float32 logits at every response position, one sequence at a time, (T, V) stacked."""
    import torch

    rows = []
    for prompt, response in zip(prompt_ids, response_ids, strict=True):
        ids = torch.tensor([list(prompt) + list(response)])
        logits = policy.model(input_ids=ids, logits_to_keep=len(response) + 1).logits[0, :-1].float()
        rows.append(logits)
    return torch.cat(rows)


def update(mode: str, prompts: int, steps: int, threads: int) -> dict:
    from pipeline.models.base import SamplingParams
    from pipeline.models.settings import LoraSettings, ModelSettings
    from pipeline.rl.policy_step import Sample
    from pipeline.rl.settings import ActorTrainerSettings
    from pipeline.rl.trainer import initial_policy
    from pipeline.rl.trainer_step import TrainerStep

    lora = LoraSettings(rank=8, alpha=16) if mode != "full" else LoraSettings()
    precision = "bfloat16" if mode == "lora_bf16" else "float32"
    settings = ActorTrainerSettings(
        model=ModelSettings(preset="smollm2-135m-instruct", lora=lora, precision=precision), lr=1e-5,
        threads=threads, micro_batch_size=4)
    policy = initial_policy(settings.model)
    prompt_ids = actor_prompts(prompts, policy)
    step = TrainerStep(policy, settings, temperature=1.0)  # wraps the LoRA adapter when asked (identity at start)
    generations = step.policy.generate(prompt_ids, SamplingParams(max_new_tokens=16, temperature=1.0),
                                       seeds=range(len(prompt_ids)))
    samples = [Sample(tuple(g.prompt_token_ids), tuple(g.token_ids), tuple(g.logprobs), 1.0 if i % 2 else -1.0)
               for i, g in enumerate(generations)]
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    durations = []
    for _ in range(steps + 1):  # the first warms up allocators and kernels
        started = time.perf_counter()
        step.run(samples, "grpo")
        durations.append(time.perf_counter() - started)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before TRL's step, ours alone
    trl = trl_step_s(step.policy, samples, steps) if mode == "full" else None
    return {
        "trl_step_s": trl, "step_s": min(durations[1:]), "step_tokens": tokens,
        "trainable_params": sum(p.numel() for p in step.policy.model.parameters() if p.requires_grad),
        "peak_rss_mb": peak_rss_mb,
    }


def loop_step_s(precision: str, run_dir: Path) -> float:
    """The time between the actor's updates of steps 1 and 2 of a 3-step SmolLM2 run at `precision`."""
    from pipeline.audit.views import Audit

    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "CRL_EXTRACTOR_TRAINER__BUFFER_SIZE": "2", "CRL_SCHEDULER__EVAL_EVERY": "0",
                "CRL_SCHEDULER__MERGE_EVERY": "0", "CRL_ACTOR_TRAINER__MODEL__PRECISION": precision,
                "CRL_EXTRACTOR_TRAINER__MODEL__PRECISION": precision, "CRL_ROLLOUT__GENERATION__PRECISION": precision,
                "CRL_EXTRACTOR__GENERATION__PRECISION": precision})
    command = [sys.executable, "-m", "pipeline.cli", "run", str(ROOT / "configs/smol-minihack-room.yaml"), "--steps",
               "3", "--run-dir", str(run_dir), "--no-report"]
    subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with Audit(run_dir) as audit:
        _, rows = audit.query("SELECT step, min(occurred_at) FROM train_steps WHERE role = 'actor' GROUP BY step "
                              "ORDER BY step")
    completed = dict(rows)
    return (completed[2] - completed[1]).total_seconds()


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
    parser.add_argument("--quick", action="store_true", help="4 update prompts, 1 timed step, the loop after only")
    parser.add_argument("--decoding", action="store_true", help="the probe, generation and llama.cpp only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    prompts, steps = (4, 1) if args.quick else (8, 2)
    if args.child:
        kind, _, mode = args.child.partition(":")
        if kind == "probe":
            result = probe(args.threads)
        elif kind == "generation":
            result = generation(mode.removesuffix("-packed"), args.threads, packed=mode.endswith("-packed"))
        elif kind == "llamacpp":
            result = llamacpp(args.threads)
        elif kind == "lora_generation":
            result = lora_generation(args.threads)
        else:
            result = update(mode, prompts, steps, args.threads)
        print(json.dumps(result))
        return

    def child(spec: str) -> dict:
        command = [sys.executable, __file__, "--child", spec, "--threads", str(args.threads)]
        command += ["--quick"] if args.quick else []
        out = subprocess.run(command, check=True, capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        return json.loads(out.stdout.strip().splitlines()[-1])

    machine = child("probe")
    before, after = child("generation:float32"), child("generation:bfloat16")
    packed = child("generation:float32-packed")
    llama = child("llamacpp")
    adapter = child("lora_generation")
    bounds = {
        "gen_new_tokens_per_s_bound": 8 * machine["mem_read_gb_per_s"] * 1e9 / (2 * PARAMETERS),
        "gen_prompt_tokens_per_s_bound": machine["matmul_gflops_bf16"] * 1e9 / (2 * PARAMETERS),
        "step_tokens_per_s_lora_bound": machine["matmul_gflops_bf16"] * 1e9 / (4 * PARAMETERS),
    }
    lines: dict[str, object] = dict(machine)
    for suffix, gen in (("_before", before), ("", after)):
        lines[f"gen_new_tokens_per_s{suffix}"] = decode_rate(gen)
        lines[f"gen_prompt_tokens_per_s{suffix}"] = gen["prompt_tokens"] / gen["prefill_s"]
        lines[f"turn_prompt_tokens_run_share{suffix}"] = gen["turn_prompt_tokens_run_share"]
    lines["gen_packed_new_tokens_per_s"] = decode_rate(packed)
    lines["gen_packed_prompt_tokens_per_s"] = packed["prompt_tokens"] / packed["prefill_s"]
    lines["gen_packed_speedup"] = decode_rate(packed) / decode_rate(before)
    lines["gen_packed_logprob_mismatch"] = packed["logprob_mismatch"]
    if "unavailable" in llama:
        lines["llamacpp_new_tokens_per_s"] = f"unavailable: {llama['unavailable']}"
    else:
        theirs = decode_rate(llama)
        lines["llamacpp_new_tokens_per_s"] = theirs
        lines["llamacpp_prompt_tokens_per_s"] = after["prompt_tokens"] / llama["prefill_s"]
        lines["llamacpp_over_ours"] = theirs / decode_rate(after)
        lines["llamacpp_over_ours_before"] = theirs / decode_rate(before)
        lines["llamacpp_over_ours_packed"] = theirs / decode_rate(packed)
        lines["llamacpp_logprob_mismatch"] = llama["logprob_mismatch"]
        lines["llamacpp_version"] = llama["version"]
    lines["gen_lora_new_tokens_per_s_before"] = adapter["before"]
    lines["gen_lora_new_tokens_per_s"] = adapter["after"]
    lines["gen_lora_speedup"] = adapter["after"] / adapter["before"]
    lines["gen_lora_same_rows"] = f"{adapter['same_rows']}/8"
    lines["gen_lora_logprob_max_diff"] = adapter["logprob_max_diff"]
    lines["lora_merge_copy_s"] = adapter["copy_s"]
    lines["lora_merge_in_place_s"] = adapter["in_place_s"]
    lines["gen_decode_steps"] = after["decode_steps"]
    lines["logprob_mismatch"] = after["logprob_mismatch"]
    lines["logprob_mismatch_kl"] = after["logprob_mismatch_kl"]
    lines["logprob_mismatch_fp32"] = before["logprob_mismatch"]
    lines["gen_new_tokens_per_s_share"] = decode_rate(after) / bounds["gen_new_tokens_per_s_bound"]
    if args.decoding:
        lines.update({"gen_new_tokens_per_s_bound": bounds["gen_new_tokens_per_s_bound"], "threads": args.threads})
        for name, value in lines.items():
            print(_line(name, value))
        return
    updates = {mode: child(f"update:{mode}") for mode in MODES}
    full, lora, lora_bf16 = (updates[mode] for mode in MODES)
    lines["step_tokens_per_s_full"] = full["step_tokens"] / full["step_s"]
    lines["step_tokens_per_s_lora_before"] = lora["step_tokens"] / lora["step_s"]
    lines["step_tokens_per_s_lora"] = lora_bf16["step_tokens"] / lora_bf16["step_s"]
    lines.update(bounds)
    for name in ("gen_prompt_tokens_per_s", "step_tokens_per_s_lora"):
        lines[f"{name}_share"] = float(lines[name]) / bounds[f"{name}_bound"]  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory(prefix="smol-loop-") as scratch:
        lines["loop_step_s"] = loop_step_s("bfloat16", Path(scratch) / "after")
        lines["loop_step_s_before"] = ("skipped (--quick)" if args.quick
                                       else loop_step_s("float32", Path(scratch) / "before"))
    lines.update({
        "step_s_full": full["step_s"], "step_s_lora_before": lora["step_s"], "step_s_lora": lora_bf16["step_s"],
        "peak_rss_mb_full": full["peak_rss_mb"], "peak_rss_mb_lora": lora["peak_rss_mb"],
        "peak_rss_mb_lora_bf16": lora_bf16["peak_rss_mb"],
        "lora_speedup": full["step_s"] / lora["step_s"], "lora_memory_ratio": lora["peak_rss_mb"] / full["peak_rss_mb"],
        "trainable_params_full": full["trainable_params"], "trainable_params_lora": lora["trainable_params"],
        "trl_step_s_full": full["trl_step_s"],
        "ours_over_trl_step_time": (full["step_s"] / full["trl_step_s"] if isinstance(full["trl_step_s"], float)
                                    else full["trl_step_s"]),
        "threads": args.threads,
    })
    for name, value in lines.items():
        print(_line(name, value))


if __name__ == "__main__":
    main()
