"""Linear layers whose float32 weights oneDNN has reordered ("packed") once for the CPU's matmul kernels: what a
generating worker's copy of a model decodes with on a CPU (`TransformersPolicy.for_generation`).

    model = pack_linears(copy.deepcopy(model), rows=8)    # every nn.Linear, the LM head included
    layer.write(new_weight, new_bias)                       # a later version, into the same layer

A decode step multiplies a few rows by every weight of the model. Through `F.linear` on a plain row-major weight,
SmolLM2's layer matmuls at 8 rows streamed their weights at about 10 GB/s on a 2-core AVX2 EPYC whose memory reads
33 GB/s; the same matmuls on weights reordered into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
what inductor's weight freezing does) ran 1.44x faster, and a whole batch-8 decode about 1.33x faster with the LM
head packed too (docs/benchmarks.md). Prefill, hundreds of rows a matmul, ran about 5% slower.

Inference only: a packed layer has no gradient. Its results differ from `F.linear`'s by float rounding (another
summation order): log-probs within about 4e-5 on SmolLM2. `packing_available()` checks once per process that this
torch build packs and multiplies a small layer correctly; where it does not (no oneDNN, another CPU architecture),
generation copies stay plain, as they do for models below `MIN_PARAMETERS`.
"""

from __future__ import annotations

import functools
import logging

import torch

from pipeline.errors import InvalidArgumentError

log = logging.getLogger(__name__)


def _reordered(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)


class PackedLinear(torch.nn.Module):
    """`y = x W^T + b` with `W` held in oneDNN's blocked layout for matmuls of about `rows` rows: an opaque tensor
    only oneDNN reads (`unpacked_weight()` gives it back as a plain one)."""

    packed_weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.rows = rows
        self.register_buffer("packed_weight", _reordered(weight, rows))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def write(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Hold `weight` packed anew (and `bias`, copied into this layer's own): the same layer, new values. The
        packed tensor is oneDNN's opaque one, which nothing can copy into, so it is replaced."""
        if weight.shape != (self.out_features, self.in_features):
            raise InvalidArgumentError(f"a weight of shape {tuple(weight.shape)} does not fit a packed "
                                       f"({self.out_features}, {self.in_features}) layer")
        if (bias is None) != (self.bias is None):
            raise InvalidArgumentError("a bias given to a packed layer without one, or none to one with one")
        self.packed_weight = _reordered(weight, self.rows)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)

    def unpacked_weight(self) -> torch.Tensor:
        """The weight as a plain (out, in) tensor, exactly: the layer applied to the identity (each product is a
        weight times one, each sum adds zeros), less the bias."""
        with torch.no_grad():
            eye = torch.eye(self.in_features, dtype=torch.float32)
            out = torch.ops.mkldnn._linear_pointwise(eye, self.packed_weight, None, "none", [], "")
        return out.t().contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={self.rows}"


MIN_PARAMETERS = 20_000_000
"""The smallest model (parameters) whose generation copies are packed. Packing pays where a decode step streams
weights from memory; a model this small sits largely in the CPU's caches, and the tiny preset's (0.66M parameters)
decoded 1.2x slower packed (32 rows, 32 tokens, one thread)."""


def worth_packing(model: torch.nn.Module) -> bool:
    """Whether `model` is large enough to pack (`MIN_PARAMETERS`) and this torch build can (`packing_available`)."""
    return sum(p.numel() for p in model.parameters()) >= MIN_PARAMETERS and packing_available()


@functools.cache
def packing_available() -> bool:
    """Whether this torch build packs a float32 linear layer for the CPU and multiplies through it as `F.linear`
    does (to float rounding); checked once per process."""
    try:
        generator = torch.Generator().manual_seed(0)
        weight, bias = torch.randn(48, 32, generator=generator), torch.randn(48, generator=generator)
        x = torch.randn(3, 5, 32, generator=generator)
        with torch.no_grad():
            ours = PackedLinear(weight, bias, rows=8)(x)
        if torch.allclose(ours, torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-4):
            return True
        log.warning("oneDNN's packed linear layers disagree with F.linear here: generation copies stay plain")
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        log.info("oneDNN's packed linear layers are not available here (%s): generation copies stay plain", exc)
    return False


def pack_linears(model: torch.nn.Module, rows: int) -> torch.nn.Module:
    """`model` with every float32 `nn.Linear` replaced by a `PackedLinear` of the same weights, in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and child.weight.dtype == torch.float32:
                setattr(module, name, PackedLinear(child.weight, child.bias, rows))
    return model
