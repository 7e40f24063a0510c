"""The quantized form of the linear seam.

`quantize_linear_(layer, weight, act)` turns a dense `Linear` into a quantized one in place: the
dense weight is dropped, the quantized tensors live in a `QuantizedLinearMethod` submodule (so
`.to(device)` and `state_dict()` see them), and `forward` computes through a kernel. The kernel
registry (`kernels.registry`) picks that kernel once, when the method is created: the first of
`kernels.linear.LINEAR_KERNELS` (fastest first) that can run the scheme, shape, device and activation
dtype here (`TOKQ_KERNELS` forces or disables kernels by name), and builds its packed form. The
codes/scales/zero buffers stay the layer's canonical form (checkpoint writers and the reference read
them); the packed form is rebuilt from them when the module moves (`.to(...)`), or by calling
`prepare()` after changing them in place.
"""

from __future__ import annotations

import torch
from torch import nn

from tokq.engine.layers import Linear
from tokq.errors import ConfigError
from tokq.kernels.linear import PreparedKernel
from tokq.kernels.reference import FP8Weight, IntWeight, QuantizedWeight
from tokq.kernels.registry import KernelError, prepare_linear_kernel


class QuantizedLinearMethod(nn.Module):
    """Holds one quantized weight (all shards of a merged Linear, rows concatenated) and its kernel.

    `dtype` is the dtype of the activations the layer will see (the model's compute dtype); the
    registry chooses for it.
    """

    def __init__(self, weight: QuantizedWeight, act: str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.register_buffer("q", weight.q)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("zero", weight.zero if isinstance(weight, IntWeight) else None)
        self.bits = weight.bits if isinstance(weight, IntWeight) else 8
        self.group_size = weight.group_size if isinstance(weight, IntWeight) else weight.q.shape[1]
        self.is_fp8 = isinstance(weight, FP8Weight)
        self.act = act
        self.dtype = dtype or torch.get_default_dtype()
        self.kernel: PreparedKernel = self._prepared()

    def _prepared(self) -> PreparedKernel:
        try:
            return prepare_linear_kernel(self.weight, self.act, self.dtype)
        except KernelError as exc:
            raise ConfigError(str(exc)) from exc

    def prepare(self) -> None:
        """Choose the kernel again and rebuild its packed form from the buffers."""
        self.kernel = self._prepared()

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), ...: the packed form must follow the buffers
        super()._apply(fn, recurse)
        self.prepare()
        return self

    @property
    def kernel_name(self) -> str:
        return self.kernel.name

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
        return self.kernel(x, layer.bias, self.act)


class InputPermutedLinearMethod(QuantizedLinearMethod):
    """A quantized weight whose input columns were reordered (activation order): x is permuted to match."""

    def __init__(self, weight: QuantizedWeight, input_perm: torch.Tensor, act: str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__(weight, act, dtype)
        self.register_buffer("input_perm", input_perm)

    @property
    def name(self) -> str:
        return f"{super().name}+actorder"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return super().apply(layer, x.index_select(-1, self.input_perm))


def compute_dtype(layer: Linear) -> torch.dtype:
    """The dtype `layer` computes in: its dense weight's (or bias's, or its quantized method's)."""
    if layer.weight is not None:
        return layer.weight.dtype
    if isinstance(layer.method, QuantizedLinearMethod):
        return layer.method.dtype
    return layer.bias.dtype if layer.bias is not None else torch.get_default_dtype()


def quantize_linear_(layer: Linear, weight: QuantizedWeight, act: str | None = None,
                     input_perm: torch.Tensor | None = None) -> Linear:
    """Replace `layer`'s dense weight by `weight` (same [out, in] shape) and compute through a kernel.

    `input_perm`: the input columns of `weight` are in this order (activation-ordered GPTQ), so x is
    permuted by it before the matmul.
    """
    if tuple(weight.shape) != (layer.out_features, layer.in_features):
        raise ValueError(f"quantized weight shape {tuple(weight.shape)} does not match the layer's "
                         f"{(layer.out_features, layer.in_features)}")
    dtype = compute_dtype(layer)
    if input_perm is None:
        method = QuantizedLinearMethod(weight, act, dtype)
    else:
        method = InputPermutedLinearMethod(weight, input_perm, act, dtype)
    layer.weight = None  # the dense weight is no longer used; free its memory
    layer.method = method
    return layer
