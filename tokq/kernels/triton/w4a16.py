"""w4a16: integer weight-only GEMM with the dequantization fused into the K loop (Triton).

    y[M, N] = x[M, K] @ dequant(W)^T (+ bias)      x fp16 / bf16 / fp32, y in x's dtype

W is a `PackedIntWeight` (kernels/triton/w4a16_layout.py: int32 words [ceil(K/PACK), N] holding
4-bit fields (codes of at most 4 bits: int4, int3, int2) or 8-bit fields (int8), scales [G, N],
optional unsigned zero points [G, N]). One kernel serves both field widths (BITS is a constexpr)
and every group size that divides K.

Per program: a [BLOCK_M, BLOCK_N] output tile. Each K step loads x [BLOCK_M, BLOCK_K] and the words
[BLOCK_K / PACK, BLOCK_N] of the weight once, unpacks them by shift and mask into codes
[BLOCK_K, BLOCK_N] (word row r, field j -> K row r * PACK + j), dequantizes them in fp32, casts them
to x's dtype and feeds tl.dot, accumulating in fp32. The dequantization depends on the grouping:

- groups a multiple of BLOCK_K (the usual case: the autotuner keeps such tiles when it can): the K
  tile lies in one group; its scale row s and zero row zu*s are loaded once per tile, and each
  element costs one FMA, u * s - zu * s.
- other groups (e.g. 24, or BLOCK_K larger than the group): scales and zeros are gathered per K row.
- per-channel (G = 1): the loop feeds tl.dot the integers u - zu (exact in fp16/bf16, |u - zu| <= 256)
  and the scale multiplies the fp32 accumulator once in the epilogue: fewer operations and less
  rounding than scaling every element.

fp32 activations use the ieee-precision dot (not TF32): an fp32 model is asked for fp32 results.

Split-K (small M, decode): SPLIT_K programs share one output tile, each over a contiguous run of K
tiles, so a skinny GEMM still fills the GPU. Their fp32 partial sums go to a [SPLIT_K, M, N] buffer
and a second, tiny kernel adds them in a fixed order, adds the bias and casts to x's dtype. Chosen
over tl.atomic_add into an fp32 buffer because the result is deterministic (the same bits on every
run: tokq's quality gate compares runs), there is no buffer to zero first, and atomics would need a
cast pass anyway for fp16/bf16 outputs; for M <= 16 the buffer is small and stays in L2.

Tile shapes are autotuned per M bucket (<= 16: decode tiles with split-K; <= 128; larger), keyed on
(M bucket, N, K, field width), among tiles whose BLOCK_K divides the group size when any does. Under
Triton's CPU interpreter (tests) one fixed small tile runs instead, without autotuning.

Public API (what the kernel registry registers):
- `w4a16_supports(p)`: (ok, reason) for a LinearProblem (CUDA only).
- `prepare_w4a16(weight, p)`: IntWeight -> PackedIntWeight, once per layer.
- `run_w4a16(x, state, bias, act)`: x [..., K] -> y [..., N] in x's dtype.
- `w4a16_matmul(x2d, packed, bias, split_k, config)`: the launcher, with an explicit `TileConfig`
  for benchmarks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from tokq.dtypes import DTYPE_NAMES, FLOAT_DTYPES

from ..problem import LinearProblem
from ..reference import IntWeight
from . import autotune_enabled, interpreting, unavailable_reason
from .w4a16_layout import MAX_CODE_BITS, PackedIntWeight, field_bits, pack_int_weight

DECODE_M = 16  # M buckets: <= 16 (decode, split-K), <= 128, larger
MEDIUM_M = 128
LARGE_BUCKET = 1024  # the autotune key value of every M > MEDIUM_M
REDUCE_BLOCK = 1024
MAX_INDEX = 2**31  # offsets inside the split-K buffer are int32


# --------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, KW,
    stride_xm, stride_xk,
    M_BUCKET,  # only an autotune key
    BITS: tl.constexpr,  # field width: 4 or 8
    GROUP_SIZE: tl.constexpr,  # 0: per-channel (one group over all of K)
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)  # the zero point of symmetric weights

    # Output tiles in groups of GROUP_M tile rows, so tiles that run together share weight columns in L2.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (pid // tiles_per_group) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % rows
    pid_n = (pid % tiles_per_group) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_kk = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // PACK)
    shifts = tl.arange(0, PACK) * BITS
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm

    if GROUP_SIZE == 0:  # per-channel: the zero row is loaded once
        if HAS_ZEROS:
            zu_row = tl.load(z_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        else:
            zu_row = tl.zeros((BLOCK_N,), dtype=tl.float32) + OFFSET

    # This program's share of the K tiles: a contiguous run (empty for trailing splits of a short K).
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = pid_k * per_split * BLOCK_K
    k_end = tl.minimum(k_begin + per_split * BLOCK_K, K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + offs_kk
        mask_k = offs_k < K
        x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)

        # One load per word; rows past KW read 0 (their x is 0). Padding rows inside KW hold the code of 0.
        kw = k0 // PACK + offs_kw
        words = tl.load(qw_ptr + kw[:, None] * N + offs_n[None, :], mask=(kw[:, None] < KW) & mask_n[None, :],
                        other=0)
        fields = (words[:, None, :] >> shifts[None, :, None]) & MASK  # [BLOCK_K / PACK, PACK, BLOCK_N]
        u = tl.reshape(fields, (BLOCK_K, BLOCK_N)).to(tl.float32)  # row r * PACK + j = field j of word row r

        if GROUP_SIZE == 0:
            w = u - zu_row[None, :]
        elif GROUP_SIZE % BLOCK_K == 0:  # the tile lies in one group: one scale / zero row
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zs = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32) * s
            else:
                zs = s * OFFSET
            w = tl.fma(u, s[None, :], -zs[None, :])
        else:  # groups smaller than, or not aligned with, the tile: gather per K row
            g = offs_k // GROUP_SIZE
            gmask = mask_k[:, None] & mask_n[None, :]
            s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=gmask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zs = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=gmask, other=0.0).to(tl.float32) * s
            else:
                zs = s * OFFSET
            w = tl.fma(u, s, -zs)
        acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc, input_precision=DOT_PRECISION)

    if GROUP_SIZE == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]

    out_mask = mask_m[:, None] & mask_n[None, :]
    out_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(part_ptr + pid_k * M * N + out_offs, acc, mask=out_mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N,
                          SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over s of part[s, i] (+ bias[i % N]), in a fixed order, cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Tile configurations


@dataclass(frozen=True)
class TileConfig:
    """One launch shape: block sizes (powers of two, each >= 16), split-K, L2 grouping and pipelining."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def meta(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "GROUP_M": self.group_m, "SPLIT_K": self.split_k}


