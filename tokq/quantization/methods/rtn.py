"""Round-to-nearest: each group's min/max (or abs-max) grid, no calibration. The baseline to beat."""

from __future__ import annotations

from tokq.quantization.calibration import BlockContext
from tokq.quantization.layer_schemes import LayerSchemes
from tokq.quantization.methods.block_ops import block_linears, install_, layer_scheme, quantize_weight
from tokq.quantization.methods.options import MethodOptions
from tokq.quantization.scheme import QuantScheme


def quantize_block(ctx: BlockContext, scheme: QuantScheme | LayerSchemes, options: MethodOptions) -> dict:
    linears = block_linears(ctx, scheme)
    weights = {name: quantize_weight(lin.weight, layer_scheme(scheme, ctx, name), f"model.layers.{ctx.index}.{name}")
               for name, lin in linears.items()}
    install_(ctx, scheme, weights)
    return {}
