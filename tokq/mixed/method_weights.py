"""Per-Linear costs measured with the build method's own rounding, not RTN's.

RTN rounds each weight on its own, so its cost for a Linear says nothing of what GPTQ's error feedback does
to that Linear: GPTQ cuts some Linears' cost far more than others', and a knapsack fed RTN costs keeps wide
Linears GPTQ would have fixed anyway. A method that quantizes each Linear without touching another one can be
measured as it builds: quantize the model uniformly with the method at a format, dequantize each Linear back
to a dense matrix, and substitute that matrix alone into the 16-bit model (`measure_sensitivity(weights=)`).
GPTQ qualifies (its compensation stays inside the Linear; the inputs it saw came through the earlier
quantized blocks, as in any build). AWQ and SmoothQuant fold a scale into the layer before, so one of their
Linears without its fold is not what the build runs: they keep RTN costs, calibrated by the measured
all-quantized KL (mixed.search.calibrate).
"""

from __future__ import annotations

import torch

from tokq.errors import ModelError
from tokq.quantization.layer_schemes import candidate_linears

PER_LINEAR_METHODS = ("rtn", "gptq")  # methods whose Linears can be measured one at a time


def measured_with_own_rounding(method: str) -> bool:
    """Whether a mix built with `method` takes its costs from the method's own Linears: a per-Linear method
    whose rounding is not RTN's (RTN's own rounding is what the sensitivity applies anyway)."""
    return method in PER_LINEAR_METHODS and method != "rtn"


def dequantized_linears(model) -> dict[str, torch.Tensor]:
    """Candidate Linear name -> its quantized weight dequantized to a dense fp32 [out, in] matrix, input
    columns in the model's own order (activation-ordered GPTQ stores them permuted)."""
    from tokq.engine.quant_linear import InputPermutedLinearMethod, QuantizedLinearMethod

    out: dict[str, torch.Tensor] = {}
    for name in candidate_linears(model):
        method = model.get_submodule(name).method
        if not isinstance(method, QuantizedLinearMethod):
            raise ModelError(f"{name} is not quantized in this build: method costs need every candidate Linear "
                             "quantized at the format (a uniform build)")
        weight = method.weight.dequantize(torch.float32)
        if isinstance(method, InputPermutedLinearMethod):
            dense = torch.empty_like(weight)
            dense[:, method.input_perm.long()] = weight  # column j ran on input perm[j]
            weight = dense
        out[name] = weight
    return out
