"""The kernel registry: which kernel runs a quantized linear layer, or a paged-attention layer, here.

Candidates are listed in priority order (fastest first), one list per kind: `LINEAR_KERNELS` and
`ATTENTION_KERNELS` (kernels/attention.py). For one layer (a `LinearProblem`: device, weight format and
scheme, shape, activation dtype; or an `AttentionProblem`: heads, head dim, dtypes, KV cache, window)
the registry walks its kind's list and takes the first whose `supports` says yes; the oracle
(`reference`, `paged_reference`) runs everything, so it is last. The chosen linear kernel's `prepare`
runs once, when the layer is loaded or quantized, and the layer keeps the `PreparedKernel` (packed
weights and the function that runs them); an attention layer keeps a `PreparedAttention`.

Kernels that compute in a lower precision than the layer's activations (the CPU int4/int8 ops run
bf16 only) are skipped for fp32/fp16 models unless forced: an fp32 model is asked for fp32 results,
and the fast CPU paths are meant for the bf16 model that is served.

`TOKQ_KERNELS` (comma-separated kernel names, of either kind) changes the walk:
- `TOKQ_KERNELS=reference` forces: only the named kernels of that kind are tried, in the order given;
  a layer none of them can run is an error that says why and which kernels could run it. A kind with
  no name forced keeps its usual walk (`TOKQ_KERNELS=cpu_int4` does not change attention).
- `TOKQ_KERNELS=-cpu_int4` disables: that kernel is skipped. Both kinds may be mixed.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import cpu
from .attention import ATTENTION_KERNELS, AttentionCandidate, AttentionProblem, PreparedAttention
from .problem import DTYPE_NAMES, LinearProblem
from .reference import QuantizedWeight, linear_reference
from .triton import unavailable_reason as triton_unavailable

ENV = "TOKQ_KERNELS"

RunFn = Callable[[torch.Tensor, Any, torch.Tensor | None, str | None], torch.Tensor]


class KernelError(ValueError):
    """A kernel selection that cannot work (unknown name, forced kernel that cannot run the layer)."""


@dataclass(frozen=True)
class LinearCandidate:
    name: str
    supports: Callable[[LinearProblem], tuple[bool, str]]
    prepare: Callable[[QuantizedWeight, LinearProblem], Any]  # once per layer: weight -> the kernel's state
    run: RunFn  # per call: (x, state, bias, act) -> y in x's dtype
    summary: str
    # The dtype the kernel computes in whatever x's is (None: x's own). A kernel that would compute
    # below the layer's precision (bf16 for an fp32 model) is only used when TOKQ_KERNELS forces it.
    compute_dtype: torch.dtype | None = None

    def verdict(self, problem: LinearProblem, forced: bool = False) -> tuple[bool, str]:
        ok, reason = self.supports(problem)
        if ok and self.compute_dtype not in (None, problem.dtype) and not forced:
            have, want = DTYPE_NAMES.get(problem.dtype, problem.dtype), DTYPE_NAMES[self.compute_dtype]
            return False, (f"computes in {want}, below the layer's {have} activations; load the model in {want} "
                           f"or force it with {ENV}={self.name}")
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


@dataclass(frozen=True)
class Verdict:
    """One candidate's answer for one layer: `usable` and why (or why not)."""

    name: str
    usable: bool
    reason: str


class _Lazy:
    """A function of a Triton module, imported on first use (triton is optional and slow to import)."""

    def __init__(self, module: str, attr: str):
        self.module, self.attr, self.fn = module, attr, None

    def __call__(self, *args):
        if self.fn is None:
            self.fn = getattr(importlib.import_module(f".triton.{self.module}", __package__), self.attr)
        return self.fn(*args)


def _triton_supports(module: str, attr: str) -> Callable[[LinearProblem], tuple[bool, str]]:
    check = _Lazy(module, attr)

    def supports(p: LinearProblem) -> tuple[bool, str]:
        why = triton_unavailable(p.device)
        return (False, why) if why else check(p)

    return supports


def _triton(name: str, module: str, kernel: str, summary: str) -> LinearCandidate:
    """A Triton candidate whose module provides `<kernel>_supports`, `prepare_<kernel>`, `run_<kernel>`."""
    return LinearCandidate(name, _triton_supports(module, f"{kernel}_supports"), _Lazy(module, f"prepare_{kernel}"),
                           _Lazy(module, f"run_{kernel}"), summary)


def _always(p: LinearProblem) -> tuple[bool, str]:
    return True, "dequantizes the whole weight to fp32 on every call (the oracle)"


LINEAR_KERNELS: list[LinearCandidate] = [
    _triton("triton_w4a16", "w4a16", "w4a16",
            "int4/int8 weight-only: Triton GEMM with the dequantization fused into the K loop, split-K for small M"),
    _triton("triton_w8a8_int8", "w8a8", "w8a8_int8",
            "W8A8 int8: per-token activation quantization kernel, int8 tl.dot, scale (+ bias) epilogue"),
    _triton("triton_fp8", "fp8", "fp8", "fp8 e4m3 W8A8 (per-token x per-channel scales) or fp8 weight-only, Triton"),
    LinearCandidate("cpu_int4", cpu.int4pack_supports, cpu.prepare_int4pack, cpu.run_int4pack,
                    "int4 weight-only: aten._weight_int4pack_mm_for_cpu, bf16 compute", torch.bfloat16),
    LinearCandidate("cpu_int8", cpu.int8pack_supports, cpu.prepare_int8pack, cpu.run_int8pack,
                    "int8 weight-only per-channel: aten._weight_int8pack_mm, bf16 compute", torch.bfloat16),
    LinearCandidate("cpu_w8a8_int8", cpu.w8a8_supports, cpu.prepare_w8a8, cpu.run_w8a8,
                    "W8A8 int8: per-token int8 activations, torch._int_mm, fp32 epilogue"),
    LinearCandidate("cpu_fp8_dequant", cpu.dequant_dense_supports, cpu.prepare_dequant_dense, cpu.run_dequant_dense,
                    "fp8: dequantized once to a dense weight, F.linear"),
    LinearCandidate("reference", _always, lambda weight, p: weight, linear_reference,
                    "dequantize to fp32, then matmul (the oracle)"),
]
KERNELS_BY_NAME = {c.name: c for c in LINEAR_KERNELS}
ATTENTION_BY_NAME = {c.name: c for c in ATTENTION_KERNELS}
ALL_KERNEL_NAMES = (*KERNELS_BY_NAME, *ATTENTION_BY_NAME)
Candidate = LinearCandidate | AttentionCandidate
Problem = LinearProblem | AttentionProblem


