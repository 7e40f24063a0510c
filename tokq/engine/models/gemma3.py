"""Gemma 3 (text): sliding-window and global layers with their own RoPE bases, QK-norm,
four norms per block (pre and post around both attention and MLP), GeGLU, embeddings scaled
by sqrt(hidden), (1 + w) RMSNorm weights, softmax scale from query_pre_attn_scalar.
"""

from __future__ import annotations

import torch
from torch import nn

from tokq.engine.attention import AttentionBackend, SelfAttention
from tokq.engine.config import ModelConfig
from tokq.engine.layers import GatedMLP, RMSNorm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = SelfAttention.from_config(config, layer)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        eps, hidden, offset = config.rms_norm_eps, config.hidden_size, config.norm_weight_offset
        self.input_layernorm = RMSNorm(hidden, eps, offset)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset)

    def forward(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), rope, backend)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)
