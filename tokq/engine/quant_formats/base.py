"""What every quantized-checkpoint reader shares: the unpacked shard, the format interface, the shape checks.

A reader turns one checkpoint projection's tensors (suffix -> tensor) into tokq's in-memory layout, a
`ShardWeight` around `kernels.reference.IntWeight` / `FP8Weight`: signed codes [N, K], fp32 scales
[N, G], signed zero points [N, G] or None (N = output features, K = input features, G = groups). A
`QuantFormat` names the tensors a quantized projection has in its layout and reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokq.errors import ModelError
from tokq.kernels.reference import QuantizedWeight


@dataclass
class ShardWeight:
    """One checkpoint projection, unpacked; `g_idx` is set when its groups are not contiguous."""

    weight: QuantizedWeight
    act: str | None = None
    g_idx: torch.Tensor | None = None  # int64 [K]: group of each input column (original column order)


class QuantFormat:
    """A checkpoint quantization format: names its tensors and turns one projection's tensors into weights."""

    method: str
    suffixes: tuple[str, ...]  # tensor-name suffixes read for a quantized projection
    marker: str  # a projection is quantized when `<name>.<marker>` exists

    def is_quantized(self, name: str, keys: set[str]) -> bool:
        return f"{name}.{self.marker}" in keys

    def read(self, name: str, tensors: dict[str, torch.Tensor]) -> ShardWeight:
        raise NotImplementedError


def need(tensors: dict[str, torch.Tensor], prefix: str, suffix: str) -> torch.Tensor:
    if suffix not in tensors:
        raise ModelError(f"tensor {prefix}.{suffix} is missing from the checkpoint; the quantized checkpoint is "
                         "incomplete: re-export it")
    return tensors[suffix]


def check_scale(name: str, scale: torch.Tensor) -> torch.Tensor:
    """A weight scale as fp32, refused unless it is a float tensor of finite values >= 0, not all 0: an int32 scale,
    a negative one or a tensor of zeros is no checkpoint any quantizer writes, and was read silently into
    sign-flipped or zeroed weights. (A single zero is an all-zero group's scale in fp16, which is exact.)"""
    if not scale.is_floating_point():
        raise ModelError(f"tensor {name} has dtype {scale.dtype}; weight scales are floating point (fp16, bf16 or "
                         "fp32): the checkpoint is corrupt or not the format it claims, re-export it")
    scale = scale.float()
    bad = ~torch.isfinite(scale) | (scale < 0)
    if bool(bad.any()):
        value = float(scale[bad][0])
        raise ModelError(f"tensor {name} holds {int(bad.sum())} scale(s) that are negative or not finite (e.g. "
                         f"{value:g}): no quantizer writes those; the checkpoint is corrupt, re-export it")
    if scale.numel() and not bool(scale.any()):
        raise ModelError(f"tensor {name} is all zeros: every weight of the layer would read as 0; the checkpoint "
                         "is corrupt, re-export it")
    return scale


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], fix: str = "") -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ModelError(f"tensor {name} has shape {tuple(tensor.shape)} but {expected} was expected "
                         f"{fix or 'from config.json and the quantization config'}; the checkpoint is inconsistent")


def check_2d(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2:
        raise ModelError(f"tensor {name} has shape {tuple(tensor.shape)}, expected 2 dimensions [groups, outputs]")


def group_size_of(k: int, groups: int, name: str) -> int:
    if groups < 1 or k % groups:
        raise ModelError(f"{name}: {groups} groups do not split the input size {k} evenly; tokq needs equal-size "
                         "groups (choose a group size that divides every layer's input size)")
    return k // groups
