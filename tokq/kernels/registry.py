"""The kernel registry: which kernel runs a quantized linear layer, or a paged-attention layer, here.

Candidates are kernel objects listed in priority order (fastest first), one list per kind:
`LINEAR_KERNELS` (kernels/linear.py) and `ATTENTION_KERNELS` (kernels/attention.py). For one layer (a
`LinearProblem`: device, weight format and scheme, shape, activation dtype; or an `AttentionProblem`:
heads, head dim, dtypes, KV cache, window) the registry walks its kind's list and takes the first
whose `verdict` says yes; each candidate that says no gives its reason (`explain`); the oracle
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

import os
from dataclasses import dataclass

import torch

from . import ENV
from .attention import ATTENTION_KERNELS, AttentionCandidate, AttentionProblem, PreparedAttention
from .linear import LINEAR_KERNELS, LinearCandidate, PreparedKernel
from .problem import LinearProblem
from .reference import QuantizedWeight


class KernelError(ValueError):
    """A kernel selection that cannot work (unknown name, forced kernel that cannot run the layer)."""


@dataclass(frozen=True)
class Verdict:
    """One candidate's answer for one layer: `usable` and why (or why not)."""

    name: str
    usable: bool
    reason: str


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

    def order(self, candidates: list[Candidate]) -> list[Candidate]:
        """The candidates to try, in order: the forced ones of this kind, else all by priority; minus disabled."""
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
