"""fp8 e4m3 GEMMs on CUDA GPUs (Triton; compute capability >= 8.9: Ada, Hopper): W8A8 fp8 and fp8 weight-only.

Weights are `FP8Weight`: codes float8_e4m3fn [N, K] (K contiguous, kept as they are: no copy) and one fp32 scale
per output channel, read as the K-major B tile like the int8 GEMM's. Tile configs, M buckets, autotuning and launch
checks: gemm_common.py (W8A8 takes the 1-byte operand tiles; weight-only has its own, half as deep in K).

- W8A8 (act "fp8"): `_quantize_fp8_kernel`, one program per row of x [M, K] -> values [M, K] (fp8 e4m3,
  contiguous) and scale fp32 [M, 1], exactly `reference.quantize_per_token_fp8`: s = max(max|x|, 1e-12) / 448
  and clamp(x / s, -448, 448) cast to e4m3 with round-to-nearest-even (both divisions IEEE, `tl.math.div_rn`).
  Then `_fp8_gemm_kernel`: fp8 x fp8 `tl.dot` with fp32 accumulation, y = acc * s_x[m] * s_w[n] (+ b[n]) in fp32,
  stored in x's dtype. Hopper's fp8 tensor cores add into the accumulator with reduced precision; by default each
  K step's product is added to the fp32 accumulator outside the tensor core (`acc += dot`), which keeps fp32
  accuracy for any K at a small cost; `fast_accum=True` accumulates inside the tensor core instead (faster).
- weight-only (act None): x stays in its dtype (fp16/bf16; fp32 runs an exact fp32 dot without tensor cores).
  Each fp8 weight tile is converted to x's dtype in the K loop (exact: every e4m3 value is an fp16/bf16/fp32
  value), multiplied on the tensor cores with fp32 accumulation, and the per-channel scale is applied once in
  the epilogue (it is constant along K, so y = (x @ q^T) * s_w is the same sum with N*K fewer multiplies).

The kernels are dtype-generic: the quantizer writes whatever dtype its output has, and the GEMM multiplies any
operand pair `tl.dot` takes. Under Triton's interpreter (tests) fp8 loads and fp8 `tl.dot` are exact but its
fp32 -> fp8 cast is not, so tests there use fp32 outputs of the quantizer and fp16 tensors holding e4m3 values
in place of fp8 ones; the real fp8 cast is checked on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..problem import LinearProblem
from ..reference import FP8_E4M3_MAX, FP8Weight
from .gemm_common import (
    EIGHT_BIT_MIN_BLOCK_K,
    FLOAT_DTYPES,
    ONE_BYTE_CONFIGS,
    GemmConfig,
    TunedGemm,
    as_rows,
    check_activations,
    cuda_reason,
    gemm_output,
    grouped_tile,
    quantizer_input,
    row_launch,
    row_scale,
    store_tile,
)

Support = tuple[bool, str]

FP8 = torch.float8_e4m3fn
FP8_MIN_CAPABILITY = (8, 9)  # e4m3 conversions and fp8 tl.dot: Ada (8.9), Hopper (9.0) and newer
FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


# ---------------------------------------------------------------------------------------------------
# Per-token fp8 quantization


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    scale = row_scale(x_row, K, 1e-12, FP8_MAX, BLOCK_K)

    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_row + k0 + offs, v.to(q_ptr.dtype.element_ty), mask=mask)  # fp8: round to nearest even
    tl.store(scale_ptr + row, scale)


def quantize_per_token_fp8_triton(x2d: torch.Tensor, out_dtype: torch.dtype = FP8, block_k: int | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic fp8 e4m3 per row, as `reference.quantize_per_token_fp8`: x [M, K] (fp16/bf16/fp32) ->
    (values [M, K] in `out_dtype`, scale fp32 [M, 1]). `out_dtype` fp32 gives the clamped x / s before the fp8
    rounding (how the interpreter checks the kernel); `block_k` (power of two) is the K chunk per loop step."""
    if out_dtype not in (FP8, *FLOAT_DTYPES):
        raise ValueError(f"quantize_per_token_fp8_triton: out_dtype {out_dtype} is not supported "
                         "(float8_e4m3fn; fp16/bf16/fp32 for checks)")
    x2d = quantizer_input(x2d, "quantize_per_token_fp8_triton")
    m, k = x2d.shape
    values = torch.empty(m, k, dtype=out_dtype, device=x2d.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x2d.device)
    if m:
        _quantize_fp8_kernel[(m,)](x2d, values, scale, k, x2d.stride(0), values.stride(0), **row_launch(k, block_k))
    return values, scale


