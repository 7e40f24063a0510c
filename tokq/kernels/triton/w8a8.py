"""W8A8 int8 on CUDA GPUs (Triton): per-token dynamic int8 activations times per-channel int8 weights.

A call is two kernels:

1. `_quantize_int8_kernel`, one program per row of x [M, K] (fp16/bf16/fp32; rows may be strided, K must be
   contiguous) -> codes int8 [M, K] (contiguous), scale fp32 [M, 1] and rowsum int32 [M] (sum_k codes[m, k], used
   by the zero-point correction). Two passes over K in BLOCK_K chunks (max|x|, then quantize; the second pass
   re-reads the row, which is still in L2). The numbers are exactly `reference.quantize_per_token_int8`'s:
   s = max(max|x|, 1e-8) / 127 and q = clamp(round(x / s), -128, 127), both divisions IEEE round-to-nearest
   (`tl.math.div_rn`: Triton's plain fp32 `/` may be an approximate division on CUDA) and round half to even like
   torch.round. On CUDA the rounding is libdevice `rint` (round-to-nearest-even); the interpreter has no libdevice,
   so there it adds and subtracts 1.5 * 2^23, which rounds half to even exactly in fp32 for |v| < 2^22 (|x / s| is at
   most 127 here). So codes match the reference bit for bit on both, ties included.
2. `_int8_gemm_kernel`: acc[m, n] = sum_k codes[m, k] * q[n, k] in int32 (`tl.dot`, int8 tensor cores), then in
   fp32: y = (acc - rowsum[m] * z[n]) * s_x[m] * s_w[n] (+ b[n]), stored in y's dtype (x's). The zero-point term is
   the exact integer form of sum_k x_q (q - z) for asymmetric weights.

Weight layout: the IntWeight's own int8 codes [N, K], K contiguous, kept as they are (no copy, no transpose),
read as the K-major B tile (gemm_common.py).

Only per-channel weight scales ([N, 1]): a group-wise scale changes along K, so it cannot be applied after the
int32 accumulation (it would need a float rescale per group inside the K loop); such layers go elsewhere.
K is at most 2^16 so the int32 accumulator cannot overflow (|x_q| <= 128, |q - z| <= 255).

Tile configs, M buckets, autotuning and launch checks: gemm_common.py (the int8 GEMM takes the 1-byte operand
tiles). `int8_matmul(..., config=GemmConfig(...))` runs one given config (benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..problem import LinearProblem
from ..reference import IntWeight
from . import interpreting
from .gemm_common import (
    EIGHT_BIT_MIN_BLOCK_K,
    ONE_BYTE_CONFIGS,
    GemmConfig,
    TunedGemm,
    as_rows,
    check_activations,
    cuda_reason,
    gemm_output,
    grouped_tile,
    m_bucket,  # noqa: F401 (with GemmConfig, part of int8_matmul's interface: its autotune buckets)
    quantizer_input,
    row_launch,
    row_scale,
    store_tile,
)

Support = tuple[bool, str]

MAX_K = 1 << 16  # int32 accumulator: K * 128 * 255 < 2^31
INT8_MIN_CAPABILITY = (8, 0)  # int8 tl.dot (mma.sync / wgmma s8): Ampere or newer
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + it) - it rounds fp32 v half to even when |v| < 2^22
INT8_CONFIGS = ONE_BYTE_CONFIGS


# ---------------------------------------------------------------------------------------------------
# Per-token int8 quantization


@triton.jit
def _quantize_int8_kernel(x_ptr, q_ptr, scale_ptr, rowsum_ptr, K, stride_xm, stride_qm,
                          BLOCK_K: tl.constexpr, USE_RINT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    scale = row_scale(x_row, K, 1e-8, 127.0, BLOCK_K)

    rowsum = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, scale)
        if USE_RINT:
            v = libdevice.rint(v)
        else:
            v = (v + RNE_MAGIC) - RNE_MAGIC
        q = tl.minimum(tl.maximum(v, -128.0), 127.0).to(tl.int8)
        tl.store(q_row + k0 + offs, q, mask=mask)
        rowsum += q.to(tl.int32)  # masked lanes loaded 0 -> code 0
    tl.store(scale_ptr + row, scale)
    tl.store(rowsum_ptr + row, tl.sum(rowsum, axis=0))


def quantize_int8_with_rowsum(x2d: torch.Tensor, block_k: int | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int8 [M, K], scale fp32 [M, 1], rowsum int32 [M]); see the module doc."""
    x2d = quantizer_input(x2d, "quantize_per_token_int8_triton")
    m, k = x2d.shape
    codes = torch.empty(m, k, dtype=torch.int8, device=x2d.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x2d.device)
    rowsum = torch.empty(m, dtype=torch.int32, device=x2d.device)
    if m:
        _quantize_int8_kernel[(m,)](x2d, codes, scale, rowsum, k, x2d.stride(0), codes.stride(0),
                                    USE_RINT=not interpreting(), **row_launch(k, block_k))
    return codes, scale, rowsum


