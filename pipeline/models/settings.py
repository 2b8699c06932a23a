"""Which policy model a role starts from: a local Hugging Face directory, a pretrained preset converted once from a pip
package (`pipeline.models.presets`), or the tiny CPU preset."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

Precision = Literal["auto", "float32", "bfloat16"]
"""What a role's matmuls compute in. `auto` becomes bfloat16 where the device computes it natively
(`native_bfloat16`), else float32, when the settings load: the resolved config a run records says which."""


def native_bfloat16(device: str) -> bool:
    """Whether `device` runs bfloat16 matmuls in hardware: a CUDA device that supports them, or a CPU with AVX-512 BF16
    or AMX. Elsewhere torch emulates them, several times slower than float32 (on an AVX2 CPU, ~6x at a training
    step's shapes and ~2.6x at a decode step's)."""
    import torch  # only when a setting says auto: loading settings stays light otherwise

    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def _resolved_precision(precision: str, info: ValidationInfo) -> str:
    if precision != "auto":
        return precision
    device = info.data.get("device")
    if device is None:  # the device failed its own validation, which reports it
        return precision
    return "bfloat16" if native_bfloat16(device) else "float32"


class TinyModelSettings(BaseModel):
    """The tiny CPU preset: a causal LM built from a transformers config, with a tokenizer trained locally on text the
    environments produce. Same settings -> byte-identical weights and vocabulary."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: Literal["qwen2", "llama"] = Field(default="qwen2", description="transformers architecture.")
    hidden_size: int = Field(default=128, gt=0, description="Width of the residual stream.")
    num_layers: int = Field(default=2, gt=0, description="Decoder layers.")
    num_heads: int = Field(default=4, gt=0, description="Attention heads.")
    num_kv_heads: int = Field(default=2, gt=0, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(default=512, gt=0, description="MLP width.")
    vocab_size: int = Field(default=2048, ge=256, description="BPE vocabulary size (keep <= 4-8k at this size).")
    max_position_embeddings: int = Field(default=4096, gt=0, description="Longest prompt + response.")
    seed: int = Field(default=0, ge=0, description="Seeds the weights' initialisation and the tokenizer corpus.")
    corpus_episodes: int = Field(default=48, gt=0, description="MiniHack episodes played for the tokenizer corpus.")
    corpus_envs: tuple[str, ...] = Field(
        default=(),
        description="Env ids whose episodes (`corpus_episodes` each, half by the scripted solver) join the tokenizer "
        "corpus, so a text world's words become tokens: a CookingWorld prompt is ~3x shorter with them.")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelSettings:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}, "
                             f"and num_heads a multiple of num_kv_heads {self.num_kv_heads}")
        return self


class LoraSettings(BaseModel):
    """A LoRA adapter the role's trainer updates instead of every weight (`pipeline.models.lora`, peft). Rank 0: full
    fine-tuning."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(default=0, ge=0, description="Adapter rank r; 0 turns LoRA off (full fine-tuning).")
    alpha: float = Field(default=16.0, gt=0, description="LoRA scaling alpha (the update is scaled by alpha / r).")
    target_modules: tuple[str, ...] = Field(
        default=("q_proj", "k_proj", "v_proj", "o_proj"), min_length=1,
        description="Names of the linear layers that get an adapter (Llama / Qwen attention projections).")
    seed: int = Field(default=0, ge=0, description="Seeds the adapter's initialisation (A; B starts at zero).")


class ModelSettings(BaseModel):
    """Which policy model a role starts from, and where its trainer runs it (training always uses transformers)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str | None = Field(
        default=None, description="Local directory of a Hugging Face model to start from (config, safetensors, "
        "tokenizer); with neither path nor preset, the tiny preset is built.")
    preset: str | None = Field(
        default=None, description="A pretrained model shipped as a pip package, converted once into a local "
        "directory and verified on every use (`crl models list`): smollm2-135m-instruct.")
    tiny: TinyModelSettings = Field(default_factory=TinyModelSettings, description="The tiny preset (no path, no "
                                    "preset).")
    device: str = Field(default="cpu", description="torch device the trainer runs the model on.")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA instead of full fine-tuning (rank > 0).")
    precision: Precision = Field(
        default="float32",
        description="What the trainer's matmuls compute in. bfloat16: autocast on float32 weights (the optimiser "
        "and checkpoints stay float32), about twice the matmul rate of a CPU with AVX-512 BF16; the log-probs it "
        "recomputes differ from float32 ones by ~0.03 nats per token (docs/training.md). auto: bfloat16 where "
        "`device` computes it natively (a CUDA GPU, a CPU with AVX-512 BF16 or AMX), float32 elsewhere.")
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass: less memory, ~30% more time, the "
        "same weights.")

    _precision = field_validator("precision")(_resolved_precision)

    @model_validator(mode="after")
    def _one_source(self) -> ModelSettings:
        if self.path is not None and self.preset is not None:
            raise ValueError(f"give model.path ({self.path}) or model.preset ({self.preset}), not both")
        if self.preset is not None:
            from pipeline.models.presets import PRESETS

            if self.preset not in PRESETS:
                raise ValueError(f"unknown model.preset {self.preset!r}; valid values: {sorted(PRESETS)}")
        return self


class GenerationSettings(BaseModel):
    """How a role's policy generates, in one place: the workers that sample from it (rollout for the actor, extractor
    for the extractor) and the role's trainer, which recomputes the sampling log-probs at the same temperature."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["transformers", "vllm"] = Field(
        default="transformers", description="Generation backend for the role's checkpoints (vllm: GPU machines).")
    device: str = Field(default="cpu", description="torch device for the transformers backend.")
    temperature: float = Field(
        default=1.0, gt=0, description="Sampling temperature; the role's trainer recomputes log-probs at it.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling (1 = off).")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0 = off).")
    max_new_tokens: int = Field(default=8, gt=0, description="Longest response per generation.")
    precision: Precision = Field(
        default="float32",
        description="Weights the generating workers sample with (transformers backend). float32: on a CPU, a copy "
        "of each version with its linear layers packed for oneDNN (models of 20M parameters or more) and a LoRA "
        "adapter merged in, kept up to date in place (SmolLM2 decodes 1.33x faster; log-probs within float rounding "
        "of the trainer's). bfloat16: a bfloat16 copy of "
        "each version, a LoRA adapter merged in: half the bytes read per decode step and the CPU's bfloat16 "
        "matmuls; recorded log-probs then differ from the trainer's by ~0.03 nats per token (docs/training.md). "
        "auto: bfloat16 where `device` computes it natively (a CUDA GPU, a CPU with AVX-512 BF16 or AMX), float32 "
        "elsewhere.")
    micro_batch: int = Field(default=32, gt=0, description="Rows per forward pass while generating.")
    seed: int = Field(
        default=0, ge=0,
        description="The role's sampling seed: with what a generation is (an episode's trajectory id and turn; a "
        "distilled trajectory's id; a merge chunk) it keys that generation's own random stream, so neither its batch "
        "nor the worker that runs it changes what it draws.")
    threads: int = Field(
        default=0, ge=0,
        description="torch CPU threads of each generating worker (0: torch's default, one per core). On a small "
        "machine where several workers compute at once, 1 avoids oversubscribing the cores.")

    _precision = field_validator("precision")(_resolved_precision)
