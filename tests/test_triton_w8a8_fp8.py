"""The W8A8 int8 and fp8 Triton kernels and their per-token activation quantizers, against the reference.

Without a GPU the kernels run on Triton's CPU interpreter (TRITON_INTERPRET=1, set before the kernel modules
are imported) with one fixed small tile (16 x 32 x 32), so tiny shapes (M = 1, 5, 33; N = 40; K = 72) still
span several tiles, K steps and ragged edges. The interpreter loads fp8 and multiplies fp8 tiles exactly, but
its fp32 -> fp8 cast is wrong (about 2% of values, measured) and so are its bf16 dots: the fp8 quantizer is
checked there through its fp32 output (the clamped x / s before the fp8 rounding), the fp8 GEMM with
fp16 tensors holding e4m3 values and with fp8 operands made by the reference quantizer; bf16, the real fp8
cast end to end and the autotuned launches are GPU-only tests. With a GPU the same tests run on CUDA tensors.

Errors are relative, ‖out − ref‖ / ‖ref‖, against `linear_reference` in fp32 on the same x, and reported in
every assertion; `pytest -s` prints them. The quantizers must match the reference bit for bit (ties included).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is decorated

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.zeros, InterpretedFunction):  # Triton's own @jit helpers were decorated for GPUs
        pytest.fail("triton was imported in this session before TRITON_INTERPRET=1 was set (the registry imports Triton "
                    "modules when asked about CUDA layers), so its kernels cannot run on the interpreter: set "
                    "TRITON_INTERPRET=1 in the environment or in tests/conftest.py", pytrace=False)

from tests.test_kernels_cpu import fp8_weight, inputs, int_weight  # noqa: E402
from tokq.kernels.problem import LinearProblem  # noqa: E402
from tokq.kernels.reference import (  # noqa: E402
    FP8_E4M3_MAX,
    linear_reference,
    quantize_per_token_fp8,
    quantize_per_token_int8,
)
from tokq.kernels.triton import interpreting  # noqa: E402
from tokq.kernels.triton.fp8 import (  # noqa: E402
    FP8,
    FP8State,
    fp8_matmul,
    fp8_supports,
    fp8_weight_only_supports,
    prepare_fp8,
    quantize_per_token_fp8_triton,
    run_fp8,
)
from tokq.kernels.triton.w8a8 import (  # noqa: E402
    GemmConfig,
    int8_matmul,
    m_bucket,
    prepare_w8a8_int8,
    quantize_per_token_int8_triton,
    run_w8a8_int8,
    w8a8_int8_supports,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the interpreter gets this wrong)")
# fp32: summation order only. fp16 / bf16: the output's rounding (2^-11 / 2^-8 relative per element).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
# A real fp8 dot on a GPU: Hopper's tensor cores add the products inside one dot with ~14 mantissa bits (DeepSeek-V3
# report, 3.3.2), so even with each K step promoted to fp32 the result is not fp32-exact. Still ~100x below the
# error of fp8 quantization itself, so a wrong index or scale would not hide under it.
FP8_DOT_TOL = 3e-4
M_RAGGED = (1, 5, 33)
N, K = 40, 72


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float().cpu()
    return ((out.float().cpu() - ref).norm() / ref.norm()).item()


def to_dev(weight):
    return dataclasses.replace(weight, **{f.name: getattr(weight, f.name).to(DEV) for f in dataclasses.fields(weight)
                                          if isinstance(getattr(weight, f.name), torch.Tensor)})


def problem(weight, act, dtype=torch.float32, device=DEV) -> LinearProblem:
    return LinearProblem.of(weight, act, dtype, device)


def activations(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """Random rows plus the edge cases: an all-zero row and a row of exact ties (max 127 -> scale 1)."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    if m >= 3:
        x[1] = 0
        x[2] = 0
        ties = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 64.5])[:k]
        x[2, : len(ties)] = ties
    return x.to(dtype)


