"""Block operations every method uses: its quantizable Linears, capturing their inputs, quantizing and installing weights."""

from __future__ import annotations

import fnmatch

import torch

from tokq.engine.layers import Linear
from tokq.engine.quant_linear import quantize_linear_
from tokq.kernels.reference import QuantizedWeight
from tokq.quantization.calibration import BlockContext, capture_inputs
from tokq.quantization.layer_schemes import LayerSchemes
from tokq.quantization.rounding import check_finite, quantize_fp8, quantize_rtn
from tokq.quantization.scheme import QuantScheme


def layer_scheme(scheme: QuantScheme | LayerSchemes, ctx: BlockContext, name: str) -> QuantScheme | None:
    """The scheme of the block's Linear `name`: the one scheme, or its own in a mix (None: it stays 16-bit)."""
    if isinstance(scheme, LayerSchemes):
        return scheme.for_layer(f"model.layers.{ctx.index}.{name}")
    return scheme


def block_linears(ctx: BlockContext, scheme: QuantScheme | LayerSchemes) -> dict[str, Linear]:
    """The block's Linears that the scheme quantizes (scheme.ignore matches full module names; in a mix, the
    Linears assigned a scheme).

    Their weights are checked for NaN/Inf here, before a method uses them: folded into scales (AWQ,
    SmoothQuant), a bad weight would spread into its producer's rows and be reported as that layer's.
    """
    out = {}
    for name, module in ctx.linears().items():
        full = f"model.layers.{ctx.index}.{name}"
        own = layer_scheme(scheme, ctx, name)
        if own is not None and not any(fnmatch.fnmatch(full, pat) or fnmatch.fnmatch(name, pat) for pat in own.ignore):
            if module.weight is not None:
                check_finite(module.weight, "weight", full)
            out[name] = module
    return out


def capture_block_inputs(ctx: BlockContext, linears: dict[str, Linear], samples: int | None = None) -> dict[str, torch.Tensor]:
    """Run the block on (the first `samples` of) its calibration inputs; return each linear's inputs [S, T, K]."""
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    inputs = ctx.inputs if samples is None else ctx.inputs[:samples]
    with capture_inputs(linears, lambda name, x: captured[name].append(x.detach().float())):
        ctx.forward(inputs)
    return {name: torch.cat(chunks) for name, chunks in captured.items()}


def quantize_weight(weight: torch.Tensor, scheme: QuantScheme, layer: str, clip_ratio=1.0) -> QuantizedWeight:
    check_finite(weight, "weight", layer)
    if scheme.weights.kind == "float":
        return quantize_fp8(weight.float())
    scheme.weights.check_divides(weight.shape[1], layer)
    return quantize_rtn(weight.float(), scheme.weights, clip_ratio)


def install_(ctx: BlockContext, scheme: QuantScheme | LayerSchemes, weights: dict[str, QuantizedWeight]) -> None:
    """Swap the block's Linears for their quantized forms (activations quantized per each one's scheme)."""
    for name, weight in weights.items():
        own = layer_scheme(scheme, ctx, name)
        act = own.activations.name if own.activations else None
        quantize_linear_(ctx.block.get_submodule(name), weight, act)
