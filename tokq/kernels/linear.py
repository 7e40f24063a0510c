"""Linear (GEMM) kernels the registry chooses between, in priority order, and what they are chosen for.

A `LinearProblem` (kernels/problem.py) is one quantized layer: device, weight format and scheme,
activation scheme, shape and activation dtype. Each `LinearCandidate` is one kernel:

- what it is registered for: devices, weight formats, activation schemes (`serves`);
- `supports(problem) -> (ok, reason)`: the kernel's own check (ops present, GPU, codes, grouping,
  shape), which says in its own words why it cannot run a layer;
- `prepare(weight, problem) -> state`, once per layer (packing), and `run(x, state, bias, act) -> y`
  per call, in x's dtype;
- its priority: `LINEAR_KERNELS` lists the kernels fastest first and the registry walks it, taking
  the first that can run the layer. The oracle runs everything, so it is last:

  triton_w4a16, triton_w8a8_int8, triton_fp8   CUDA (kernels/triton/, imported on first use)
  cpu_native_int8, cpu_native_int4, cpu_int4,  CPU (kernels/cpu/linear.py over torch ops; native_linear.py
  cpu_int8, cpu_w8a8_int8, cpu_fp8_dequant     over tokq's own GEMVs, kernels/cpu/native)
  reference                                    anywhere (kernels/reference.py)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokq.dtypes import DTYPE_NAMES

from . import ENV
from .cpu import linear as cpu
from .cpu import native_linear
from .problem import ACT_SCHEMES, WEIGHT_FORMATS, LinearProblem
from .reference import QuantizedWeight, linear_reference
from .triton import TritonFunction
from .triton import unavailable_reason as triton_unavailable

Support = tuple[bool, str]
SupportsFn = Callable[[LinearProblem], Support]
PrepareFn = Callable[[QuantizedWeight, LinearProblem], Any]  # once per layer: weight -> the kernel's state
RunFn = Callable[[torch.Tensor, Any, torch.Tensor | None, str | None], torch.Tensor]  # (x, state, bias, act) -> y


@dataclass(frozen=True)
class LinearCandidate:
    """One linear kernel: what it is registered for, its check, its two calls and its place in the walk."""

    name: str
    priority: int  # lower is tried first
    devices: frozenset[str] | None  # torch device types it runs on; None: any
    formats: frozenset[str]  # weight formats (LinearProblem.fmt)
    acts: frozenset[str | None]  # activation schemes (LinearProblem.act); None: weight-only
    supports: SupportsFn
    prepare: PrepareFn
    run: RunFn
    summary: str
    # The dtype the kernel computes in whatever x's is (None: x's own). A kernel that would compute
    # below the layer's precision (bf16 for an fp32 model) is only used when TOKQ_KERNELS forces it.
    compute_dtype: torch.dtype | None = None
    # Why the kernel, though able to run the problem, is not chosen for it unless TOKQ_KERNELS forces it (a speed
    # preference measured for some shapes only); None: no preference.
    unless_forced: Callable[[LinearProblem], str | None] | None = None

    def serves(self, problem: LinearProblem) -> bool:
        """Whether the problem's device, weight format and activation scheme are ones it is registered for."""
        return ((self.devices is None or problem.device in self.devices) and problem.fmt in self.formats
                and problem.act in self.acts)

    def verdict(self, problem: LinearProblem, forced: bool = False) -> Support:
        ok, reason = self.supports(problem)
        if ok and not self.serves(problem):  # a check that accepts more than the kernel is registered for
            return False, f"not registered for {problem.scheme} on {problem.device}"
        if ok and self.compute_dtype not in (None, problem.dtype) and not forced:
            have, want = DTYPE_NAMES.get(problem.dtype, problem.dtype), DTYPE_NAMES[self.compute_dtype]
            return False, (f"computes in {want}, below the layer's {have} activations; load the model in {want} "
                           f"or force it with {ENV}={self.name}")
        if ok and self.unless_forced is not None and not forced:
            why = self.unless_forced(problem)
            if why:
                return False, f"{why}; force it with {ENV}={self.name}"
        return ok, reason


@dataclass
class PreparedKernel:
    """A layer's kernel, ready to run: its name, the function, and the packed weight it reads."""

    name: str
    run: RunFn
    state: Any
    reason: str = ""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, act: str | None) -> torch.Tensor:
        return self.run(x, self.state, bias, act)


def _triton_supports(check: TritonFunction) -> SupportsFn:
    """A Triton kernel's check, asked only when the layer is on CUDA and triton is installed (so that
    nothing imports triton for a CPU model)."""

    def supports(p: LinearProblem) -> Support:
        why = triton_unavailable(p.device)
        return (False, why) if why else check(p)

    return supports


def _oracle_supports(p: LinearProblem) -> Support:
    return True, "dequantizes the whole weight to fp32 on every call (the oracle)"


def _unchanged(weight: QuantizedWeight, p: LinearProblem) -> QuantizedWeight:
    return weight