# The interpreter (tests) runs one small tile: small enough for tiny shapes to cover ragged edges,
# several K tiles and split-K.
INTERPRETER_CONFIG = TileConfig(16, 32, 32, split_k=1, group_m=1, num_warps=4, num_stages=1)

# Candidates per M bucket. Decode (M <= 16) is bound by reading the weight: wide K tiles, split-K to
# occupy all SMs when N / BLOCK_N tiles are too few. Larger M is compute bound: bigger tiles (wgmma
# from BLOCK_M 64). Every tile here compiles for sm_90 without register spills (ptxas, fp16, int4 g128).
TUNE_CONFIGS: dict[int, list[TileConfig]] = {
    DECODE_M: [
        TileConfig(16, bn, bk, split_k=sk, group_m=1, num_warps=w, num_stages=st)
        for bn, bk, w, st in ((32, 128, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3), (32, 64, 4, 4), (64, 64, 4, 4),
                              (128, 64, 4, 3), (64, 32, 4, 4))
        for sk in (1, 2, 4, 8)
    ],
    MEDIUM_M: [
        TileConfig(bm, bn, bk, num_warps=w, num_stages=st)
        for bm, bn, bk, w, st in ((32, 64, 64, 4, 4), (32, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3),
                                  (64, 128, 32, 4, 4), (128, 128, 64, 8, 3), (32, 128, 128, 4, 3),
                                  (64, 64, 128, 4, 3), (32, 64, 32, 4, 4))
    ],
    LARGE_BUCKET: [
        TileConfig(bm, bn, bk, num_warps=w, num_stages=st)
        for bm, bn, bk, w, st in ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 32, 8, 4),
                                  (64, 256, 64, 8, 3), (64, 256, 32, 8, 4), (128, 64, 64, 8, 3),
                                  (64, 128, 64, 4, 3), (64, 128, 128, 8, 3))
    ],
}


