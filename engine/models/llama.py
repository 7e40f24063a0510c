"""Llama family: Llama 2/3 (incl. llama3 RoPE scaling), SmolLM, Mistral, Qwen2 (qkv bias), Qwen3 (QK-norm).

A pre-norm block: h += attn(norm(h)); h += mlp(norm(h)), SwiGLU MLP, GQA attention.
"""

from __future__ import annotations

import torch
from torch import nn

from tokq.engine.attention import AttentionBackend, AttentionSpec, SelfAttention
from tokq.engine.config import ModelConfig
from tokq.engine.layers import GatedMLP, RMSNorm


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        spec = AttentionSpec(layer, config.attn_scale, config.layer_window(layer))
        self.self_attn = SelfAttention(
            layer,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            spec,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
