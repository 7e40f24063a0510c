"""Which operation feeds which linear inside a decoder block, for scale migration (AWQ, SmoothQuant).

Scaling the input channels of a linear by s and dividing the operation that produces its input
by s leaves the block's function unchanged in exact arithmetic; AWQ and SmoothQuant choose s to
make the scaled weights (or activations) easier to quantize. Producers are RMSNorms (folded into
their weight) or the row block of an earlier linear (the up projection for down_proj; the value
projection for o_proj when there is no GQA, so v's rows line up with o's inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokq.engine.layers import Linear, RMSNorm


@dataclass
class ScaleMapping:
    name: str  # e.g. "attn_in"
    linear: str  # the consuming Linear's name inside the block, e.g. "self_attn.qkv_proj"
    producer: RMSNorm | tuple[Linear, str]  # a norm, or (merged Linear, shard name)
    inspect: str | None  # sub-module whose output AWQ's search compares ("self_attn", "mlp"), None: the linear


def block_mappings(block: nn.Module) -> list[ScaleMapping]:
    attn, mlp = block.self_attn, block.mlp
    mlp_norm = getattr(block, "pre_feedforward_layernorm", None) or block.post_attention_layernorm
    maps = [ScaleMapping("attn_in", "self_attn.qkv_proj", block.input_layernorm, "self_attn")]
    if attn.num_heads == attn.num_kv_heads:
        maps.append(ScaleMapping("attn_out", "self_attn.o_proj", (attn.qkv_proj, "v_proj"), None))
    maps.append(ScaleMapping("mlp_in", "mlp.gate_up_proj", mlp_norm, "mlp"))
    maps.append(ScaleMapping("mlp_out", "mlp.down_proj", (mlp.gate_up_proj, "up_proj"), None))
    return maps


@torch.no_grad()
def fold_scales_(block: nn.Module, mapping: ScaleMapping, scales: torch.Tensor) -> None:
    """W[:, j] *= s_j on the consumer and divide the producer's output channel j by s_j."""
    linear: Linear = block.get_submodule(mapping.linear)
    s = scales.to(linear.weight.device, torch.float32)
    linear.weight.copy_((linear.weight.float() * s).to(linear.weight.dtype))
    producer = mapping.producer
    if isinstance(producer, RMSNorm):
        w = producer.weight.float()
        # Gemma's norms multiply by (offset + w): divide the effective weight, store it back minus the offset.
        producer.weight.copy_(((producer.weight_offset + w) / s - producer.weight_offset).to(producer.weight.dtype))
        return
    source, shard_name = producer
    shard = source.shard(shard_name)
    rows = source.weight.narrow(0, shard.offset, shard.size)
    rows.copy_((rows.float() / s[:, None]).to(rows.dtype))
    if source.bias is not None:
        bias = source.bias.narrow(0, shard.offset, shard.size)
        bias.copy_((bias.float() / s).to(bias.dtype))
