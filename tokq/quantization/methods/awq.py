"""AWQ (Lin et al., arXiv 2306.00978): activation-aware per-channel scales, then a clipping search.

Per block:
1. Capture the inputs X of every linear on the calibration set (dense block).
2. For each scale mapping (norm -> qkv, norm -> gate/up, up -> down, v -> o without GQA), grid
   search s = mean|X|^a / mean|W~|^(1-a) over a in [0, 1), normalised, minimising the output
   error of the module the linear feeds (the attention for qkv, the MLP for gate/up, the linear
   itself otherwise) when W*s is fake-quantized and X/s is fed in. Fold the best s into the
   producer (norm weight or earlier linear's rows) and the consumer's columns.
3. Re-capture the inputs (now X/s) and search, per output row and group, the clip ratio of the
   weight range that minimises ||X W^T - X Q(W)^T||; q/k rows are left unclipped (attention
   scores, not the projection, are what matters for them).
4. Quantize with the chosen clip and install the quantized linears.

In a mix (`LayerSchemes`) each linear is searched and quantized with its own scheme, and a mapping whose
linear stays 16-bit is skipped (no scales folded: there is no rounding to protect it from).
"""

from __future__ import annotations

import torch

from tokq.engine.layers import Linear
from tokq.quantization.calibration import BlockContext
from tokq.quantization.layer_schemes import LayerSchemes
from tokq.quantization.mappings import block_mappings, fold_scales_
from tokq.quantization.methods.block_ops import (
    block_linears,
    capture_block_inputs,
    install_,
    layer_scheme,
    quantize_weight,
)
from tokq.quantization.methods.options import MethodOptions
from tokq.quantization.rounding import fake_quantize
from tokq.quantization.scheme import QuantScheme, WeightArgs


def _weight_magnitude(w: torch.Tensor, args: WeightArgs) -> torch.Tensor:
    """Mean over rows of |w| normalised by its group's max: AWQ's per-input-channel weight salience."""
    n, k = w.shape
    groups = args.groups_for(k) if args.kind == "int" else 1
    g = w.abs().view(n, groups, k // groups)
    g = g / g.amax(dim=-1, keepdim=True).clamp_min(1e-8)
    return g.view(n, k).mean(0)


def grid_points(grid: int, stride: int, loss_at) -> tuple[int, dict[int, float]]:
    """The grid index in [0, grid) with the least loss_at(i), and every loss evaluated (index -> loss).

    stride 1 is the paper's exhaustive grid. stride s > 1 searches coarse-to-fine: every s-th point, then the
    points within s of the best of those, so 20 points cost 12 evaluations at s = 2 (11 at s = 4). It finds the
    exhaustive grid's point whenever the loss has one valley at the coarse spacing (benchmarks/awq_search.py
    measures how often that holds on a real model). Ties go to the smaller index, as in the exhaustive order; NaN never wins.
    """
    losses: dict[int, float] = {}

    def best() -> int:
        finite = {i: v for i, v in losses.items() if v == v}
        return min(finite, key=lambda i: (finite[i], i)) if finite else -1

    for i in range(0, grid, max(1, stride)):
        losses[i] = loss_at(i)
    if stride > 1 and best() >= 0:
        centre = best()
        for i in range(max(0, centre - stride + 1), min(grid, centre + stride)):
            if i not in losses:
                losses[i] = loss_at(i)
    return best(), losses


@torch.no_grad()
def search_scales(
    ctx: BlockContext, linear: Linear, x: torch.Tensor, inspect: torch.nn.Module, needs_rope: bool,
    args: WeightArgs, grid: int, stride: int = 1,
) -> tuple[torch.Tensor, dict]:
    """Best per-input-channel scale for `linear` given its inputs x [S, T, K] (see module docstring)."""
    original = linear.weight.data.clone()
    w = original.float()
    reference = ctx.run_sub(inspect, x, needs_rope).float()
    x_mean = x.abs().reshape(-1, x.shape[-1]).mean(0)
    w_mean = _weight_magnitude(w, args)

    def scales(i: int) -> torch.Tensor:
        ratio = i / grid
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp_min(1e-4)
        return s / (s.max() * s.min()).sqrt()

    def loss_at(i: int) -> float:
        s = scales(i)
        linear.weight.copy_((fake_quantize(w * s, args) / s).to(original.dtype))
        return (ctx.run_sub(inspect, x, needs_rope).float() - reference).pow(2).mean().item()

    try:
        best, losses = grid_points(grid, stride, loss_at)
    finally:
        linear.weight.copy_(original)
    if best < 0:  # every grid point gave NaN: leave the channel scales alone
        return torch.ones_like(x_mean), {"ratio": None, "loss": None}
    return scales(best), {"ratio": best / grid, "loss": losses[best], "loss_unscaled": losses[0],
                          "losses": [losses.get(i) for i in range(grid)]}  # None: not evaluated


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, args: WeightArgs, grid: int, rows_per_chunk: int = 512) -> torch.Tensor:
    """Per (row, group) clip ratio in (0.5, 1] minimising the group's output error on tokens x [T, K].

    The error of one group's output over the tokens, mean_t (x_t · d)^2 with d = Q(w) - w, equals
    d^T H d with H = X^T X / T the group's input Gram matrix, so H is built once and every ratio
    costs [rows, G, gs^2] instead of a pass over all tokens; all ratios are tried in one batch.
    """
    n, k = w.shape
    groups = args.groups_for(k)
    size = k // groups
    xg = x.float().reshape(-1, groups, size)  # [T, G, gs]
    gram = torch.einsum("tgs,tgu->gsu", xg, xg) / xg.shape[0]  # [G, gs, gs]
    ratios = torch.tensor([1.0 - 0.5 * i / grid for i in range(grid)])
    best_ratio = torch.ones(n, groups)
    for start in range(0, n, rows_per_chunk):
        wc = w[start : start + rows_per_chunk].float()
        errs = []
        for ratio in ratios.tolist():
            d = (fake_quantize(wc, args, clip_ratio=ratio) - wc).view(-1, groups, size)  # [R, G, gs]
            errs.append(torch.einsum("rgs,gsu,rgu->rg", d, gram, d))
        best_ratio[start : start + rows_per_chunk] = ratios[torch.stack(errs).argmin(0)]  # first (largest) on ties
    return best_ratio


