"""The attention seam: self-attention modules hand q/k/v to a backend chosen per forward.

A model's forward takes an `AttentionBackend`. The model computes projections, QK-norm and RoPE,
then calls `backend.attend(layer, q, k, v, spec)` and never touches a KV cache itself. Backends:

- `DenseCausalAttention` (here): the whole sequence at once, no cache. It is the oracle that every
  later path is tested against (what HF computes).
- the paged backend (engine issue): writes k/v into cache blocks through a slot mapping and
  reads them back through block tables, for chunked prefill and decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokq.engine.config import ModelConfig
from tokq.engine.layers import Linear, RMSNorm, apply_rotary


@dataclass(frozen=True)
class AttentionSpec:
    """What a layer asks of the backend besides q/k/v."""

    layer: int
    scale: float
    sliding_window: int | None = None  # a query at i sees keys j with i - j < window


class AttentionBackend(Protocol):
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        """q [B, T, Hq, D], k/v [B, T, Hkv, D] for the new tokens -> [B, T, Hq, D]."""
        ...


def causal_mask(q_len: int, kv_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [q_len, kv_len] mask (True = attend); queries are the last q_len positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    return allowed


class DenseCausalAttention:
    """Full-sequence causal attention with no cache, via scaled_dot_product_attention."""

    name = "dense-sdpa"

    def __init__(self) -> None:
        self._masks: dict[tuple[int, int | None, torch.device], torch.Tensor] = {}

    def _mask(self, length: int, window: int | None, device: torch.device) -> torch.Tensor:
        key = (length, window, device)
        if key not in self._masks:
            self._masks[key] = causal_mask(length, length, window, device)
        return self._masks[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        length = q.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        groups = q.shape[1] // k.shape[1]
        window = spec.sliding_window if spec.sliding_window and spec.sliding_window < length else None
        # SDPA's native GQA (no K/V copies) measured 15-30% faster than repeat_interleave on CPU.
        mask = None if window is None else self._mask(length, window, q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=spec.scale, enable_gqa=groups > 1
        )
        return out.transpose(1, 2)


class SelfAttention(nn.Module):
    """Projections, optional QK-norm, RoPE, then the backend's attention, then o_proj."""

    def __init__(
        self,
        layer: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        spec: AttentionSpec,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        norm_weight_offset: float = 0.0,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(
            hidden, [("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)], qkv_bias
        )
        self.o_proj = Linear(self.q_size, [("o_proj", hidden)], o_bias)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, norm_weight_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, norm_weight_offset)
        self.spec = spec

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend
    ) -> torch.Tensor:
        """x [B, T, hidden]; rope = (cos, sin) [B, T, head_dim] for this layer's RoPE, computed once per forward."""
        batch, length, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(batch, length, self.num_heads, self.head_dim)
        k = k.view(batch, length, self.num_kv_heads, self.head_dim)
        v = v.view(batch, length, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.attend(q, k, v, self.spec)
        return self.o_proj(out.reshape(batch, length, self.q_size))

    @classmethod
    def from_config(cls, config: ModelConfig, layer: int) -> SelfAttention:
        """The layer's attention as the config describes it (window, biases, QK-norm, softmax scale)."""
        return cls(
            layer,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            AttentionSpec(layer, config.attn_scale, config.layer_window(layer)),
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
            norm_weight_offset=config.norm_weight_offset,
        )