def m_bucket(m: int) -> int:
    return DECODE_M if m <= DECODE_M else MEDIUM_M if m <= MEDIUM_M else LARGE_BUCKET


def _candidates(bucket: int, group_size: int, split_k: int | None) -> list[TileConfig]:
    """The bucket's tiles; those whose BLOCK_K divides the group size when any does; split-K forced if asked."""
    configs = TUNE_CONFIGS[bucket]
    if split_k is not None:
        configs = list(dict.fromkeys(replace(c, split_k=split_k) for c in configs))
    if group_size:
        aligned = [c for c in configs if group_size % c.block_k == 0]
        configs = aligned or configs
    return configs


@functools.cache
def _tuner(bucket: int, group_size: int, split_k: int | None):
    """The autotuned kernel for one (M bucket, group size, forced split-K); it tunes per (N, K, bits, dtypes)."""
    configs = [triton.Config(c.meta(), num_warps=c.num_warps, num_stages=c.num_stages)
               for c in _candidates(bucket, group_size, split_k)]
    return triton.autotune(configs=configs, key=["M_BUCKET", "N", "K", "BITS", "GROUP_SIZE"])(_w4a16_kernel)


# --------------------------------------------------------------------------------------------------
# Launching


def _check_config(c: TileConfig) -> None:
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(c, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"TileConfig.{name}={v}: block sizes must be powers of two >= 16 (tl.dot's minimum)")
    if c.split_k < 1 or c.group_m < 1:
        raise ValueError(f"TileConfig split_k={c.split_k}, group_m={c.group_m}: both must be >= 1")


def _can_launch_on(device: torch.device) -> bool:
    return device.type == "cuda" or interpreting()


def _check_inputs(x2d: torch.Tensor, packed: PackedIntWeight, bias: torch.Tensor | None) -> None:
    if not isinstance(packed, PackedIntWeight):
        raise ValueError(f"w4a16 takes a PackedIntWeight (prepare_w4a16), not {type(packed).__name__}")
    if x2d.dim() != 2 or x2d.shape[1] != packed.k:
        raise ValueError(f"x has shape {tuple(x2d.shape)}; w4a16_matmul takes x as [M, K={packed.k}]")
    if x2d.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x of {x2d.dtype} is not supported; w4a16 takes float16, bfloat16 or float32 activations")
    if not _can_launch_on(x2d.device):
        raise ValueError(f"x is on {x2d.device.type}; the w4a16 Triton kernel runs on CUDA tensors "
                         "(or on CPU under TRITON_INTERPRET=1)")
    if x2d.device != packed.device:
        raise ValueError(f"x is on {x2d.device} but the packed weight is on {packed.device}")
    if packed.bits not in (4, 8) or packed.qweight.dtype != torch.int32 or not packed.qweight.is_contiguous():
        raise ValueError(f"packed weight of {packed.bits}-bit fields, {packed.qweight.dtype}: w4a16 needs "
                         "4- or 8-bit fields in a contiguous int32 qweight (pack_int_weight)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != packed.n):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected [N={packed.n}]")