# --------------------------------------------------------------------------------------------------
# Per-token quantizers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,block_k", [(1, 1, None), (5, 72, 32), (4, 300, 64), (3, 16, None)])
def test_quantize_int8_matches_reference_bit_for_bit(dtype, m, k, block_k):
    x = activations(m, k, dtype)
    codes, scale = quantize_per_token_int8_triton(x.to(DEV), block_k)
    ref_codes, ref_scale = quantize_per_token_int8(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (m, 1)
    assert torch.equal(scale.cpu(), ref_scale), f"scales differ: max {(scale.cpu() - ref_scale).abs().max():.2e}"
    differ = (codes.cpu() != ref_codes).sum().item()
    assert differ == 0, f"{differ} of {codes.numel()} codes differ from torch.round's (M={m} K={k} {dtype})"
    if m >= 3 and k >= 8:  # ties round half to even
        assert codes[2, :8].tolist() == [127, 2, -4, 0, 0, 2, -126, 64]


def test_quantize_int8_strided_rows_and_rowsum():
    from tokq.kernels.triton.w8a8 import quantize_int8_with_rowsum

    big = activations(6, 100, torch.float32)
    x = big[:, 10:82]  # rows 100 apart, K=72 contiguous
    codes, scale, rowsum = quantize_int8_with_rowsum(x.to(DEV), block_k=32)
    ref_codes, ref_scale = quantize_per_token_int8(x)
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scale.cpu(), ref_scale)
    assert torch.equal(rowsum.cpu(), ref_codes.sum(1, dtype=torch.int32))
    empty_codes, empty_scale = quantize_per_token_int8_triton(torch.zeros(0, 72, device=DEV))
    assert empty_codes.shape == (0, 72) and empty_scale.shape == (0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,block_k", [(1, 1, None), (5, 72, 32), (4, 300, 64)])
def test_quantize_fp8_matches_reference_before_rounding(dtype, m, k, block_k):
    """fp32 output: exactly the reference's clamp(x / s) (the fp8 cast itself is checked on a GPU)."""
    x = activations(m, k, dtype)
    values, scale = quantize_per_token_fp8_triton(x.to(DEV), torch.float32, block_k)
    _, ref_scale = quantize_per_token_fp8(x)
    ref_values = (x.float() / ref_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    assert torch.equal(scale.cpu(), ref_scale), f"scales differ: max {(scale.cpu() - ref_scale).abs().max():.2e}"
    differ = (values.cpu() != ref_values).sum().item()
    assert differ == 0, f"{differ} of {values.numel()} values differ (M={m} K={k} {dtype})"


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(3, 72), (64, 5000), (7, 4096)])
def test_gpu_quantizers_real_fp8_bit_for_bit(dtype, m, k):
    x = activations(m, k, dtype) * 3
    codes, scale = quantize_per_token_int8_triton(x.cuda())
    ref_codes, ref_scale = quantize_per_token_int8(x)
    assert torch.equal(scale.cpu(), ref_scale) and (codes.cpu() != ref_codes).sum().item() == 0
    values, scale = quantize_per_token_fp8_triton(x.cuda())
    ref_values, ref_scale = quantize_per_token_fp8(x)
    assert values.dtype == FP8 and torch.equal(scale.cpu(), ref_scale)
    differ = (values.cpu().view(torch.uint8) != ref_values.view(torch.uint8)).sum().item()
    assert differ == 0, f"{differ} of {values.numel()} fp8 values differ from torch's cast (M={m} K={k} {dtype})"


# --------------------------------------------------------------------------------------------------
# int8 GEMM


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("m", M_RAGGED)
def test_int8_gemm_matches_reference(m, sym, dtype):
    weight = int_weight(N, K, 8, K, sym, seed=m)
    x, b = inputs(m, K, N, dtype, seed=m + 1, bias=m != 5)
    state = prepare_w8a8_int8(to_dev(weight), problem(weight, "int8", dtype))
    out = run_w8a8_int8(x.to(DEV), state, None if b is None else b.to(DEV), "int8")
    assert out.dtype == dtype and out.shape == (m, N)
    err = rel(out, linear_reference(x.float(), weight, None if b is None else b.float(), "int8"))
    print(f"int8 M={m} sym={sym} {dtype}: {err:.1e}")
    assert err < TOL[dtype], f"int8 W8A8 M={m} N={N} K={K} sym={sym} {dtype}: relative error {err:.2e}"


@pytest.mark.parametrize("config", [GemmConfig(16, 16, 32, group_m=2, num_warps=1, num_stages=1),
                                    GemmConfig(32, 16, 64, group_m=1, num_warps=2, num_stages=2)])