@dataclass(frozen=True)
class Selection:
    """A parsed TOKQ_KERNELS: forced names (in order; empty = all, by priority) and disabled names."""

    forced: tuple[str, ...] = ()
    disabled: frozenset[str] = frozenset()
    source: str = ""

    @classmethod
    def parse(cls, text: str | None) -> Selection:
        forced: list[str] = []
        disabled: set[str] = set()
        for item in (text or "").split(","):
            item = item.strip()
            if not item:
                continue
            name = item[1:].strip() if item.startswith("-") else item
            if name not in ALL_KERNEL_NAMES:
                raise KernelError(f"{ENV}={text!r} names {name!r}, which is not a kernel; known kernels: "
                                  f"{', '.join(ALL_KERNEL_NAMES)} (prefix a name with '-' to disable it)")
            if item.startswith("-"):
                disabled.add(name)
            else:
                forced.append(name)
        return cls(tuple(dict.fromkeys(forced)), frozenset(disabled), text or "")

    @classmethod
    def from_env(cls) -> Selection:
        return cls.parse(os.environ.get(ENV))

    def forced_among(self, candidates: list[Candidate]) -> tuple[str, ...]:
        """The forced names of this kind (empty: none forced, the usual walk)."""
        names = {c.name for c in candidates}
        return tuple(n for n in self.forced if n in names)

    def order(self, candidates: list[Candidate] | None = None) -> list[Candidate]:
        """The candidates to try, in order: the forced ones of this kind, else all by priority; minus disabled."""
        candidates = LINEAR_KERNELS if candidates is None else candidates
        by_name = {c.name: c for c in candidates}
        names = self.forced_among(candidates) or tuple(by_name)
        return [by_name[n] for n in names if n not in self.disabled]


def _selection(selection: Selection | str | None) -> Selection:
    if isinstance(selection, Selection):
        return selection
    return Selection.parse(selection) if selection is not None else Selection.from_env()


def _kind(problem: Problem) -> list[Candidate]:
    return ATTENTION_KERNELS if isinstance(problem, AttentionProblem) else LINEAR_KERNELS


def explain(problem: Problem, selection: Selection | str | None = None) -> list[Verdict]:
    """Every candidate's verdict for `problem`, in priority order (those TOKQ_KERNELS excludes say so)."""
    sel = _selection(selection)
    candidates = _kind(problem)
    allowed = {c.name for c in sel.order(candidates)}
    verdicts = []
    for c in candidates:
        if c.name in sel.disabled:
            verdicts.append(Verdict(c.name, False, f"disabled by {ENV}={sel.source}"))
        elif c.name not in allowed:
            verdicts.append(Verdict(c.name, False, f"not among the kernels {ENV}={sel.source} forces"))
        else:
            verdicts.append(Verdict(c.name, *c.verdict(problem, c.name in sel.forced)))
    return verdicts


def choose(problem: Problem, selection: Selection | str | None = None) -> tuple[Candidate, str]:
    """The kernel for `problem` and why it can run it; a KernelError when TOKQ_KERNELS leaves none
    (or, for attention, when no kernel can run the problem at all)."""
    sel = _selection(selection)
    candidates = _kind(problem)
    tried = sel.order(candidates)
    for c in tried:
        ok, reason = c.verdict(problem, c.name in sel.forced)
        if ok:
            return c, reason
    able = [c.name for c in candidates if c.verdict(problem, True)[0]]
    if not able:
        raise KernelError(f"no kernel can run {problem.describe()}: {candidates[-1].verdict(problem, True)[1]}")
    if not tried:
        raise KernelError(f"{ENV}={sel.source} disables every kernel; {problem.describe()} can run on: {', '.join(able)}")
    why = "; ".join(f"{c.name}: {c.verdict(problem, True)[1]}" for c in tried)
    raise KernelError(f"{ENV}={sel.source} leaves no kernel that can run {problem.describe()} ({why}); "
                      f"kernels that can: {', '.join(able)}. Change or unset {ENV}")


def prepare_attention_kernel(problem: AttentionProblem, selection: Selection | str | None = None) -> PreparedAttention:
    """Choose the paged-attention kernel (KV write + attention) for one attention layer (once, at load)."""
    candidate, reason = choose(problem, selection)
    return PreparedAttention(candidate.name, candidate.write_kv, candidate.attend, reason)


def prepare_linear_kernel(weight: QuantizedWeight, act: str | None, dtype: torch.dtype,
                          selection: Selection | str | None = None) -> PreparedKernel:
    """Choose the kernel for one quantized layer and build its packed form (once, at load)."""
    problem = LinearProblem.of(weight, act, dtype)
    candidate, reason = choose(problem, selection)
    return PreparedKernel(candidate.name, candidate.run, candidate.prepare(weight, problem), reason)
