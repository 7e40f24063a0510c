"""The set-up the W8A8 int8 GEMM (w8a8.py) and the fp8 GEMMs (fp8.py) share.

- Tiles: `GemmConfig` (one tile shape), the M buckets (<= 16 rows: decode; <= 128; larger: prefill),
  `ONE_BYTE_CONFIGS` (the candidates per bucket when both operands are 1 byte: int8 x int8, fp8 x fp8)
  and `TunedGemm`, a kernel with one `triton.autotune` per bucket keyed on (N, K) (Triton adds the
  tensors' dtypes to the key). A launch runs a given config (benchmarks), the interpreter's fixed small
  one, the bucket's first when TOKQ_TRITON_AUTOTUNE=0, or the bucket's autotuner.
- In the kernels: `grouped_tile` (the program -> output tile order, GROUP_M tile rows per band so a
  weight tile is reused from L2) and `store_tile` (bias, cast, masked store).
- Both GEMMs read the weight's own [N, K] codes (K contiguous) as the B tile [BLOCK_K, BLOCK_N] through
  strides: B = W^T column-major, "K-major", the order Hopper's wgmma takes 8-bit operands in, so the
  tile goes to shared memory without a transpose and the layer keeps one copy of its weight.
- Host checks: devices (CUDA, or CPU under the interpreter), activation and bias dtypes and shapes, the
  GPU's compute capability (`cuda_reason`), and `gemm_output` (the checks every launcher runs before
  it allocates y).
- The per-token activation quantizers (one program per row of x): `row_scale`, their first pass
  (max|x| over the row, then the scale by IEEE division), `quantizer_input` (checks, K contiguous)
  and `row_launch` (the K chunk and warps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokq.dtypes import FLOAT_DTYPES

from ..problem import LinearProblem
from . import autotune_enabled, interpreting, unavailable_reason

QUANT_MAX_BLOCK_K = 4096  # one row chunk per loop step of an activation quantizer


# Tiles and launches ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM tile shape: BLOCK_M x BLOCK_N output tile, BLOCK_K per K step, GROUP_M tile rows per L2 group."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name}={v}: block sizes must be powers of two >= 16 (tl.dot's minimum)")
        if self.group_m < 1 or self.num_stages < 1 or self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"GemmConfig group_m={self.group_m}, num_stages={self.num_stages}, "
                             f"num_warps={self.num_warps}: need >= 1, >= 1 and a power of two")

    def meta(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP_M": self.group_m}

    def triton_config(self) -> triton.Config:
        return triton.Config(self.meta(), num_warps=self.num_warps, num_stages=self.num_stages)


# Under the interpreter: small tiles so tiny test shapes still span several tiles and K steps.
INTERPRETER_CONFIG = GemmConfig(16, 32, 32, group_m=4, num_warps=1, num_stages=1)
EIGHT_BIT_MIN_BLOCK_K = 32  # int8 / fp8 tl.dot on the GPU: K steps of 32 (Triton: "K >= 32")

M_BUCKETS = (16, 128)  # rows <= 16 (decode), <= 128, and larger (prefill: bucket 0)


def m_bucket(m: int) -> int:
    """The autotune bucket of M rows: 16, 128, or 0 for anything larger."""
    return next((b for b in M_BUCKETS if m <= b), 0)


# Per M bucket, both operands 1 byte: decode rows are bandwidth-bound on the weight (wide N, deep K tiles, few
# rows); prefill is compute-bound (large square-ish tiles, 8 warps). Sizes fit H100/H200 shared memory at the
# given stages.
ONE_BYTE_CONFIGS: dict[int, list[GemmConfig]] = {
    16: [GemmConfig(16, 64, 256, 1, 4, 4), GemmConfig(16, 128, 128, 1, 4, 4), GemmConfig(16, 128, 256, 1, 4, 3),
         GemmConfig(16, 256, 128, 1, 8, 3), GemmConfig(16, 64, 128, 1, 2, 5)],
    128: [GemmConfig(32, 128, 128, 8, 4, 4), GemmConfig(64, 128, 128, 8, 4, 4), GemmConfig(64, 64, 256, 8, 4, 3),
          GemmConfig(128, 128, 128, 8, 8, 3), GemmConfig(64, 256, 128, 8, 8, 3)],
    0: [GemmConfig(128, 128, 128, 8, 8, 3), GemmConfig(128, 256, 128, 8, 8, 3), GemmConfig(128, 128, 64, 8, 4, 4),
        GemmConfig(64, 256, 128, 8, 8, 3), GemmConfig(256, 128, 128, 8, 8, 3)],
}


def gemm_grid(m: int, n: int):
    """One program per BLOCK_M x BLOCK_N output tile (the kernel orders them in GROUP_M bands)."""
    return lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)


class TunedGemm:
    """A GEMM kernel (taking BLOCK_M/N/K and GROUP_M) with its tile configs per M bucket and their autotuners."""

    def __init__(self, kernel, configs: dict[int, list[GemmConfig]], min_block_k: int = 16):
        # 8-bit operands (int8, fp8) reach the tensor cores in K steps of 32: Triton refuses a smaller
        # BLOCK_K for them on the GPU (its interpreter does not, so the check lives here).
        too_small = [c for cs in configs.values() for c in cs if c.block_k < min_block_k]
        if too_small:
            raise ValueError(f"{kernel.__name__}: configs with BLOCK_K < {min_block_k}: {too_small}")
        self.kernel, self.configs, self.min_block_k = kernel, configs, min_block_k
        self.tuned = {bucket: triton.autotune([c.triton_config() for c in cs], key=["N", "K"])(kernel)
                      for bucket, cs in configs.items()}

    def launch(self, config: GemmConfig | None, m: int, n: int, args: tuple, flags: dict) -> None:
        """Run one GEMM: the given config, the interpreter's fixed one, the bucket's first config when
        TOKQ_TRITON_AUTOTUNE=0, or the autotuner of M's bucket."""
        grid = gemm_grid(m, n)
        if config is not None and config.block_k < self.min_block_k:
            raise ValueError(f"{config}: this GEMM's operands are 8-bit, and 8-bit tl.dot needs BLOCK_K >= "
                             f"{self.min_block_k}: give block_k={self.min_block_k} or more")
        if config is None and interpreting():
            config = INTERPRETER_CONFIG
        elif config is None and not autotune_enabled():
            config = self.configs[m_bucket(m)][0]
        if config is not None:
            self.kernel[grid](*args, **flags, **config.meta(), num_warps=config.num_warps,
                              num_stages=config.num_stages)
        else:
            self.tuned[m_bucket(m)][grid](*args, **flags)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) for program `pid`, walking GROUP_M tile rows per column so a weight tile is reused from L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    return pid_m, pid_n