def test_int8_matmul_explicit_tiles(config):
    """Given tiles (benchmarks): several GROUP_M bands, a ragged last band, K steps past the end of K."""
    weight = int_weight(N, K, 8, K, sym=False, seed=7)
    x, b = inputs(33, K, N, torch.float32, seed=8, bias=True)
    state = prepare_w8a8_int8(to_dev(weight), problem(weight, "int8"))
    codes, scale = quantize_per_token_int8_triton(x.to(DEV))
    out = int8_matmul(codes, scale, state, b.to(DEV), config)  # rowsum computed inside
    err = rel(out, linear_reference(x, weight, b, "int8"))
    assert err < TOL[torch.float32], f"int8_matmul {config}: relative error {err:.2e}"


def test_eight_bit_gemms_refuse_block_k_below_32():
    """int8 and fp8 tl.dot take K steps of 32 on the GPU (Triton refuses 16 there, though its interpreter
    accepts it: seen on an H200): a given config with BLOCK_K 16 is refused before any launch, naming the fix."""
    weight = int_weight(N, K, 8, K, sym=True, seed=7)
    state = prepare_w8a8_int8(to_dev(weight), problem(weight, "int8"))
    codes, scale = quantize_per_token_int8_triton(torch.randn(4, K).to(DEV))
    with pytest.raises(ValueError, match="BLOCK_K >= 32"):
        int8_matmul(codes, scale, state, None, GemmConfig(16, 16, 16, group_m=1, num_warps=1, num_stages=1))


def test_int8_leading_dims_empty_batch_and_low_bit_codes():
    weight = int_weight(N, K, 4, K, sym=False, seed=3)  # 4-bit codes in int8 run the same GEMM
    state = prepare_w8a8_int8(to_dev(weight), problem(weight, "int8"))
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(4))
    out = run_w8a8_int8(x.to(DEV), state, None, "int8")
    assert out.shape == (2, 3, N)
    err = rel(out, linear_reference(x, weight, None, "int8"))
    assert err < TOL[torch.float32], f"int4 codes, leading dims: relative error {err:.2e}"
    assert run_w8a8_int8(torch.zeros(0, K, device=DEV), state, None, "int8").shape == (0, N)


# --------------------------------------------------------------------------------------------------
# fp8 GEMM


def fp8_state(weight, codes_dtype: torch.dtype = FP8) -> FP8State:
    state = prepare_fp8(to_dev(weight), problem(weight, "fp8"))
    return state if codes_dtype == FP8 else dataclasses.replace(state, q=state.q.to(codes_dtype))


@pytest.mark.parametrize("standin", [torch.float16, torch.float32, FP8])
@pytest.mark.parametrize("m", M_RAGGED)
def test_fp8_w8a8_gemm_with_exact_e4m3_operands(m, standin):
    """The W8A8 kernel on e4m3 values (from the reference quantizer) held as fp16/fp32, or as real fp8 tensors."""
    weight = fp8_weight(N, K, seed=m)
    x, b = inputs(m, K, N, torch.float32, seed=m + 1, bias=m != 5)
    values, scale = quantize_per_token_fp8(x)
    out = fp8_matmul(values.to(standin).to(DEV), scale.to(DEV), fp8_state(weight, standin),
                     None if b is None else b.to(DEV))
    err = rel(out, linear_reference(x, weight, b, "fp8"))
    print(f"fp8 W8A8 M={m} operands {standin}: {err:.1e}")
    tol = FP8_DOT_TOL if standin == FP8 and DEV == "cuda" else TOL[torch.float32]
    assert err < tol, f"fp8 W8A8 M={m} N={N} K={K} operands {standin}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", M_RAGGED)
def test_fp8_weight_only_matches_reference(m, dtype):
    weight = fp8_weight(N, K, seed=m)
    x, b = inputs(m, K, N, dtype, seed=m + 1, bias=m != 1)
    out = run_fp8(x.to(DEV), fp8_state(weight), None if b is None else b.to(DEV), None)
    assert out.dtype == dtype and out.shape == (m, N)
    err = rel(out, linear_reference(x.float(), weight, None if b is None else b.float(), None))
    print(f"fp8 weight-only M={m} {dtype}: {err:.1e}")
    assert err < TOL[dtype], f"fp8 weight-only M={m} N={N} K={K} {dtype}: relative error {err:.2e}"