# ---------------------------------------------------------------------------------------------------
# fp8 GEMM (W8A8 and weight-only)


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, y_ptr, sx_ptr, sw_ptr, bias_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     HAS_X_SCALE: tl.constexpr, CAST_W: tl.constexpr, IEEE_DOT: tl.constexpr,
                     PROMOTE_ACC: tl.constexpr, HAS_BIAS: tl.constexpr,
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

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if CAST_W:  # weight-only: e4m3 codes -> x's dtype, exact
            b = b.to(a.dtype)
        if IEEE_DOT:  # fp32 activations: no tf32 rounding
            acc = tl.dot(a, b, acc, input_precision="ieee")
        elif PROMOTE_ACC:  # fp8 x fp8: add each step's product outside the tensor core's reduced-precision adder
            acc += tl.dot(a, b)
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    y = acc * tl.load(sw_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_X_SCALE:
        y = y * tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    store_tile(y, y_ptr, bias_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)


# W8A8: both operands 1 byte, the int8 GEMM's tiles. Weight-only: x tiles are 2 bytes, so half the K depth.
FP8_CONFIGS = ONE_BYTE_CONFIGS
WEIGHT_ONLY_CONFIGS: dict[int, list[GemmConfig]] = {
    16: [GemmConfig(16, 64, 128, 1, 4, 4), GemmConfig(16, 128, 128, 1, 4, 3), GemmConfig(16, 64, 256, 1, 4, 3),
         GemmConfig(16, 256, 64, 1, 4, 4), GemmConfig(16, 32, 128, 1, 2, 5)],
    128: [GemmConfig(32, 128, 64, 8, 4, 4), GemmConfig(64, 128, 64, 8, 4, 4), GemmConfig(64, 64, 128, 8, 4, 3),
          GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(64, 256, 64, 8, 8, 3)],
    0: [GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(128, 256, 64, 8, 8, 3), GemmConfig(128, 128, 32, 8, 4, 4),
        GemmConfig(64, 256, 64, 8, 4, 4), GemmConfig(256, 128, 64, 8, 8, 3)],
}


_FP8_GEMM = TunedGemm(_fp8_gemm_kernel, FP8_CONFIGS, min_block_k=EIGHT_BIT_MIN_BLOCK_K)
_WEIGHT_ONLY_GEMM = TunedGemm(_fp8_gemm_kernel, WEIGHT_ONLY_CONFIGS)


@dataclass
class FP8State:
    """A layer's fp8 weight as the GEMM reads it."""

    q: torch.Tensor  # float8_e4m3fn [N, K], K contiguous: the layer's own codes (no copy when already contiguous)
    scale: torch.Tensor  # fp32 [N], per output channel
    n: int
    k: int


def _fp8_reason(p: LinearProblem) -> str | None:
    why = cuda_reason(p, FP8_MIN_CAPABILITY, "fp8 e4m3")
    if why:
        return why
    if p.fmt != "fp8":
        return f"takes fp8 e4m3 weights, not {p.fmt} ones"
    return None


def fp8_weight_only_supports(p: LinearProblem) -> Support:
    why = _fp8_reason(p)
    if why:
        return False, why
    if p.act is not None:
        return False, f"weight-only: {p.act} activations need the W8A8 path"
    if p.dtype == torch.float32:
        return True, "fp8 weights converted in the K loop, exact fp32 dot (fp32 activations: no tensor cores)"
    return True, "fp8 weights converted to the activations' dtype in the K loop, tensor-core dot, scale epilogue"


def fp8_supports(p: LinearProblem) -> Support:
    """W8A8 fp8 (act 'fp8') or fp8 weight-only (act None); both need compute capability >= 8.9."""
    why = _fp8_reason(p)
    if why:
        return False, why
    if p.act is None:
        return fp8_weight_only_supports(p)
    if p.act != "fp8":
        return False, f"fp8 weights run with fp8 activations or unquantized ones (act None), not {p.act}"
    return True, "per-token fp8 activations (Triton), fp8 tl.dot with fp32 accumulation, per-channel scale epilogue"


def prepare_fp8(weight: FP8Weight, p: LinearProblem) -> FP8State:
    """Once per layer: the e4m3 codes stay [N, K]; scales to fp32 [N]."""
    if not isinstance(weight, FP8Weight):
        raise ValueError(f"triton_fp8 takes an FP8Weight, not {type(weight).__name__}")
    n, k = weight.q.shape
    if weight.q.dtype != FP8:
        raise ValueError(f"triton_fp8 takes float8_e4m3fn codes, got {weight.q.dtype}")
    if weight.scale.numel() != n:
        raise ValueError(f"triton_fp8 takes per-channel scales [N, 1] = [{n}, 1], got {tuple(weight.scale.shape)}")
    return FP8State(weight.q.contiguous(), weight.scale.reshape(n).float().contiguous(), n, k)


def fp8_matmul(x: torch.Tensor, x_scale: torch.Tensor | None, state: FP8State, bias: torch.Tensor | None = None,
               config: GemmConfig | None = None, *, out_dtype: torch.dtype | None = None,
               fast_accum: bool = False) -> torch.Tensor:
    """y [M, N] from x [M, K] (K contiguous) and the fp8 weight, in `out_dtype`.

    - x_scale fp32 [M, 1] given (W8A8): x holds per-token quantized values in the weight codes' dtype (fp8 e4m3;
      fp16/fp32 holding e4m3 values in interpreter tests); y = (x @ q^T) * x_scale * w_scale (+ bias).
      out_dtype defaults to fp32. `fast_accum` accumulates inside the fp8 tensor cores (see the module doc).
    - x_scale None (weight-only): x is fp16/bf16/fp32 activations; y = (x @ q^T) * w_scale (+ bias);
      out_dtype defaults to x's dtype.
    `config` fixes the tiles (benchmarks); otherwise autotuned per M bucket (one fixed config under the interpreter).
    """
    if x.dim() != 2 or x.shape[1] != state.k:
        raise ValueError(f"fp8_matmul takes x as [M, {state.k}], got shape {tuple(x.shape)}")
    weight_only = x_scale is None
    if weight_only:
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"fp8_matmul (weight-only): x of {x.dtype} is not supported (fp16, bf16, fp32)")
        if state.q.dtype not in (FP8, x.dtype):
            raise ValueError(f"fp8_matmul (weight-only): weight codes of {state.q.dtype} do not go with x of {x.dtype} "
                             "(float8_e4m3fn codes, or codes in x's dtype)")
    elif x.dtype != state.q.dtype or x.dtype not in (FP8, torch.float16, torch.float32):
        raise ValueError(f"fp8_matmul (W8A8): x of {x.dtype} and weight codes of {state.q.dtype} must both be "
                         "float8_e4m3fn (or both fp16/fp32 holding e4m3 values, for checks)")
    out_dtype = out_dtype or (x.dtype if weight_only else torch.float32)
    if x.stride(-1) != 1 and state.k > 1:
        x = x.contiguous()
    y = gemm_output(x, state.q, x_scale, bias, state.n, out_dtype, "fp8_matmul")
    m = x.shape[0]
    if m == 0:
        return y
    sx = state.scale if weight_only else x_scale.reshape(m).float().contiguous()
    args = (x, state.q, y, sx, state.scale, state.scale if bias is None else bias.contiguous(),
            m, state.n, state.k, x.stride(0), state.q.stride(0), y.stride(0))
    flags = {"HAS_X_SCALE": not weight_only, "CAST_W": state.q.dtype != x.dtype,
             "IEEE_DOT": x.dtype == torch.float32, "PROMOTE_ACC": not weight_only and not fast_accum,
             "HAS_BIAS": bias is not None}
    (_WEIGHT_ONLY_GEMM if weight_only else _FP8_GEMM).launch(config, m, state.n, args, flags)
    return y


def run_fp8(x: torch.Tensor, state: FP8State, bias: torch.Tensor | None, act: str | None) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) -> y [..., N] in x's dtype: act 'fp8' quantizes x per token (W8A8 fp8),
    act None multiplies x as it is (weight-only)."""
    if act not in (None, "fp8"):
        raise ValueError(f"triton_fp8 runs act='fp8' (W8A8) or act=None (weight-only), not act={act!r}")
    check_activations(x, state.q, "triton_fp8")
    rows = as_rows(x, state.k)
    if act is None:
        y = fp8_matmul(rows, None, state, bias, out_dtype=x.dtype)
    else:
        values, scale = quantize_per_token_fp8_triton(rows)
        y = fp8_matmul(values, scale, state, bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], state.n)