def w4a16_matmul(x2d: torch.Tensor, packed: PackedIntWeight, bias: torch.Tensor | None = None,
                 split_k: int | None = None, config: TileConfig | None = None) -> torch.Tensor:
    """y [M, N] = x2d [M, K] @ dequant(packed)^T (+ bias), fp32 accumulation, in x2d's dtype.

    `config`: launch with this tile (no autotuning); `split_k` overrides its split (or, without a
    config, fixes the split the autotuner tries). Under the interpreter the fixed small tile runs.
    """
    _check_inputs(x2d, packed, bias)
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k={split_k}: must be >= 1")
    if config is None and interpreting():
        config = INTERPRETER_CONFIG
    elif config is None and not autotune_enabled():  # TOKQ_TRITON_AUTOTUNE=0: the bucket's first tile
        config = _candidates(m_bucket(x2d.shape[0]), 0 if packed.group_size == packed.k else packed.group_size,
                             split_k)[0]
    if config is not None:
        config = config if split_k is None else replace(config, split_k=split_k)
        _check_config(config)
    m, n, k = x2d.shape[0], packed.n, packed.k
    out = torch.empty(m, n, device=x2d.device, dtype=x2d.dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(out.dtype).expand(m, n))
    max_split = config.split_k if config is not None else max(
        c.split_k for c in _candidates(m_bucket(m), packed.group_size, split_k))
    if max_split > 1 and max_split * m * n >= MAX_INDEX:
        raise ValueError(f"split-K {max_split} over an [M={m}, N={n}] output exceeds the kernel's int32 offsets; "
                         "use split_k=1 for this shape")
    partial = out if max_split == 1 else torch.empty(max_split, m, n, device=x2d.device, dtype=torch.float32)
    group_size = 0 if packed.group_size == k else packed.group_size
    scales = packed.scales
    args = (x2d, packed.qweight, scales, packed.zeros if packed.zeros is not None else scales,
            bias if bias is not None else scales, out, partial,
            m, n, k, packed.qweight.shape[0], x2d.stride(0), x2d.stride(1), m_bucket(m))
    flags = dict(BITS=packed.bits, GROUP_SIZE=group_size, HAS_ZEROS=packed.zeros is not None,
                 HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x2d.dtype == torch.float32 else "tf32")

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

    if config is not None:
        _w4a16_kernel[grid](*args, **flags, **config.meta(), num_warps=config.num_warps,
                            num_stages=config.num_stages)
        used_split = config.split_k
    else:
        tuner = _tuner(m_bucket(m), group_size, split_k)
        tuner[grid](*args, **flags)
        used_split = tuner.best_config.kwargs["SPLIT_K"]  # set by the autotuner for this call's key
    if used_split > 1:
        _splitk_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            partial, bias if bias is not None else scales, out, m * n, n,
            SPLIT_K=used_split, HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK)
    return out


# --------------------------------------------------------------------------------------------------
# The registry's interface


def w4a16_supports(p: LinearProblem) -> tuple[bool, str]:
    why = unavailable_reason(p.device)
    if why:
        return False, why
    if p.fmt != "int":
        return False, f"takes integer weights, not {p.fmt}"
    if p.act is not None:
        return False, f"weight-only: {p.act} activations need a W8A8 kernel"
    if not 1 <= p.bits <= MAX_CODE_BITS:
        return False, f"takes codes of 1 to 8 bits, these have {p.bits}"
    if p.group_size < 1 or p.k % p.group_size:
        return False, f"group size {p.group_size} does not divide K={p.k}"
    if p.dtype not in FLOAT_DTYPES:
        return False, f"activations of {p.dtype} are not supported (fp32, bf16, fp16)"
    grouping = f"per-channel scales over K={p.k}" if p.per_channel else f"groups of {p.group_size}"
    return True, (f"{field_bits(p.bits)}-bit fields, {grouping}, {DTYPE_NAMES[p.dtype]} activations, "
                  "dequant fused into the K loop, fp32 accumulation")


def prepare_w4a16(weight: IntWeight, p: LinearProblem) -> PackedIntWeight:
    """Pack once per layer, with scales in the layer's activation dtype."""
    if not isinstance(weight, IntWeight):
        raise ValueError(f"w4a16 takes integer weights (IntWeight), not {type(weight).__name__}")
    return pack_int_weight(weight, p.dtype)


def run_w4a16(x: torch.Tensor, state: PackedIntWeight, bias: torch.Tensor | None, act: str | None) -> torch.Tensor:
    """x [..., K] -> y [..., N] in x's dtype."""
    if act is not None:
        raise ValueError(f"w4a16 is weight-only: {act} activations need a W8A8 kernel")
    if x.dim() < 1 or x.shape[-1] != state.k:
        raise ValueError(f"x has shape {tuple(x.shape)}; the layer takes [..., K={state.k}]")
    y = w4a16_matmul(x.reshape(-1, state.k), state, bias)
    return y.reshape(*x.shape[:-1], state.n)
