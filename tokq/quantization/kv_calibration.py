"""Calibrating KV-cache scales: the per-layer, per-KV-head |K| and |V| maxima over calibration documents.

The model runs its dense forward over the calibration windows with an attention backend that records, for each
layer, the largest |K| and |V| of each KV head as the backend receives them: K after QK-norm and RoPE, exactly
what the paged cache stores, then attends as the dense backend does. Run it on the model as it will serve (after
its weights are quantized), so the scales cover the K and V the quantized model produces. amax (not a clipped
percentile) because a clipped key changes which tokens attention picks; per head because heads' ranges differ by
orders of magnitude, and one per-tensor scale would spend an fp8 or int8 cache's range on the widest head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokq.engine.attention import AttentionSpec, DenseCausalAttention
from tokq.engine.kv_scales import KVScales
from tokq.engine.models import CausalLM


class AmaxRecorder:
    """An attention backend that records per-layer, per-KV-head |K| and |V| maxima, then attends densely."""

    name = "kv-amax-recorder"

    def __init__(self, num_layers: int, num_kv_heads: int):
        self.k_amax = torch.zeros(num_layers, num_kv_heads)
        self.v_amax = torch.zeros(num_layers, num_kv_heads)
        self.dense = DenseCausalAttention()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        # k/v [B, T, Hkv, D]: reduce over batch, tokens and head_dim
        layer = spec.layer
        self.k_amax[layer] = torch.maximum(self.k_amax[layer], k.detach().abs().amax(dim=(0, 1, 3)).float().cpu())
        self.v_amax[layer] = torch.maximum(self.v_amax[layer], v.detach().abs().amax(dim=(0, 1, 3)).float().cpu())
        return self.dense.attend(q, k, v, spec)


@torch.inference_mode()
def calibrate_kv_scales(model: CausalLM, tokens: torch.Tensor, batch_size: int = 4, source: str = "calibrated",
                        on_batch: Callable[[int], None] | None = None) -> KVScales:
    """KV scales from the dense forward of `model` over `tokens` [N, T] (int64), `batch_size` windows at a time."""
    if tokens.dim() != 2 or tokens.shape[0] == 0:
        raise ValueError(f"calibration tokens must be [windows, tokens] with at least one window, got {tuple(tokens.shape)}")
    config = model.config
    recorder = AmaxRecorder(config.num_layers, config.num_kv_heads)
    device = model.device
    for start in range(0, tokens.shape[0], batch_size):
        model(tokens[start: start + batch_size].to(device), backend=recorder)  # hidden states only: no LM head
        if on_batch:
            on_batch(start // batch_size)
    return KVScales(recorder.k_amax, recorder.v_amax, "attn_head", source)