def quantize_block(ctx: BlockContext, scheme: QuantScheme | LayerSchemes, options: MethodOptions) -> dict:
    linears = block_linears(ctx, scheme)
    # Each Linear's own weight arguments (one scheme, or its own in a mix): the scale and clip searches
    # fake-quantize the linear being scaled with them.
    weight_args = {name: layer_scheme(scheme, ctx, name).weights for name in linears}
    for name, lin in linears.items():
        if weight_args[name].kind == "int":
            weight_args[name].check_divides(lin.in_features, f"model.layers.{ctx.index}.{name}")
    stats: dict = {}
    inputs = capture_block_inputs(ctx, linears, samples=options.awq_search_samples)
    for mapping in block_mappings(ctx.block):
        if mapping.linear not in linears:  # ignored, or left 16-bit in a mix: nothing to protect
            continue
        linear = linears[mapping.linear]
        inspect = ctx.block.get_submodule(mapping.inspect) if mapping.inspect else linear
        scales, info = search_scales(ctx, linear, inputs[mapping.linear], inspect, mapping.inspect == "self_attn",
                                     weight_args[mapping.linear], options.awq_grid, options.awq_grid_stride)
        fold_scales_(ctx.block, mapping, scales)
        stats[mapping.name] = info
    # Inputs after folding (X / s): what the clipping search must see.
    inputs = capture_block_inputs(ctx, linears, samples=options.awq_search_samples)
    weights = {}
    for name, lin in linears.items():
        clip = 1.0
        args = weight_args[name]
        if args.kind == "int":
            x = inputs[name].reshape(-1, lin.in_features)
            step = max(1, x.shape[0] // options.awq_clip_tokens)
            clip = search_clip(lin.weight, x[::step][: options.awq_clip_tokens], args, options.awq_clip_grid)
            for shard in lin.shards:
                if shard.name in ("q_proj", "k_proj"):
                    clip[shard.offset : shard.offset + shard.size] = 1.0
            stats[f"{name}.mean_clip"] = float(clip.mean())
        weights[name] = quantize_weight(lin.weight, layer_scheme(scheme, ctx, name), f"model.layers.{ctx.index}.{name}",
                                        clip)
    install_(ctx, scheme, weights)
    return stats