def test_fp8_explicit_tiles_and_leading_dims():
    weight = fp8_weight(N, K, seed=9)
    state = fp8_state(weight)
    x = torch.randn(3, 11, K, generator=torch.Generator().manual_seed(10))
    out = fp8_matmul(x.reshape(33, K).to(DEV), None, state, None, GemmConfig(16, 16, 16, group_m=2, num_warps=1))
    err = rel(out, linear_reference(x.reshape(33, K), weight))
    assert err < TOL[torch.float32], f"fp8 weight-only, 16x16x16 tiles: relative error {err:.2e}"
    assert run_fp8(x.to(DEV), state, None, None).shape == (3, 11, N)
    assert run_fp8(torch.zeros(0, K, device=DEV), state, None, None).shape == (0, N)


# --------------------------------------------------------------------------------------------------
# GPU only: bf16, the real fp8 cast end to end, autotuned launches over the three M buckets


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 16, 100, 300])  # M buckets 16, 16, 128, large
def test_gpu_int8_and_fp8_end_to_end(m, dtype, monkeypatch):
    monkeypatch.setenv("TOKQ_TRITON_AUTOTUNE", "1")  # test_paged_attention turns it off for its own tests
    n, k = 576, 1536
    errors = {}
    x, b = inputs(m, k, n, dtype, seed=m, bias=True)
    for sym in (True, False):
        weight = int_weight(n, k, 8, k, sym, seed=m)
        out = run_w8a8_int8(x.cuda(), prepare_w8a8_int8(to_dev(weight), problem(weight, "int8", dtype)), b.cuda(), "int8")
        errors[f"int8 sym={sym}"] = rel(out, linear_reference(x.float(), weight, b.float(), "int8"))
    weight = fp8_weight(n, k, seed=m)
    state = fp8_state(weight)
    for act in ("fp8", None):
        out = run_fp8(x.cuda(), state, b.cuda(), act)
        assert out.dtype == dtype and out.shape == (m, n)
        errors[f"fp8 act={act}"] = rel(out, linear_reference(x.float(), weight, b.float(), act))
    values, scale = quantize_per_token_fp8_triton(x.cuda())
    fast = fp8_matmul(values, scale, state, b.cuda(), out_dtype=torch.float32, fast_accum=True)
    errors["fp8 fast_accum (fp32 out)"] = rel(fast, linear_reference(x.float(), weight, b.float(), "fp8"))
    print(f"GPU M={m} {dtype}: " + ", ".join(f"{key} {e:.1e}" for key, e in errors.items()))
    tol = {**{key: TOL[dtype] for key in errors}, "fp8 act=fp8": max(TOL[dtype], FP8_DOT_TOL),
           "fp8 fast_accum (fp32 out)": 5e-3}
    bad = {key: e for key, e in errors.items() if not e < tol[key]}
    assert not bad, f"GPU M={m} N={n} K={k} {dtype}: relative errors over tolerance {bad}"


# --------------------------------------------------------------------------------------------------
# supports: reasons, and the errors of calls a kernel cannot take


def test_supports_reasons(monkeypatch):
    per_channel = int_weight(48, 128, 8, 128, sym=False)
    grouped = int_weight(48, 128, 8, 32, sym=True)
    fp8w = fp8_weight(48, 128)
    ok, why = w8a8_int8_supports(problem(per_channel, "int8", device="cpu"))
    assert not ok and "CUDA" in why and "cpu" in why
    ok, why = fp8_supports(problem(fp8w, "fp8", device="cpu"))
    assert not ok and "CUDA" in why

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    ok, why = w8a8_int8_supports(problem(per_channel, "int8", device="cuda"))
    assert ok and "zero-point" in why, why
    assert w8a8_int8_supports(problem(int_weight(48, 128, 8, 128, True), "int8", device="cuda"))[0]
    ok, why = w8a8_int8_supports(problem(grouped, "int8", device="cuda"))
    assert not ok and "per-channel" in why and "groups of 32" in why, why
    ok, why = w8a8_int8_supports(problem(per_channel, None, device="cuda"))
    assert not ok and "int8 activations" in why, why
    ok, why = w8a8_int8_supports(problem(per_channel, "fp8", device="cuda"))
    assert not ok and "not fp8" in why, why
    ok, why = w8a8_int8_supports(problem(fp8w, "int8", device="cuda"))
    assert not ok and "integer weights" in why, why
    ok, why = w8a8_int8_supports(problem(int_weight(4, 1 << 17, 8, 1 << 17, True), "int8", device="cuda"))
    assert not ok and "overflow" in why, why

    assert fp8_supports(problem(fp8w, "fp8", device="cuda"))[0]
    assert fp8_supports(problem(fp8w, None, torch.bfloat16, device="cuda"))[0]
    assert fp8_weight_only_supports(problem(fp8w, None, torch.bfloat16, device="cuda"))[0]
    ok, why = fp8_weight_only_supports(problem(fp8w, "fp8", device="cuda"))
    assert not ok and "weight-only" in why, why
    ok, why = fp8_supports(problem(fp8w, "int8", device="cuda"))
    assert not ok and "not int8" in why, why
    ok, why = fp8_supports(problem(per_channel, "fp8", device="cuda"))
    assert not ok and "fp8 e4m3 weights" in why, why

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))  # A100: int8 yes, fp8 no
    assert w8a8_int8_supports(problem(per_channel, "int8", device="cuda"))[0]
    for supports in (fp8_supports, fp8_weight_only_supports):
        ok, why = supports(problem(fp8w, None, device="cuda"))
        assert not ok and ">= 8.9" in why and "8.0" in why, why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    ok, why = w8a8_int8_supports(problem(per_channel, "int8", device="cuda"))
    assert not ok and ">= 8.0" in why, why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = fp8_supports(problem(fp8w, "fp8", device="cuda"))
    assert not ok and "no CUDA device" in why, why


