"""Packed linear layers (oneDNN's blocked weights, what float32 generation copies decode with on a CPU): the same
products as `F.linear` to float rounding, weights that come back exactly, a later version written into the same
layers, and generation copies of the tiny model (packed here by lowering the size threshold) that sample what the
policy samples. The real SmolLM2 copy is tested in tests/integration/test_pretrained_models.py.

Run: pytest tests/unit/models/test_packed_linear.py -q   (CPU, seconds)
"""

from __future__ import annotations

import platform

import pytest
import torch

from pipeline.errors import InvalidArgumentError
from pipeline.models import SamplingParams
from pipeline.models.base import stream_seed
from pipeline.models.lora import with_lora
from pipeline.models.packed_linear import PackedLinear, pack_linears, packing_available
from pipeline.models.settings import LoraSettings

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") and not packing_available(),
                                reason="oneDNN's packed linear layers: checked on x86-64 builds of torch")


def rows(seed: int, n: int = len(PROMPTS)) -> list[int]:
    return [stream_seed("test", seed, row) for row in range(n)]


def test_this_torch_build_packs_on_x86_64():
    assert packing_available()


def test_a_packed_layer_multiplies_as_f_linear_and_gives_its_weight_back_exactly():
    generator = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(40, 24, generator=generator), torch.randn(40, generator=generator)
    layer = PackedLinear(weight, bias, rows=8)
    for shape in ((3, 24), (2, 7, 24), (1, 300, 24)):  # a decode step, a batch, a long prefill
        x = torch.randn(*shape, generator=generator)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.unpacked_weight(), weight)
    newer, newer_bias = torch.randn(40, 24, generator=generator), torch.randn(40, generator=generator)
    bias_tensor = layer.bias
    layer.write(newer, newer_bias)
    assert torch.equal(layer.unpacked_weight(), newer) and layer.bias is bias_tensor  # the bias copied into its own
    assert torch.equal(layer.bias, newer_bias)
    with pytest.raises(InvalidArgumentError, match=r"shape \(24, 40\) does not fit a packed \(40, 24\) layer"):
        layer.write(newer.t(), newer_bias)
    with pytest.raises(InvalidArgumentError, match="bias"):
        layer.write(newer, None)


def test_a_model_below_the_size_threshold_samples_from_itself(policy):
    assert policy.for_generation("float32") is policy
    assert policy.for_generation("float32", pack=False) is policy


@pytest.fixture
def packing_everything(monkeypatch):
    from pipeline.models import packed_linear

    monkeypatch.setattr(packed_linear, "MIN_PARAMETERS", 0)


def _linears(policy) -> tuple[int, int]:
    modules = list(policy.model.modules())
    return (sum(isinstance(m, torch.nn.Linear) for m in modules), sum(isinstance(m, PackedLinear) for m in modules))


def _assert_samples_alike(ours, theirs) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_a_packed_copy_samples_what_the_policy_does_and_takes_a_later_version_in_place(policy, packing_everything):
    copy = policy.for_generation("float32")
    assert copy is not policy and copy.full_precision is policy
    assert _linears(copy) == (0, 2 * 7 + 1)  # every projection of both layers and the LM head
    for sampling in (SamplingParams(max_new_tokens=8, temperature=0.0), SamplingParams(max_new_tokens=8)):
        _assert_samples_alike(copy.generate(PROMPTS, sampling, seeds=rows(0)),
                              policy.generate(PROMPTS, sampling, seeds=rows(0)))
    source = {name: tensor.clone() for name, tensor in policy.model.state_dict().items()}
    try:
        with torch.no_grad():  # a later version, as a follower copies it into the policy
            for tensor in policy.model.parameters():
                tensor.mul_(1.01)
        layers = {name: m for name, m in copy.model.named_modules() if isinstance(m, PackedLinear)}
        assert policy.for_generation("float32", reuse=copy) is copy
        assert {name: m for name, m in copy.model.named_modules() if isinstance(m, PackedLinear)} == layers
        fresh = policy.for_generation("float32")
        for name, layer in layers.items():
            assert torch.equal(layer.unpacked_weight(), fresh.model.get_submodule(name).unpacked_weight())
            assert torch.equal(layer.unpacked_weight(), policy.model.get_submodule(name).weight)
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
        _assert_samples_alike(copy.generate(PROMPTS, greedy, seeds=rows(1)),
                              policy.generate(PROMPTS, greedy, seeds=rows(1)))
    finally:
        policy.model.load_state_dict(source)


def test_a_lora_copy_is_merged_then_packed_and_a_new_adapter_is_written_in_place(corpus, packing_everything):
    from tiny_models import SMALL

    from pipeline.models import build_tiny

    adapted = with_lora(build_tiny(SMALL, corpus=corpus), LoraSettings(rank=4, alpha=8, seed=0))
    generator = torch.Generator().manual_seed(2)

    def new_adapter() -> None:
        with torch.no_grad():
            for name, tensor in adapted.model.named_parameters():
                if "lora_B" in name:
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.05)

    new_adapter()
    copy = adapted.for_generation("float32")
    assert copy.full_precision is adapted and _linears(copy) == (0, 2 * 7 + 1)
    sampling = SamplingParams(max_new_tokens=8)
    _assert_samples_alike(copy.generate(PROMPTS, sampling, seeds=rows(2)),
                          adapted.generate(PROMPTS, sampling, seeds=rows(2)))
    new_adapter()
    assert adapted.for_generation("float32", reuse=copy) is copy
    merged = adapted.for_generation("float32", pack=False, reuse=copy)  # peft's own merge, unpacked: a new copy
    assert merged is not copy and _linears(merged) == (2 * 7 + 1, 0)
    for name, layer in copy.model.named_modules():
        if isinstance(layer, PackedLinear):
            assert torch.equal(layer.unpacked_weight(), merged.model.get_submodule(name).weight)
    _assert_samples_alike(copy.generate(PROMPTS, sampling, seeds=rows(3)),
                          adapted.generate(PROMPTS, sampling, seeds=rows(3)))


def test_pack_linears_leaves_a_bfloat16_layer_alone():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16))
    pack_linears(model, rows=4)
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], torch.nn.Linear)
