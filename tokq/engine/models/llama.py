"""Llama family: Llama 2/3 (incl. llama3 RoPE scaling), SmolLM, Mistral, Qwen2 (qkv bias), Qwen3 (QK-norm).

A pre-norm block: h += attn(norm(h)); h += mlp(norm(h)), SwiGLU MLP, GQA attention.
"""

from __future__ import annotations

import torch
from torch import nn

from tokq.engine.attention import AttentionBackend, SelfAttention
from tokq.engine.config import ModelConfig
from tokq.engine.layers import GatedMLP, RMSNorm


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = SelfAttention.from_config(config, layer)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
