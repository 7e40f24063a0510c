"""Linear kernels over tokq's native CPU GEMVs (kernels/cpu/native): decode-sized M through gemv.cpp, larger M
through torch's ops as the `cpu_int4` / `cpu_int8` paths run them.

- `cpu_native_int8` (int8 weight-only, per-channel symmetric, K a multiple of 64, N >= NATIVE_INT8_MIN_N): up to
  NATIVE_MAX_M rows through `tokq_native::int8_gemv`, more through `aten._weight_int8pack_mm`. Chosen before
  `cpu_int8` for output-layer-sized weights, where it was measured: on the LM head of SmolLM2 (49152 x 576) it
  runs in 3.4 ms against 6.0-6.3 ms at 1 thread, cache cold (2-core Xeon, VNNI build), and a decode step at
  1 thread is 5% faster with it (benchmarks/vs_llamacpp.py). Decoder-sized int8 layers keep `cpu_int8` until
  measured.
- `cpu_native_int4` (int4/int3/int2 weight-only, groups of a multiple of 32): up to NATIVE_INT4_MAX_M rows through
  `tokq_native::int4_gemv`, more as `cpu_int4` does above its own cutoff (dequantize once, dense bf16 GEMM).
  Two layouts: on AVX-512 VNNI builds, where K and the group are multiples of 64, tiles of 16 rows x 64 k for
  `int4_gemv_tiled` (a vertical vpdpbusd, each weight register reused by 8 activation rows); elsewhere row-major
  for `int4_gemv`. Chosen before `cpu_int4` on AVX-512 VNNI builds, where it was measured faster: SmolLM2's 120
  decoder GEMVs (g64, paired sweeps on a 2-core Xeon) 1.13-1.18x aten's int4 op at M = 1, 1.35-1.56x at M = 4,
  1.91-2.67x at M = 16, at 1 and 2 threads (the row-major kernel: 1.1-1.3x, 1.1-1.5x, 1.4-1.5x). Elsewhere
  (AVX2 builds, not measured against aten since the kernel's rework) it runs only where torch's kernels cannot
  (e.g. per-channel asymmetric int4) or when forced (`TOKQ_KERNELS=cpu_native_int4`).

Both quantize the activations to int8 per block (as llama.cpp does): against the reference, outputs differ by
~0.5% of the largest output (tests/test_native_kernels.py checks each on fresh random inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..problem import LinearProblem
from ..reference import IntWeight
from . import native
from .linear import INT4PACK_MAX_M, Support, _finish, _rows, _weight_only_int, dequantize_bf16

NATIVE_MAX_M = 16  # rows per call through the int8 GEMV; more rows go to aten's int8pack
# Rows per call through the int4 GEMV; more rows are dequantized to bf16 for a dense GEMM. The same cutoff as
# cpu_int4's (linear.INT4PACK_MAX_M), so that decode batches of 17-32 sequences do not dequantize every layer
# every step: the GEMV's time grows linearly with the rows (measured ahead of aten's op at 1, 4 and 16 rows).
NATIVE_INT4_MAX_M = INT4PACK_MAX_M
NATIVE_INT4_GROUP_MULTIPLE = 32
NATIVE_INT8_K_MULTIPLE = 64
NATIVE_INT8_MIN_N = 8192  # output layers (vocabulary-sized): where the kernel was measured faster


def _native_common(p: LinearProblem) -> str | None:
    """Why the native kernels cannot take this problem (None: they can); builds them on the first CPU problem."""
    return _weight_only_int(p, "tokq's native kernels", True) or native.unavailable()


# int8 ------------------------------------------------------------------------------------------------------

@dataclass
class NativeInt8State:
    q: torch.Tensor  # int8 [N, K]: the layer's own codes (no copy)
    # uint8 [N, K] = q + 128 on VNNI builds (what the kernel reads, streamed), else empty
    unsigned: torch.Tensor = field(metadata={"streamed": True})
    scale: torch.Tensor  # fp32 [N]
    scale_bf16: torch.Tensor  # bf16 [N], for aten._weight_int8pack_mm above NATIVE_MAX_M rows
    n: int
    k: int


def native_int8_supports(p: LinearProblem) -> Support:
    why = _native_common(p)
    if why:
        return False, why
    if p.bits != 8 or not p.per_channel or not p.symmetric:
        return False, "takes int8 codes with one symmetric scale per output channel"
    if p.k % NATIVE_INT8_K_MULTIPLE:
        return False, f"K={p.k} is not a multiple of {NATIVE_INT8_K_MULTIPLE}"
    return True, f"native int8 GEMV ({native.isa()}) up to {NATIVE_MAX_M} rows, aten int8pack above"


def native_int8_not_preferred(p: LinearProblem) -> str | None:
    """Why the registry does not pick it unforced for this shape (None: it does)."""
    if p.n < NATIVE_INT8_MIN_N:
        return f"N={p.n}: measured faster on output layers (N >= {NATIVE_INT8_MIN_N}) only"
    return None


def prepare_native_int8(weight: IntWeight, p: LinearProblem) -> NativeInt8State:
    q = weight.q.contiguous()
    n, k = q.shape
    unsigned = ((q.to(torch.int16) + 128).to(torch.uint8) if native.wants_unsigned_int8()
                else torch.empty(0, dtype=torch.uint8))
    scale = weight.scale.reshape(n).float().contiguous()
    return NativeInt8State(q, unsigned, scale, scale.to(torch.bfloat16), n, k)


def run_native_int8(x: torch.Tensor, state: NativeInt8State, bias: torch.Tensor | None, act: str | None) -> torch.Tensor:
    rows = _rows(x, state.k)
    if rows.shape[0] > NATIVE_MAX_M:
        y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16).contiguous(), state.q, state.scale_bf16)
    else:
        y = torch.ops.tokq_native.int8_gemv(rows, state.q, state.unsigned, state.scale)
    return _finish(y, x, state.n, bias)


# int4 ------------------------------------------------------------------------------------------------------

@dataclass
class NativeInt4State:
    # row-major: uint8 [N, K/2] (gemv.cpp's int4_gemv); tiled: uint8 [N_pad / 16, G, unit] (int4_gemv_tiled, the
    # scales and zero points inside each tile's units)
    # (streamed: the engine moves it onto huge pages with the other weights a decode step reads, engine/huge_pages.py)
    packed: torch.Tensor = field(metadata={"streamed": True})
    scale: torch.Tensor  # row-major: fp32 [N, G]; tiled: empty
    zero: torch.Tensor  # row-major: fp32 [N, G], -z * scale (0 when symmetric); tiled: empty
    group_size: int
    n: int
    k: int
    # the layer's own codes/scales (no copy): dequantized per call above NATIVE_INT4_MAX_M rows
    weight: IntWeight = field(repr=False, metadata={"layer_buffers": True})
    tiled: bool = False


def native_int4_supports(p: LinearProblem) -> Support:
    why = _native_common(p)
    if why:
        return False, why
    if p.bits > 4:
        return False, f"takes codes of at most 4 bits, these have {p.bits}"
    if p.group_size % NATIVE_INT4_GROUP_MULTIPLE:
        return False, f"group size {p.group_size} is not a multiple of {NATIVE_INT4_GROUP_MULTIPLE}"
    return True, f"native int4 GEMV ({native.isa()}) up to {NATIVE_INT4_MAX_M} rows, dequantize + bf16 GEMM above"


def native_int4_not_preferred(p: LinearProblem) -> str | None:
    """Why the registry does not pick it unforced (None: it does): only where it was measured faster than aten."""
    if native.isa() != "avx512+vnni":
        return f"measured faster than aten int4pack on AVX-512 VNNI builds only (this build: {native.isa()})"
    return None


def tiled_layout_fits(k: int, group_size: int) -> bool:
    """Whether a layer takes gemv.cpp's tiled int4 layout: an AVX-512 VNNI build, K and the group multiples of 64."""
    return native.isa() == "avx512+vnni" and k % 64 == 0 and group_size % 64 == 0


