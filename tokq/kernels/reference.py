"""Reference (oracle) paths: dequantize to fp32, then a plain matmul.

Every faster path is tested against these. The quantized-weight containers here are tokq's
in-memory layout, chosen to match compressed-tensors' conventions so writing that format is a
packing step only:

- integer weights: signed codes `q` (int8 tensor, [N, K], values in [-2^(b-1), 2^(b-1) - 1]),
  `scale` [N, G] fp32 and optional signed `zero` [N, G] (asymmetric), with G = K / group_size
  (G = 1 for per-channel). Dequantized: W[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)],
  g(k) = k // group_size.
- fp8 weights: `q` float8_e4m3fn [N, K] and `scale` [N, 1] fp32: W = q.float() * scale.

Activations (W8A8) are quantized per token, dynamically: s_t = max|x_t| / qmax, x_q = round(x / s_t).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_E4M3_MAX = 448.0


@dataclass
class IntWeight:
    q: torch.Tensor  # int8 [N, K] signed codes
    scale: torch.Tensor  # fp32 [N, G]
    zero: torch.Tensor | None  # int8 [N, G] signed zero points, None when symmetric
    bits: int
    group_size: int  # == K for per-channel

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        groups = self.scale.shape[1]
        q = self.q.float().view(n, groups, k // groups)
        if self.zero is not None:
            q = q - self.zero.float().unsqueeze(-1)
        return (q * self.scale.float().unsqueeze(-1)).view(n, k).to(dtype)


@dataclass
class FP8Weight:
    q: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # fp32 [N, 1]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale.float()).to(dtype)


QuantizedWeight = IntWeight | FP8Weight


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per token (row): x [..., K] -> (codes int8, scale fp32 [..., 1])."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(x / scale).clamp(-128, 127).to(torch.int8), scale


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic fp8 e4m3 per token: x [..., K] -> (fp8 values, scale fp32 [..., 1])."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_E4M3_MAX
    return (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def fake_quantize_activations(x: torch.Tensor, act: str | None) -> torch.Tensor:
    """What a W8A8 kernel sees of x, in fp32: quantize per token, then dequantize."""
    if act is None:
        return x.float()
    if act == "int8":
        codes, scale = quantize_per_token_int8(x)
        return codes.float() * scale
    if act == "fp8":
        values, scale = quantize_per_token_fp8(x)
        return values.float() * scale
    raise ValueError(f"activation quantization {act!r} is not supported (None, 'int8', 'fp8')")


def linear_reference(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, act: str | None = None
) -> torch.Tensor:
    """The oracle: y = fakequant(x) @ dequant(W)^T + b in fp32, returned in x's dtype."""
    out = torch.matmul(fake_quantize_activations(x, act), weight.dequantize(torch.float32).t())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