def test_calls_the_kernels_cannot_take_are_clear_errors():
    weight = int_weight(N, K, 8, K, sym=True)
    state = prepare_w8a8_int8(to_dev(weight), problem(weight, "int8"))
    x = torch.randn(3, K, device=DEV)
    with pytest.raises(ValueError, match="act='fp8' is not supported"):
        run_w8a8_int8(x, state, None, "fp8")
    with pytest.raises(ValueError, match="activations of torch.int32 are not supported"):
        run_w8a8_int8(x.int(), state, None, "int8")
    with pytest.raises(ValueError, match="x has 71 input features, the weight takes K=72"):
        run_w8a8_int8(x[:, :71], state, None, "int8")
    with pytest.raises(ValueError, match=r"per-channel scales \[N, 1\].*group size 8"):
        prepare_w8a8_int8(int_weight(N, K, 8, 8, sym=True), problem(weight, "int8"))
    with pytest.raises(ValueError, match="takes an IntWeight, not FP8Weight"):
        prepare_w8a8_int8(fp8_weight(N, K), problem(weight, "int8"))
    with pytest.raises(ValueError, match=r"bias must be a float \[N=40\]"):
        run_w8a8_int8(x, state, torch.zeros(41, device=DEV), "int8")
    with pytest.raises(ValueError, match="block sizes must be powers of two >= 16"):
        GemmConfig(8, 32, 32)
    fstate = fp8_state(fp8_weight(N, K))
    with pytest.raises(ValueError, match="act='int8'"):
        run_fp8(x, fstate, None, "int8")
    with pytest.raises(ValueError, match="must both be float8_e4m3fn"):
        fp8_matmul(x, torch.ones(3, 1, device=DEV), fstate)
    with pytest.raises(ValueError, match="takes float8_e4m3fn codes"):
        prepare_fp8(dataclasses.replace(fp8_weight(N, K), q=torch.zeros(N, K)), problem(weight, "fp8"))
    with pytest.raises(ValueError, match="out_dtype torch.float8_e5m2 is not supported"):
        quantize_per_token_fp8_triton(x, torch.float8_e5m2)
    if interpreting():
        return
    with pytest.raises(ValueError, match="Triton kernels run on CUDA tensors"):
        quantize_per_token_int8_triton(torch.randn(2, 8))


def test_m_buckets():
    assert [m_bucket(m) for m in (1, 16, 17, 128, 129, 4096)] == [16, 16, 128, 128, 0, 0]


# --------------------------------------------------------------------------------------------------
# The CUDA path compiles (no GPU needed: Triton's own ptxas builds sm_90 / sm_89 / sm_80 code)