def prepare_native_int4(weight: IntWeight, p: LinearProblem) -> NativeInt4State:
    """The tiled layout where it fits (measured on SmolLM2's decoder GEMVs, 2-core Xeon, against the row-major one:
    within 5% at one row, 1.1-1.5x at 4, 1.7-1.85x at 16), else the row-major one."""
    n, k = weight.q.shape
    scale = weight.scale.float()
    zero = torch.zeros_like(scale) if weight.zero is None else -weight.zero.float() * scale
    if not tiled_layout_fits(k, weight.group_size):
        return NativeInt4State(native.pack_int4(weight.q), scale.contiguous(), zero.contiguous(), weight.group_size,
                               n, k, weight)
    codes, zero_codes = weight.q, weight.zero
    pad = (-n) % 16
    if pad:  # padded rows: code 0, scale 0 -> output 0, sliced off by _finish
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        if zero_codes is not None:
            zero_codes = torch.cat([zero_codes, zero_codes.new_zeros(pad, zero_codes.shape[1])])
    # the scales travel inside the tiles (no separate arrays): empty placeholders keep the state's shape
    empty = torch.empty(0)
    return NativeInt4State(native.pack_int4_tiled(codes, scale, zero_codes, weight.group_size), empty, empty,
                           weight.group_size, n, k, weight, tiled=True)


def run_native_int4(x: torch.Tensor, state: NativeInt4State, bias: torch.Tensor | None, act: str | None) -> torch.Tensor:
    rows = _rows(x, state.k)
    if rows.shape[0] > NATIVE_INT4_MAX_M:
        y = F.linear(rows.to(torch.bfloat16), dequantize_bf16(state.weight))
    elif state.tiled:
        y = torch.ops.tokq_native.int4_gemv_tiled(rows, state.packed, state.group_size)
    else:
        y = torch.ops.tokq_native.int4_gemv(rows, state.packed, state.scale, state.zero, state.group_size)
    return _finish(y, x, state.n, bias)
