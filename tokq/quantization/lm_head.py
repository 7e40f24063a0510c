"""A quantized output layer: the LM head in int8 per output channel, untied from the embedding.

At batch-1 decode the LM head is the single largest weight a step reads: SmolLM2-135M's tied 49152 x 576 bf16
table is 56.6 MB of the 126 MB an int4 build reads per token (llama.cpp keeps its output layer in Q8_0). In
int8 with one scale per vocabulary row it is half that, and `aten._weight_int8pack_mm` runs it at 2.25 ms
against 5.7 ms for the bf16 GEMV (1 thread, Xeon; int4 g64 through the int4 op is no faster, 2.2 ms, at twice
the rounding error), so int8 per channel is the format.

The embedding lookup reads one row per token and stays 16-bit: quantizing the head unties it from the
embedding (the model's config says `tie_word_embeddings = false` afterwards), costing the checkpoint the int8
table's bytes on disk.
"""

from __future__ import annotations

import torch

from tokq.engine.models import CausalLM
from tokq.engine.quant_linear import QuantizedLinearMethod, quantize_linear_
from tokq.errors import ConfigError
from tokq.quantization.rounding import check_finite, quantize_rtn
from tokq.quantization.scheme import preset

LM_HEAD = "lm_head"  # the module's (and the checkpoint tensors') name
LM_HEAD_FORMATS = ("16bit", "int8")
LM_HEAD_SCHEME = preset("w8a16")  # int8, symmetric, one scale per output row


def check_lm_head_format(fmt: str) -> str:
    if fmt not in LM_HEAD_FORMATS:
        raise ConfigError(f"lm_head = {fmt!r} is not a format tokq writes for the output layer: use "
                          f"{' or '.join(LM_HEAD_FORMATS)}")
    return fmt


def head_is_quantized(model: CausalLM) -> bool:
    return isinstance(model.lm_head.method, QuantizedLinearMethod)


def quantize_lm_head_(model: CausalLM, fmt: str = "int8") -> bool:
    """Quantize the model's LM head in place (RTN, int8 per output row), untying it from the embedding.

    Returns whether anything changed ("16bit", or a head that is already quantized, leaves the model as it is).
    """
    if check_lm_head_format(fmt) == "16bit" or head_is_quantized(model):
        return False
    head = model.lm_head
    weight = head.weight.detach().float()
    check_finite(weight, "lm_head weight", model.name)
    if model.config.tie_word_embeddings:
        # the embedding keeps its own 16-bit table; the head gets the quantized copy
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
        model.config.raw["tie_word_embeddings"] = False
    quantize_linear_(head, quantize_rtn(weight, LM_HEAD_SCHEME.weights))
    return True