def compile_for_cuda() -> dict[str, str]:
    """Each kernel compiled ahead of time for real GPUs; what its PTX uses. Run without the interpreter."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    from tokq.kernels.triton import fp8, w8a8

    def build(fn, sig: dict[str, str], consts: dict, arch: int, num_warps: int = 4, num_stages: int = 3) -> str:
        names = list(sig)
        # As at a launch with 16-byte aligned pointers and sizes (Triton specializes on it): vector loads, pipelining
        aligned = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a.endswith("ptr") or a in ("N", "K")
                   or a.startswith("stride")}
        src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts, attrs=aligned)
        return triton_compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages}).asm["ptx"]

    def found(ptx: str, pattern: str) -> str:
        return " ".join(sorted(set(re.findall(pattern, ptx))))

    mma = r"(?:wgmma\.mma_async|mma\.sync)\.\S+"
    out = {}
    rows = {"K": "i32", "stride_xm": "i32", "stride_qm": "i32"}
    ptx = build(w8a8._quantize_int8_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32",
                                             "rowsum_ptr": "*i32", **rows}, {"BLOCK_K": 1024, "USE_RINT": True}, 90)
    out["quant_int8"] = found(ptx, r"cvt\.rni\.\S+|div\.rn\.f32")
    ptx = build(fp8._quantize_fp8_kernel, {"x_ptr": "*fp16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", **rows},
                {"BLOCK_K": 1024}, 90)
    out["quant_fp8"] = found(ptx, r"cvt\.rn\.satfinite\.e4m3\S*|div\.rn\.f32")
    gemm = {"M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}
    int8_sig = {"x_ptr": "*i8", "w_ptr": "*i8", "y_ptr": "*bf16", "sx_ptr": "*fp32", "sw_ptr": "*fp32",
                "rowsum_ptr": "*i32", "zero_ptr": "*i32", "bias_ptr": "*bf16", **gemm}
    for bucket, arch in ((0, 90), (16, 90), (128, 80)):
        c = w8a8.INT8_CONFIGS[bucket][0]
        ptx = build(w8a8._int8_gemm_kernel, int8_sig, {"HAS_ZERO": True, "HAS_BIAS": True, **c.meta()}, arch,
                    c.num_warps, c.num_stages)
        out[f"int8_sm{arch}_bucket{bucket}"] = found(ptx, mma)
    fp8_flags = {"HAS_X_SCALE": True, "CAST_W": False, "IEEE_DOT": False, "PROMOTE_ACC": True, "HAS_BIAS": True}
    for xdt, flags, arch in (("fp8e4nv", {}, 90), ("fp8e4nv", {}, 89), ("bf16", {"HAS_X_SCALE": False, "CAST_W": True,
                                                                             "PROMOTE_ACC": False}, 90)):
        configs = fp8.FP8_CONFIGS if xdt.startswith("fp8") else fp8.WEIGHT_ONLY_CONFIGS
        c = configs[0][0]
        sig = {"x_ptr": f"*{xdt}", "w_ptr": "*fp8e4nv", "y_ptr": "*bf16", "sx_ptr": "*fp32", "sw_ptr": "*fp32",
               "bias_ptr": "*bf16", **gemm}
        ptx = build(fp8._fp8_gemm_kernel, sig, {**fp8_flags, **flags, **c.meta()}, arch, c.num_warps, c.num_stages)
        out[f"fp8_{xdt}_sm{arch}"] = found(ptx, mma + r"|cvt\.rn\.f16x2\.e4m3x2")
    return out


def test_cuda_code_compiles_and_uses_the_intended_instructions():
    triton_dir = Path(importlib.util.find_spec("triton").origin).parent
    if not any((triton_dir / "backends" / "nvidia" / "bin").glob("ptxas*")):
        pytest.skip("this triton build ships no ptxas")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = "import json, tests.test_triton_w8a8_fp8 as t; print(json.dumps(t.compile_for_cuda()))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, f"compiling for CUDA failed:\n{run.stderr[-3000:]}"
    ptx = json.loads(run.stdout.strip().splitlines()[-1])
    print("\n".join(f"{key}: {value}" for key, value in ptx.items()))
    assert ptx["quant_int8"] == "cvt.rni.f32.f32 div.rn.f32"  # round half to even, IEEE divisions
    assert ptx["quant_fp8"] == "cvt.rn.satfinite.e4m3x2.f32 div.rn.f32"
    assert "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8" in ptx["int8_sm90_bucket0"]
    assert ".s32.s8.s8.s32" in ptx["int8_sm90_bucket16"] and ".s32.s8.s8.s32" in ptx["int8_sm80_bucket128"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx["fp8_fp8e4nv_sm90"]
    assert "f32.e4m3.e4m3.f32" in ptx["fp8_fp8e4nv_sm89"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx["fp8_bf16_sm90"] and "bf16" in ptx["fp8_bf16_sm90"]
