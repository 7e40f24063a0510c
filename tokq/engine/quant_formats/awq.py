"""AutoAWQ checkpoints (`quant_method: awq`), GEMM layout (`version: gemm`).

Layout read (N = output features, K = input features, G = groups): `qweight` int32 [K, N/8] and
`qzeros` int32 [G, N/8], both packed along N with AWQ's interleaved order (nibble p of a word holds
column 8*i + [0, 2, 4, 6, 1, 3, 5, 7][p]); `scales` [G, N]; zero points stored as is.
Dequantized: W[n, k] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n].
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

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within a packed word of 8) stored at nibble p


def awq_weight(tensors: dict[str, torch.Tensor], bits: int, name: str = "layer") -> ShardWeight:
    """AutoAWQ GEMM tensors (qweight [K, N/8], qzeros [G, N/8], scales [G, N]) -> tokq layout."""
    qweight, qzeros, scales = (need(tensors, name, s) for s in ("qweight", "qzeros", "scales"))
    for suffix, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32:
            raise ModelError(f"tensor {name}.{suffix} has dtype {t.dtype}, expected int32 (AutoAWQ GEMM layout)")
    check_2d(f"{name}.scales", scales)
    scales = check_scale(f"{name}.scales", scales)
    groups, n = scales.shape
    k = qweight.shape[0]
    check_shape(f"{name}.qweight", qweight, (k, n * bits // 32), fix=f"for scales {tuple(scales.shape)}")
    check_shape(f"{name}.qzeros", qzeros, (groups, n * bits // 32), fix=f"for scales {tuple(scales.shape)}")
    q = unpack_int32_words(qweight, bits, dim=1, order=AWQ_ORDER).t()
    zero = unpack_int32_words(qzeros, bits, dim=1, order=AWQ_ORDER).t()
    offset = 1 << (bits - 1)
    return ShardWeight(IntWeight((q - offset).to(torch.int8).contiguous(), scales.float().t().contiguous(),
                                 signed_zero(zero, bits, name), bits, group_size_of(k, groups, name)))


class AWQFormat(QuantFormat):
    method = "awq"
    suffixes = ("qweight", "qzeros", "scales")
    marker = "qweight"

    def __init__(self, qc: dict, where: str):
        self.bits = int(qc.get("bits", qc.get("w_bit", 4)))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelError(f"{where}: AWQ version {version!r} is not supported; tokq reads the GEMM layout "
                             "(version 'gemm')")
        if self.bits != 4:
            raise ModelError(f"{where}: {self.bits}-bit AWQ is not supported; tokq reads 4-bit AWQ (GEMM)")
        if not qc.get("zero_point", True):
            raise ModelError(f"{where}: AWQ without zero points is not supported; tokq reads zero_point=true")

    def read(self, name: str, tensors: dict[str, torch.Tensor]) -> ShardWeight:
        return awq_weight(tensors, self.bits, name)
