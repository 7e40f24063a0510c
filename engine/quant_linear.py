"""The quantized form of the linear seam.

`quantize_linear_(layer, weight, act)` turns a dense `Linear` into a quantized one in place: the
dense weight is dropped, the quantized tensors live in a `QuantizedLinearMethod` submodule (so
`.to(device)` and `state_dict()` see them), and `forward` computes through a kernel. The
reference kernel (dequantize, then matmul) is the default; the kernels issue adds a registry of
faster paths chosen once per layer at load time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokq.engine.layers import Linear
from tokq.kernels.reference import FP8Weight, IntWeight, QuantizedWeight, linear_reference

LinearKernel = Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None, str | None], torch.Tensor]


class QuantizedLinearMethod(nn.Module):
    """Holds one quantized weight (all shards of a merged Linear, rows concatenated)."""

    def __init__(self, weight: QuantizedWeight, act: str | None = None, kernel: LinearKernel = linear_reference,
                 kernel_name: str = "reference"):
        super().__init__()
        self.register_buffer("q", weight.q)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("zero", weight.zero if isinstance(weight, IntWeight) else None)
        self.bits = weight.bits if isinstance(weight, IntWeight) else 8
        self.group_size = weight.group_size if isinstance(weight, IntWeight) else weight.q.shape[1]
        self.is_fp8 = isinstance(weight, FP8Weight)
        self.act = act
        self.kernel = kernel
        self.kernel_name = kernel_name

    @property
    def name(self) -> str:
        w = "fp8" if self.is_fp8 else f"int{self.bits}" + ("" if self.zero is None else "-asym")
        grouping = "" if self.is_fp8 or self.group_size == self.q.shape[1] else f"-g{self.group_size}"
        return f"{w}{grouping}{'-a' + self.act if self.act else ''}:{self.kernel_name}"

    @property
    def weight(self) -> QuantizedWeight:
        if self.is_fp8:
            return FP8Weight(self.q, self.scale)
        return IntWeight(self.q, self.scale, self.zero, self.bits, self.group_size)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, layer.bias, self.act)


def quantize_linear_(layer: Linear, weight: QuantizedWeight, act: str | None = None) -> Linear:
    """Replace `layer`'s dense weight by `weight` (same [out, in] shape) and compute through a kernel."""
    if tuple(weight.shape) != (layer.out_features, layer.in_features):
        raise ValueError(f"quantized weight shape {tuple(weight.shape)} does not match the layer's "
                         f"{(layer.out_features, layer.in_features)}")
    layer.weight = None  # the dense weight is no longer used; free its memory
    layer.method = QuantizedLinearMethod(weight, act)
    return layer
