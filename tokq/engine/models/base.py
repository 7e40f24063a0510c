"""The causal-LM shell every family shares: embeddings, the decoder stack, final norm, LM head.

A family supplies only its decoder layer. Module names follow the HF checkpoint names
(model.embed_tokens, model.layers.N.self_attn, ..., lm_head) so loading is a name lookup.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokq.engine.attention import AttentionBackend, DenseCausalAttention
from tokq.engine.config import ModelConfig
from tokq.engine.layers import Linear, RMSNorm, RotaryEmbedding
from tokq.engine.tokenizer import check_token_ids

DecoderLayerFactory = Callable[[ModelConfig, int], nn.Module]


class DecoderStack(nn.Module):
    """HF's `model.*` part: embed_tokens, layers, norm."""

    def __init__(self, config: ModelConfig, make_layer: DecoderLayerFactory):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, make_layer: DecoderLayerFactory):
        super().__init__()
        self.config = config
        self.name = config.architecture  # load_model sets the checkpoint folder: errors name the model by it
        # calibrated KV-cache scales (engine/kv_scales.KVScales): load_model reads a checkpoint's, quantize sets them
        self.kv_scales = None
        self.model = DecoderStack(config, make_layer)
        self.lm_head = Linear(config.hidden_size, [("lm_head", config.vocab_size)])
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # One RoPE table per layer type (Gemma 3's local and global layers use different bases).
        self.rotary = nn.ModuleDict(
            {kind: RotaryEmbedding(rope, config.head_dim) for kind, rope in config.rope.items()}
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        backend: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> final hidden states [B, T, hidden]; `compute_logits` turns them into logits.

        Logits are separate because a long window's full-vocabulary logits may not fit in memory
        at once (2048 tokens x 262K vocab x 4 bytes = 2 GiB): scorers compute them in chunks.
        """
        if backend is None:
            # The dense path (perplexity, divergence, logits) is where caller-given ids enter; the engine's
            # paged backend runs ids its add_request has checked already, without a device sync per step.
            check_token_ids(input_ids, self.config.vocab_size, self.name)
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        backend = backend or DenseCausalAttention()
        hidden = self.model.embed_tokens(input_ids)
        if self.config.embed_scale != 1.0:
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        ropes = {kind: rot.cos_sin(positions, hidden.dtype) for kind, rot in self.rotary.items()}
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, ropes[self.config.layer_types[i]], backend)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence forward returning logits: the oracle for every later path."""
        return self.compute_logits(self.forward(input_ids))
