"""SmoothQuant (Xiao et al., arXiv 2211.10438): migrate activation outliers into the weights, then W8A8.

Per block: record each linear's per-input-channel activation range max|X_j| on the calibration
set; for each scale mapping choose s_j = max|X_j|^a / max|W_j|^(1-a) (a = migration strength,
default 0.5), fold it into the producer (norm weight or earlier linear's rows) and the consumer's
columns; then quantize weights per output channel (int8 symmetric, RTN) and let activations be
quantized per token at run time. With `alpha=None` a is searched per block over a small grid,
minimising the W8A8 block's output error against the 16-bit block.
"""

from __future__ import annotations

import copy

import torch

from tokq.engine.layers import Linear
from tokq.quantization.calibration import BlockContext, capture_inputs
from tokq.quantization.mappings import block_mappings, fold_scales_
from tokq.quantization.methods.block_ops import block_linears, install_, quantize_weight
from tokq.quantization.methods.options import MethodOptions
from tokq.quantization.scheme import QuantScheme


@torch.no_grad()
def activation_absmax(ctx: BlockContext, linears: dict[str, Linear]) -> dict[str, torch.Tensor]:
    """max |x_j| over all calibration tokens, per input channel of each linear (streamed, no storage)."""
    amax: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        m = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
        amax[name] = m if name not in amax else torch.maximum(amax[name], m)

    with capture_inputs(linears, record):
        ctx.forward()
    return amax


def smoothing_scales(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    w_absmax = weight.float().abs().amax(0).clamp_min(1e-5)
    s = act_absmax.clamp_min(1e-5).pow(alpha) / w_absmax.pow(1 - alpha)
    return s.clamp(1e-5, 1e5)


def _smooth_and_quantize(ctx: BlockContext, block: torch.nn.Module, scheme: QuantScheme,
                         amax: dict[str, torch.Tensor], alpha: float) -> None:
    linears = {name: m for name, m in block.named_modules() if isinstance(m, Linear)}
    for mapping in block_mappings(block):
        if mapping.linear in amax:
            s = smoothing_scales(amax[mapping.linear], linears[mapping.linear].weight, alpha)
            fold_scales_(block, mapping, s)
    weights = {name: quantize_weight(linears[name].weight, scheme, f"model.layers.{ctx.index}.{name}")
               for name in amax}
    trial_ctx = BlockContext(ctx.index, block, ctx.inputs, ctx.rope, ctx.batch_size)
    install_(trial_ctx, scheme, weights)


def quantize_block(ctx: BlockContext, scheme: QuantScheme, options: MethodOptions) -> dict:
    linears = block_linears(ctx, scheme)
    amax = activation_absmax(ctx, linears)
    alpha = options.alpha
    stats: dict = {}
    if alpha is None:
        samples = ctx.inputs[: options.awq_search_samples]
        reference = ctx.run_sub(ctx.block, samples, needs_rope=True).float()
        errors = {}
        for a in options.alpha_grid:
            trial = copy.deepcopy(ctx.block)
            _smooth_and_quantize(ctx, trial, scheme, amax, a)
            errors[a] = (ctx.run_sub(trial, samples, needs_rope=True).float() - reference).pow(2).mean().item()
        alpha = min(errors, key=errors.get)
        stats["alpha_errors"] = errors
    stats["alpha"] = alpha
    _smooth_and_quantize(ctx, ctx.block, scheme, amax, alpha)
    return stats
