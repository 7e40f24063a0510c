"""Quantization primitives shared by every method: scale/zero choice, rounding, fake-quantization.

All work in fp32 on [N, K] weights (N output channels, K inputs). Group g covers inputs
[g * group_size, (g + 1) * group_size). The results use the layout of `kernels.reference`
(signed codes, fp32 scales, signed zero points), which is compressed-tensors' convention.
"""

from __future__ import annotations

import torch

from tokq.errors import TokqError
from tokq.kernels.reference import FP8_E4M3_MAX, FP8Weight, IntWeight
from tokq.quantization.scheme import CHANNEL, WeightArgs


def _grouped(w: torch.Tensor, args: WeightArgs) -> torch.Tensor:
    n, k = w.shape
    groups = args.groups_for(k)
    return w.reshape(n, groups, k // groups)


def int_qparams(
    w: torch.Tensor, args: WeightArgs, clip_ratio: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale [N, G] and signed zero point [N, G] (None if symmetric) from each group's range.

    `clip_ratio` (scalar or [N, G]) shrinks the range before the scale is chosen: AWQ's and
    GPTQ's clipping searches pass their best ratio here.
    """
    g = _grouped(w.float(), args)
    lo, hi = g.amin(-1), g.amax(-1)
    if isinstance(clip_ratio, torch.Tensor):
        clip_ratio = clip_ratio.to(lo.device)
    if args.symmetric:
        # max|w| maps to half the integer range (7.5 for int4), as in GPTQ's and compressed-tensors'
        # symmetric grids: the extreme lands on -8 or +7 after rounding and clamping.
        amax = torch.maximum(lo.abs(), hi.abs()) * clip_ratio
        scale = (amax / ((args.qmax - args.qmin) / 2)).clamp_min(1e-10)
        return scale, None
    lo, hi = (lo * clip_ratio).clamp(max=0), (hi * clip_ratio).clamp(min=0)
    levels = args.qmax - args.qmin
    scale = ((hi - lo) / levels).clamp_min(1e-10)
    zero = torch.round(args.qmin - lo / scale).clamp(args.qmin, args.qmax)
    return scale, zero.to(torch.int8)


# The clip ratios and error exponent of the MSE scale search (`mse_qparams`): llm-compressor's `mse`
# observer uses the same shrink steps (1.00, 0.98, ..., down to 0.70 here) and the same |w - q|^2.4 norm,
# which weighs large rounding errors a little more than squared error does.
MSE_CLIP_RATIOS = tuple(round(1.0 - 0.02 * i, 2) for i in range(16))
MSE_NORM = 2.4


def mse_qparams(
    w: torch.Tensor, args: WeightArgs, ratios: tuple[float, ...] = MSE_CLIP_RATIOS, norm: float = MSE_NORM,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`int_qparams` with each group's range shrunk by the ratio (of `ratios`) that minimises the group's
    sum of importance_k * |w - q|^norm, q the weights rounded onto that grid; `importance` [K] defaults to 1.

    The min/max grid spends its levels on each group's extreme weights; a slightly clipped grid rounds
    the bulk of the group more finely. Ties keep the larger ratio (the first tried)."""
    g = _grouped(w.float(), args)
    imp = None if importance is None else _grouped(importance.float().reshape(1, -1), args)
    best_err = best_scale = best_zero = None
    for ratio in ratios:
        scale, zero = int_qparams(w, args, ratio)
        s = scale.unsqueeze(-1)
        z = 0.0 if zero is None else zero.float().unsqueeze(-1)
        err = ((torch.round(g / s + z).clamp(args.qmin, args.qmax) - z) * s - g).abs().pow(norm)
        err = (err if imp is None else err * imp).sum(-1)
        if best_err is None:
            best_err, best_scale, best_zero = err, scale, zero
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if zero is not None:
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def quantize_with(w: torch.Tensor, args: WeightArgs, scale: torch.Tensor, zero: torch.Tensor | None) -> IntWeight:
    """Round w onto a given grid (per group) and return the integer weight."""
    g = _grouped(w.float(), args)
    z = 0.0 if zero is None else zero.float().unsqueeze(-1)
    q = torch.round(g / scale.unsqueeze(-1) + z).clamp(args.qmin, args.qmax)
    n, k = w.shape
    group_size = k if args.strategy == CHANNEL else args.group_size
    return IntWeight(q.reshape(n, k).to(torch.int8), scale.float(), zero, args.bits, group_size)


def quantize_rtn(w: torch.Tensor, args: WeightArgs, clip_ratio: torch.Tensor | float = 1.0) -> IntWeight:
    """Round-to-nearest on the min/max (or abs-max) grid of each group."""
    check_finite(w, "weight")
    scale, zero = int_qparams(w, args, clip_ratio)
    return quantize_with(w, args, scale, zero)


def fake_quantize(w: torch.Tensor, args: WeightArgs, clip_ratio: torch.Tensor | float = 1.0) -> torch.Tensor:
    """w rounded onto its quantization grid, as fp32 (what the quantized model will compute with).

    The searches call this hundreds of times per block, so it stays in fp32 (no int8 codes) and
    skips the NaN scan that `quantize_weight` does once per layer. Same values as
    `quantize_rtn(w, args, clip_ratio).dequantize()`.
    """
    if args.kind == "float":
        return quantize_fp8(w).dequantize()
    scale, zero = int_qparams(w, args, clip_ratio)
    g = _grouped(w.float(), args)
    s = scale.unsqueeze(-1)
    if zero is None:
        return (torch.round(g / s).clamp(args.qmin, args.qmax) * s).reshape(w.shape)
    z = zero.float().unsqueeze(-1)
    return ((torch.round(g / s + z).clamp(args.qmin, args.qmax) - z) * s).reshape(w.shape)


def quantize_fp8(w: torch.Tensor) -> FP8Weight:
    """fp8 e4m3 with one scale per output channel: scale = max|w_n| / 448."""
    check_finite(w, "weight")
    scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp_min(1e-12)
    q = (w.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return FP8Weight(q, scale)


def check_finite(t: torch.Tensor, what: str, where: str = "") -> None:
    if not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        loc = f" in {where}" if where else ""
        raise TokqError(f"{bad} NaN/Inf values in the {what}{loc}: the checkpoint is corrupt or overflowed; "
                        "re-convert it or load it in fp32")
