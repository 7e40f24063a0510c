"""AutoGPTQ checkpoints (`quant_method: gptq`, or an AutoGPTQ `quantize_config.json` beside config.json).

Layout read (N = output features, K = input features, G = groups, b = bits): `qweight` int32
[K*b/32, N] packed along K (row k at bit b*(k % (32/b)) of word k // (32/b)); `qzeros` int32
[G, N*b/32] packed along N the same way; `scales` [G, N]; `g_idx` [K] (group of each input column).
`checkpoint_format: gptq` stores zero - 1 (the historical off-by-one), `gptq_v2` stores the zero point
itself. Dequantized: W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].

A `g_idx` that is not plain contiguous groups (desc_act, activation order) is kept on the shard; the
loader permutes the input dimension once so each group's columns are contiguous (see loader.py).
"""

from __future__ import annotations

import torch

from tokq.engine.quant_formats.base import (
    QuantFormat,
    ShardWeight,
    check_2d,
    check_scale,
    check_shape,
    group_size_of,
    need,
)
from tokq.engine.quant_formats.packing import signed_zero, unpack_int32_words
from tokq.errors import ModelError
from tokq.kernels.reference import IntWeight


def gptq_weight(tensors: dict[str, torch.Tensor], bits: int, version: int, name: str = "layer") -> ShardWeight:
    """AutoGPTQ tensors (qweight, qzeros, scales, optional g_idx) -> tokq layout. `version` 1 stores zero - 1."""
    qweight, qzeros, scales = (need(tensors, name, s) for s in ("qweight", "qzeros", "scales"))
    for suffix, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32:
            raise ModelError(f"tensor {name}.{suffix} has dtype {t.dtype}, expected int32 (AutoGPTQ layout)")
    check_2d(f"{name}.scales", scales)
    scales = check_scale(f"{name}.scales", scales)
    groups, n = scales.shape
    k = qweight.shape[0] * 32 // bits
    check_shape(f"{name}.qweight", qweight, (k * bits // 32, n))
    check_shape(f"{name}.qzeros", qzeros, (groups, n * bits // 32), fix=f"for scales {tuple(scales.shape)}")
    group_size = group_size_of(k, groups, name)
    q = unpack_int32_words(qweight, bits, dim=0).t()  # [N, K] unsigned
    zero = unpack_int32_words(qzeros, bits, dim=1).t()  # [N, G] as stored
    if version == 1:
        # v1 stores zero - 1. A stored 2^b - 1 reads back as 2^b (signed 2^(b-1)): kept exact, as AutoGPTQ's
        # own kernels compute it, although that zero lies outside the b-bit range.
        zero = zero + 1
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64).reshape(-1)
        check_shape(f"{name}.g_idx", g_idx, (k,))
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise ModelError(f"tensor {name}.g_idx refers to groups outside 0..{groups - 1}; the checkpoint is corrupt")
        if torch.equal(g_idx, torch.arange(k, device=g_idx.device) // group_size):
            g_idx = None  # plain contiguous groups
    offset = 1 << (bits - 1)
    weight = IntWeight((q - offset).to(torch.int8).contiguous(), scales.float().t().contiguous(),
                       signed_zero(zero, bits, name), bits, group_size)
    return ShardWeight(weight, None, g_idx)


class GPTQFormat(QuantFormat):
    method = "gptq"
    suffixes = ("qweight", "qzeros", "scales", "g_idx")
    marker = "qweight"

    def __init__(self, qc: dict, where: str):
        self.bits = int(qc.get("bits", 4))
        if self.bits not in (2, 4, 8):
            raise ModelError(f"{where}: {self.bits}-bit GPTQ is not supported; tokq reads 2, 4 and 8-bit GPTQ")
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; tokq reads gptq and gptq_v2")
        if qc.get("dynamic"):
            raise ModelError(f"{where}: GPTQ per-module overrides ('dynamic') are not supported")
        self.version = 2 if fmt == "gptq_v2" else 1
        self.desc_act = bool(qc.get("desc_act", False))

    def read(self, name: str, tensors: dict[str, torch.Tensor]) -> ShardWeight:
        if self.desc_act and "g_idx" not in tensors:
            need(tensors, name, "g_idx")  # act-order weights cannot be read without their column groups
        return gptq_weight(tensors, self.bits, self.version, name)