@triton.jit
def store_tile(y, y_ptr, bias_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS: tl.constexpr):
    """y [BLOCK_M, BLOCK_N] fp32 (+ bias[n]) stored in y_ptr's dtype, masked to the output's edges."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Host checks ------------------------------------------------------------------------------------------


def as_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., K] as an [M, K] matrix whose K is contiguous (a view when it already is one)."""
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight takes K={k}")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 or k == 1 else x2.contiguous()


def check_device(t: torch.Tensor, kernel: str) -> None:
    """Triton kernels take CUDA tensors; CPU tensors only under the interpreter (tests)."""
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{kernel}: the tensor is on {t.device.type}; Triton kernels run on CUDA tensors "
                         "(or on CPU under TRITON_INTERPRET=1)")


def check_activations(x: torch.Tensor, weight: torch.Tensor, kernel: str) -> None:
    """One clear error for activations a kernel cannot take (dtype, device)."""
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{kernel}: activations of {x.dtype} are not supported (fp16, bf16, fp32)")
    check_device(x, kernel)
    if x.device != weight.device:
        raise ValueError(f"{kernel}: x is on {x.device} but the weight is on {weight.device}")


def check_bias(bias: torch.Tensor | None, n: int, device: torch.device, kernel: str) -> None:
    if bias is None:
        return
    if bias.shape != (n,) or bias.dtype not in FLOAT_DTYPES or bias.device != device:
        raise ValueError(f"{kernel}: bias must be a float [N={n}] tensor on {device}, got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device}")


def gemm_output(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor | None, bias: torch.Tensor | None,
                n: int, out_dtype: torch.dtype, kernel: str) -> torch.Tensor:
    """The checks a GEMM launcher runs on x [M, K] (its operand checks done), then its output y [M, N]."""
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{kernel}: out_dtype {out_dtype} is not supported (fp16, bf16, fp32)")
    check_device(x, kernel)
    if x.device != weight.device:
        raise ValueError(f"{kernel}: x is on {x.device} but the weight is on {weight.device}")
    m = x.shape[0]
    if x_scale is not None and x_scale.numel() != m:
        raise ValueError(f"{kernel}: x_scale must hold one scale per row ({m}), got shape {tuple(x_scale.shape)}")
    check_bias(bias, n, x.device, kernel)
    return torch.empty(m, n, dtype=out_dtype, device=x.device)


def device_capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, None when no CUDA device is visible."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def cuda_reason(p: LinearProblem, need: tuple[int, int], what: str) -> str | None:
    """Why a Triton kernel needing compute capability `need` cannot run `p` (None when it can)."""
    why = unavailable_reason(p.device)
    if why:
        return why
    cap = device_capability()
    if cap is None:
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    if cap < need:
        return f"{what} needs compute capability >= {need[0]}.{need[1]}, this GPU has {cap[0]}.{cap[1]}"
    if p.dtype not in FLOAT_DTYPES:
        return f"activations of {p.dtype} are not supported (fp16, bf16, fp32)"
    return None


# Per-token activation quantizers ----------------------------------------------------------------------


@triton.jit
def row_scale(x_row, K, EPS: tl.constexpr, QMAX: tl.constexpr, BLOCK_K: tl.constexpr):
    """A quantizer's first pass over one row of K values: s = max(max|x|, EPS) / QMAX (IEEE division)."""
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), EPS), QMAX)


def quant_block_k(k: int, block_k: int | None) -> int:
    """A quantizer's K chunk per loop step: `block_k` when given, else K rounded up to a power of two, <= 4096."""
    if block_k is not None:
        if block_k < 16 or block_k & (block_k - 1):
            raise ValueError(f"block_k={block_k}: the quantizer's K chunk must be a power of two >= 16")
        return block_k
    return min(triton.next_power_of_2(max(k, 16)), QUANT_MAX_BLOCK_K)


def quantizer_input(x2d: torch.Tensor, name: str) -> torch.Tensor:
    """A quantizer's x [M, K] checked (shape, dtype, device), with K contiguous."""
    if x2d.dim() != 2:
        raise ValueError(f"{name} takes x as [M, K], got shape {tuple(x2d.shape)}")
    if x2d.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: x of {x2d.dtype} is not supported (fp16, bf16, fp32)")
    check_device(x2d, name)
    return x2d if x2d.stride(-1) == 1 or x2d.shape[1] <= 1 else x2d.contiguous()


def row_launch(k: int, block_k: int | None) -> dict[str, int]:
    """BLOCK_K and warps of a one-program-per-row quantizer over rows of K values."""
    bk = quant_block_k(k, block_k)
    return {"BLOCK_K": bk, "num_warps": 4 if bk >= 1024 else 1}
