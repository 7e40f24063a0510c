"""GPTQ (Frantar et al., arXiv 2210.17323) applied block by block.

Within a block the linears are quantized in execution order (qkv, o, gate/up, down) when
`true_sequential` is on: each one's Hessian is collected with the earlier ones already
quantized, so later layers learn to compensate for the earlier layers' rounding, as they will
see it at run time. The per-layer algorithm lives in `quantization.gptq_solver`.
"""

from __future__ import annotations

from tokq.engine.quant_linear import quantize_linear_
from tokq.quantization.calibration import BlockContext
from tokq.quantization.gptq_solver import HessianAccumulator, gptq_quantize
from tokq.quantization.layer_schemes import LayerSchemes
from tokq.quantization.methods.block_ops import block_linears, layer_scheme
from tokq.quantization.methods.options import MethodOptions
from tokq.quantization.scheme import QuantScheme

EXECUTION_ORDER = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_block(ctx: BlockContext, scheme: QuantScheme | LayerSchemes, options: MethodOptions) -> dict:
    linears = block_linears(ctx, scheme)
    schemes = {name: layer_scheme(scheme, ctx, name) for name in linears}  # each Linear's own (a mix)
    for name, lin in linears.items():
        schemes[name].weights.check_divides(lin.in_features, f"model.layers.{ctx.index}.{name}")
    ordered = [n for n in EXECUTION_ORDER if n in linears] + [n for n in linears if n not in EXECUTION_ORDER]
    steps = [[n] for n in ordered] if options.true_sequential else [ordered]
    stats: dict = {}
    for step in steps:
        hessians = {n: HessianAccumulator(linears[n].in_features) for n in step}
        # The step's last linear (in execution order) is the last input needed: stop each forward there
        # (unless the step holds a linear whose place in the order is unknown).
        stop = step[-1] if all(n in EXECUTION_ORDER for n in step) else None
        ctx.capture({n: linears[n] for n in step}, lambda n, x, h=hessians: h[n].add(x), stop_after=stop)
        for n in step:
            # the accumulator itself: the solver turns its float64 sum into the fp32 Hessian in place and holds the only
            # reference to it (a 1.5B model's down projection: 642 + 321 MB freed as soon as the solve allows)
            result = gptq_quantize(
                linears[n].weight.float(), hessians.pop(n), schemes[n].weights, act_order=options.act_order,
                damp=options.damp, block_size=options.gptq_block_size, layer_name=f"model.layers.{ctx.index}.{n}",
                scale_search=options.gptq_scale_search,
            )
            stats[n] = {"proxy_error": result.proxy_error, "damp": result.damp_used}
            act = schemes[n].activations.name if schemes[n].activations else None
            quantize_linear_(linears[n], result.weight, act)
    return stats
