"""What a linear kernel is chosen for: one quantized weight, its activation scheme, device and dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokq.dtypes import DTYPE_NAMES

from .reference import FP8Weight, IntWeight, QuantizedWeight

WEIGHT_FORMATS = ("int", "fp8")  # LinearProblem.fmt: IntWeight, FP8Weight
ACT_SCHEMES = (None, "int8", "fp8")  # LinearProblem.act: weight-only, W8A8 int8, W8A8 fp8


@dataclass(frozen=True)
class LinearProblem:
    device: str  # torch device type: "cpu", "cuda"
    fmt: str  # "int" (IntWeight) or "fp8" (FP8Weight)
    bits: int
    group_size: int  # == k for per-channel scales
    symmetric: bool
    act: str | None  # activation quantization: None (weight-only), "int8", "fp8"
    n: int  # output features
    k: int  # input features
    dtype: torch.dtype  # the activations' dtype (the model's compute dtype)

    @classmethod
    def of(cls, weight: QuantizedWeight, act: str | None, dtype: torch.dtype,
           device: torch.device | str | None = None) -> LinearProblem:
        device = torch.device(device) if device is not None else weight.q.device
        n, k = weight.q.shape
        if isinstance(weight, FP8Weight):
            return cls(device.type, "fp8", 8, k, True, act, n, k, dtype)
        if not isinstance(weight, IntWeight):
            raise TypeError(f"not a quantized weight: {type(weight).__name__}")
        return cls(device.type, "int", weight.bits, weight.group_size, weight.zero is None, act, n, k, dtype)

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.k

    @property
    def scheme(self) -> str:
        """e.g. int4-asym-g64, int8-aint8, fp8-afp8 (the same words as QuantizedLinearMethod.name)."""
        w = "fp8" if self.fmt == "fp8" else f"int{self.bits}" + ("" if self.symmetric else "-asym")
        grouping = "" if self.fmt == "fp8" or self.per_channel else f"-g{self.group_size}"
        return f"{w}{grouping}{'-a' + self.act if self.act else ''}"

    def describe(self) -> str:
        return f"{self.scheme} [N={self.n}, K={self.k}] with {DTYPE_NAMES.get(self.dtype, self.dtype)} activations on {self.device}"
