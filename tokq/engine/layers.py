"""Building blocks shared by every architecture, including the linear seam.

`Linear` is the one place a weight matrix is applied. Quantization later swaps a `Linear`'s
forward for a quantized kernel (through `Linear.set_method`) without the model files changing.
Projections that read the same input (q/k/v, gate/up) are merged into one `Linear` with named
output shards: one GEMM instead of three, and quantization sees the shared input once. The shard
names let checkpoints stay in the standard per-projection layout on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokq.engine.config import RopeConfig


class LinearMethod(Protocol):
    """How a Linear computes y = x W^T + b; the dense one is below, quantized ones come from quantize/."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinearMethod:
    """F.linear; bf16 on CPU through tokq's native GEMV (`tokq_native::bf16_gemv`, which itself hands more than two
    rows to torch's GEMM) once `use_native_gemv` has switched it on. torch's bf16 GEMV is compute-bound at decode
    shapes: the native one reads SmolLM2's weights 1.3-2.4x faster at one row (kernels/cpu/native/gemv.cpp)."""

    name = "dense"
    native_gemv = False  # set by use_native_gemv (ModelRunner on CPU); a constant to the compiled graph

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        w = layer.weight
        if self.native_gemv and x.dtype == w.dtype == torch.bfloat16 and x.device.type == "cpu":
            y = torch.ops.tokq_native.bf16_gemv(x.reshape(-1, w.shape[1]), w).view(*x.shape[:-1], w.shape[0])
            return y if layer.bias is None else y + layer.bias
        return F.linear(x, w, layer.bias)


def use_native_gemv() -> bool:
    """Run dense bf16 layers on CPU through tokq's native GEMV where its kernels build (TOKQ_NATIVE=0: never).
    Returns whether it is on."""
    from tokq.kernels.cpu import native

    DenseLinearMethod.native_gemv = native.unavailable() is None
    return DenseLinearMethod.native_gemv


DENSE = DenseLinearMethod()


@dataclass(frozen=True)
class Shard:
    """One checkpoint tensor's rows inside a merged Linear's output."""

    name: str  # suffix of the checkpoint tensor, e.g. "q_proj"
    offset: int
    size: int


class Linear(nn.Module):
    """The linear seam: a [out, in] weight (possibly merged from several checkpoint tensors)."""

    def __init__(self, in_features: int, shards: list[tuple[str, int]], bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.shards: list[Shard] = []
        offset = 0
        for name, size in shards:
            self.shards.append(Shard(name, offset, size))
            offset += size
        self.out_features = offset
        self.weight = nn.Parameter(torch.empty(offset, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(offset), requires_grad=False) if bias else None
        self.method: LinearMethod = DENSE

    def set_method(self, method: LinearMethod) -> None:
        self.method = method

    def shard(self, name: str) -> Shard:
        for s in self.shards:
            if s.name == name:
                return s
        raise KeyError(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        names = "+".join(s.name for s in self.shards)
        return f"{names}: in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, method={getattr(self.method, 'name', type(self.method).__name__)}"


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. `weight_offset=1` is Gemma's (1 + w) form.

    The cast order follows each family's reference so bf16 results agree bit-for-bit in spirit:
    Llama casts the normalized value back before scaling, Gemma scales in fp32 then casts.
    """

    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            return (h * (self.weight_offset + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def rope_inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """Inverse frequencies for default, linear-scaled and Llama-3-scaled RoPE (fp32)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_ctx = rope.original_max_position_embeddings or 8192
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables per position, computed in fp32 and cached per device."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope_inverse_frequencies(rope, head_dim), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., T] -> cos, sin [..., T, head_dim] in `dtype`."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B, T, D] (rotate-half convention of HF checkpoints)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up merged into one Linear (SwiGLU / GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act} is not supported; tokq supports {', '.join(ACTIVATIONS)}")
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, [("gate_proj", intermediate), ("up_proj", intermediate)], bias)
        self.down_proj = Linear(intermediate, [("down_proj", hidden)], bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)