CUDA = frozenset({"cuda"})
CPU = frozenset({"cpu"})
INT = frozenset({"int"})
FP8 = frozenset({"fp8"})
WEIGHT_ONLY = frozenset({None})
INT8_ACTS = frozenset({"int8"})

LINEAR_KERNELS: list[LinearCandidate] = [
    LinearCandidate(
        "triton_w4a16", priority=10, devices=CUDA, formats=INT, acts=WEIGHT_ONLY,
        supports=_triton_supports(TritonFunction("w4a16", "w4a16_supports")),
        prepare=TritonFunction("w4a16", "prepare_w4a16"), run=TritonFunction("w4a16", "run_w4a16"),
        summary="int4/int8 weight-only: Triton GEMM with the dequantization fused into the K loop, split-K for small M"),
    LinearCandidate(
        "triton_w8a8_int8", priority=20, devices=CUDA, formats=INT, acts=INT8_ACTS,
        supports=_triton_supports(TritonFunction("w8a8", "w8a8_int8_supports")),
        prepare=TritonFunction("w8a8", "prepare_w8a8_int8"), run=TritonFunction("w8a8", "run_w8a8_int8"),
        summary="W8A8 int8: per-token activation quantization kernel, int8 tl.dot, scale (+ bias) epilogue"),
    LinearCandidate(
        "triton_fp8", priority=30, devices=CUDA, formats=FP8, acts=frozenset({None, "fp8"}),
        supports=_triton_supports(TritonFunction("fp8", "fp8_supports")),
        prepare=TritonFunction("fp8", "prepare_fp8"), run=TritonFunction("fp8", "run_fp8"),
        summary="fp8 e4m3 W8A8 (per-token x per-channel scales) or fp8 weight-only, Triton"),
    LinearCandidate(
        "cpu_native_int8", priority=35, devices=CPU, formats=INT, acts=WEIGHT_ONLY,
        supports=native_linear.native_int8_supports, prepare=native_linear.prepare_native_int8,
        run=native_linear.run_native_int8,
        summary="int8 weight-only per-channel: tokq's native GEMV (int8 activations per block, VNNI/AVX2) for "
                "decode, aten int8pack for more rows", compute_dtype=torch.bfloat16,
        unless_forced=native_linear.native_int8_not_preferred),
    LinearCandidate(
        "cpu_native_int4", priority=38, devices=CPU, formats=INT, acts=WEIGHT_ONLY,
        supports=native_linear.native_int4_supports, prepare=native_linear.prepare_native_int4,
        run=native_linear.run_native_int4,
        summary="int4 weight-only: tokq's native GEMV (int8 activations per block, VNNI/AVX2) up to 32 rows, "
                "dequantize + bf16 GEMM above; chosen on AVX-512 VNNI builds, where it measured faster than "
                "aten int4pack", compute_dtype=torch.bfloat16,
        unless_forced=native_linear.native_int4_not_preferred),
    LinearCandidate(
        "cpu_int4", priority=40, devices=CPU, formats=INT, acts=WEIGHT_ONLY,
        supports=cpu.int4pack_supports, prepare=cpu.prepare_int4pack, run=cpu.run_int4pack,
        summary="int4 weight-only: aten._weight_int4pack_mm_for_cpu, bf16 compute", compute_dtype=torch.bfloat16),
    LinearCandidate(
        "cpu_int8", priority=50, devices=CPU, formats=INT, acts=WEIGHT_ONLY,
        supports=cpu.int8pack_supports, prepare=cpu.prepare_int8pack, run=cpu.run_int8pack,
        summary="int8 weight-only per-channel: aten._weight_int8pack_mm, bf16 compute", compute_dtype=torch.bfloat16),
    LinearCandidate(
        "cpu_w8a8_int8", priority=60, devices=CPU, formats=INT, acts=INT8_ACTS,
        supports=cpu.w8a8_supports, prepare=cpu.prepare_w8a8, run=cpu.run_w8a8,
        summary="W8A8 int8: per-token int8 activations, torch._int_mm, fp32 epilogue"),
    LinearCandidate(
        "cpu_fp8_dequant", priority=70, devices=CPU, formats=FP8, acts=frozenset(ACT_SCHEMES),
        supports=cpu.dequant_dense_supports, prepare=cpu.prepare_dequant_dense, run=cpu.run_dequant_dense,
        summary="fp8: dequantized once to a dense weight, F.linear"),
    LinearCandidate(
        "reference", priority=1000, devices=None, formats=frozenset(WEIGHT_FORMATS), acts=frozenset(ACT_SCHEMES),
        supports=_oracle_supports, prepare=_unchanged, run=linear_reference,
        summary="dequantize to fp32, then matmul (the oracle)"),
]

if [k.priority for k in LINEAR_KERNELS] != sorted({k.priority for k in LINEAR_KERNELS}):
    raise ValueError(f"LINEAR_KERNELS must be listed by strictly rising priority: "
                     f"{[(k.name, k.priority) for k in LINEAR_KERNELS]}")