def quantize_per_token_int8_triton(x2d: torch.Tensor, block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row, as `reference.quantize_per_token_int8`: x [M, K] -> (codes int8 [M, K],
    scale fp32 [M, 1]). `block_k` (power of two) is the K chunk per loop step; default: K rounded up, <= 4096."""
    codes, scale, _ = quantize_int8_with_rowsum(x2d, block_k)
    return codes, scale


# ---------------------------------------------------------------------------------------------------
# int8 GEMM


@triton.jit
def _int8_gemm_kernel(x_ptr, w_ptr, y_ptr, sx_ptr, sw_ptr, rowsum_ptr, zero_ptr, bias_ptr,
                      M, N, K, stride_xm, stride_wn, stride_ym,
                      HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # x tile [BLOCK_M, BLOCK_K] row-major; w tile [BLOCK_K, BLOCK_N] read from the [N, K] codes (K-major B)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0)
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # int8 x int8: Triton defaults out_dtype to fp32
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_ZERO:  # sum_k x_q (q - z) = acc - rowsum(x_q) * z, exact in int32
        rowsum = tl.load(rowsum_ptr + offs_m, mask=mask_m, other=0)
        zero = tl.load(zero_ptr + offs_n, mask=mask_n, other=0)
        acc = acc - rowsum[:, None] * zero[None, :]
    sx = tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)
    sw = tl.load(sw_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * sx[:, None] * sw[None, :]
    store_tile(y, y_ptr, bias_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)


_INT8_GEMM = TunedGemm(_int8_gemm_kernel, INT8_CONFIGS, min_block_k=EIGHT_BIT_MIN_BLOCK_K)


@dataclass
class Int8State:
    """A layer's weight as the int8 GEMM reads it."""

    q: torch.Tensor  # int8 [N, K], K contiguous: the layer's own codes (no copy when already contiguous)
    scale: torch.Tensor  # fp32 [N], per output channel
    zero: torch.Tensor | None  # int32 [N] signed zero points, None when symmetric
    n: int
    k: int


def w8a8_int8_supports(p: LinearProblem) -> Support:
    why = cuda_reason(p, INT8_MIN_CAPABILITY, "int8 tl.dot")
    if why:
        return False, why
    if p.fmt != "int":
        return False, f"takes integer weights, not {p.fmt}"
    if p.act != "int8":
        return False, "W8A8: needs int8 activations" + ("" if p.act is None else f", not {p.act}")
    if p.bits > 8:
        return False, f"takes codes of at most 8 bits, these have {p.bits}"
    if not p.per_channel:
        return False, (f"takes per-channel weight scales, not groups of {p.group_size}: a group scale would have to "
                       "be applied inside the int32 K loop")
    if p.k > MAX_K:
        return False, f"K={p.k} could overflow the int32 accumulator (at most {MAX_K})"
    return True, ("per-token int8 activations (Triton), int8 tl.dot -> int32, fp32 scale epilogue"
                  + ("" if p.symmetric else " with the exact zero-point correction"))


def prepare_w8a8_int8(weight: IntWeight, p: LinearProblem) -> Int8State:
    """Once per layer: the codes stay [N, K]; scales to fp32 [N]; zero points to int32 [N]."""
    if not isinstance(weight, IntWeight):
        raise ValueError(f"triton_w8a8_int8 takes an IntWeight, not {type(weight).__name__}")
    n, k = weight.q.shape
    if weight.q.dtype != torch.int8 or weight.bits > 8:
        raise ValueError(f"triton_w8a8_int8 takes int8 codes of at most 8 bits, got {weight.q.dtype} int{weight.bits}")
    if weight.scale.shape != (n, 1):
        raise ValueError(f"triton_w8a8_int8 takes per-channel scales [N, 1] = [{n}, 1], got {tuple(weight.scale.shape)} "
                         f"(group size {weight.group_size})")
    if k > MAX_K:
        raise ValueError(f"triton_w8a8_int8: K={k} could overflow the int32 accumulator (at most {MAX_K})")
    zero = None if weight.zero is None else weight.zero.reshape(n).to(torch.int32).contiguous()
    return Int8State(weight.q.contiguous(), weight.scale.reshape(n).float().contiguous(), zero, n, k)


def int8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, state: Int8State, bias: torch.Tensor | None = None,
                config: GemmConfig | None = None, *, out_dtype: torch.dtype = torch.float32,
                x_rowsum: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = (x_q @ q^T - rowsum(x_q) z) * x_scale * w_scale (+ bias), in `out_dtype`.

    x_q int8 [M, K] (K contiguous), x_scale fp32 [M, 1] or [M]; x_rowsum int32 [M] (sum of each row of x_q) is
    computed here when the weight has zero points and it is not given. `config` fixes the tiles (benchmarks).
    """
    m, k = x_q.shape
    if x_q.dtype != torch.int8 or k != state.k:
        raise ValueError(f"int8_matmul takes int8 x_q [M, {state.k}], got {x_q.dtype} {tuple(x_q.shape)}")
    if x_q.stride(-1) != 1 and k > 1:
        x_q = x_q.contiguous()
    y = gemm_output(x_q, state.q, x_scale, bias, state.n, out_dtype, "int8_matmul")
    if m == 0:
        return y
    sx = x_scale.reshape(m).float().contiguous()
    if state.zero is not None and x_rowsum is None:
        x_rowsum = x_q.sum(dim=1, dtype=torch.int32)
    dummy = sx  # placeholder for pointers a constexpr flag leaves unread
    args = (x_q, state.q, y, sx, state.scale, dummy if state.zero is None else x_rowsum.contiguous(),
            dummy if state.zero is None else state.zero, dummy if bias is None else bias.contiguous(),
            m, state.n, k, x_q.stride(0), state.q.stride(0), y.stride(0))
    flags = {"HAS_ZERO": state.zero is not None, "HAS_BIAS": bias is not None}
    _INT8_GEMM.launch(config, m, state.n, args, flags)
    return y


def run_w8a8_int8(x: torch.Tensor, state: Int8State, bias: torch.Tensor | None, act: str | None) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) -> y [..., N] in x's dtype: quantize x per token, int8 GEMM, fp32 epilogue."""
    if act != "int8":
        raise ValueError(f"triton_w8a8_int8 quantizes activations to int8; act={act!r} is not supported (act='int8')")
    check_activations(x, state.q, "triton_w8a8_int8")
    rows = as_rows(x, state.k)
    codes, scale, rowsum = quantize_int8_with_rowsum(rows)
    y = int8_matmul(codes, scale, state, bias, out_dtype=x.dtype, x_rowsum=rowsum)
    return y.reshape(*x.shape[:-1], state.n)
