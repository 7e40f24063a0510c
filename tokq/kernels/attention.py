"""Paged-attention kernels the registry chooses between, and what they are chosen for.

An `AttentionProblem` is one attention layer's shape (heads, KV heads, head dim), its query dtype,
the KV cache's dtype and block size, its sliding window and device. Each `AttentionCandidate` pairs a
KV write with an attention call over the same cache layout (kernels/paged.py), so whichever one runs,
the cache it writes is the cache it reads:

- `triton_paged` (CUDA): write_kv_triton + paged_attention_triton (flash-decoding splits for decode,
  a chunked-prefill kernel otherwise);
- `cpu_native_paged` (CPU, where tokq's native kernels build, cache in the queries' dtype): write_kv_native +
  paged_attention_native (decode steps through native/attention.cpp, keys read in place; anything else through
  paged_attention_cpu);
- `cpu_paged_sdpa` (CPU): write_kv_cpu + paged_attention_cpu (gather, then SDPA);
- `cpu_paged_batched` (CPU, only when TOKQ_KERNELS asks for it: cpu_paged_sdpa takes every CPU problem
  first): write_kv_cpu + paged_attention_cpu_batched (decode plan from the metadata tensors, gathers into
  reused buffers). ~25% faster than cpu_paged_sdpa on its own at batch 16 with a cache-resident layout,
  but no faster inside the engine (benchmarks/continuous_batching.py), so it is not the default;
- `paged_reference` (anywhere): write_kv_reference + paged_attention_reference (the oracle: fp32,
  explicit masked softmax).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokq.dtypes import FLOAT_DTYPES, dtype_name

from .cpu.attention import paged_attention_cpu, write_kv_cpu
from .cpu.batched import paged_attention_cpu_batched
from .cpu.native_attention import native_paged_supports, paged_attention_native, write_kv_native
from .paged import (
    KV_DTYPES,
    paged_attention_reference,
    write_kv_reference,
)
from .triton import TritonFunction
from .triton import unavailable_reason as triton_unavailable

TRITON_MAX_HEAD_DIM = 256  # kernels/triton/paged_attention.py MAX_HEAD_DIM (not imported: triton is optional)


@dataclass(frozen=True)
class AttentionProblem:
    device: str  # torch device type
    dtype: torch.dtype  # the queries' (the model's compute) dtype
    kv_dtype: torch.dtype  # the cache's: a float dtype, or int8 / float8_e4m3fn with per-head scales
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    sliding_window: int | None = None

    def describe(self) -> str:
        window = f", window {self.sliding_window}" if self.sliding_window else ""
        return (f"attention {self.num_heads}/{self.num_kv_heads} heads x {self.head_dim} ({dtype_name(self.dtype)} "
                f"queries, {dtype_name(self.kv_dtype)} KV cache, block {self.block_size}{window}) on {self.device}")

    def invalid(self) -> str | None:
        """Why no kernel can run this problem (None when the shape and dtypes make sense)."""
        if min(self.num_heads, self.num_kv_heads, self.head_dim, self.block_size) < 1:
            return "heads, KV heads, head dim and block size must all be >= 1"
        if self.num_heads % self.num_kv_heads:
            return f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads"
        if self.dtype not in FLOAT_DTYPES:
            return f"queries of {self.dtype} are not supported (fp32, bf16, fp16)"
        if self.kv_dtype not in KV_DTYPES:
            return f"a KV cache of {self.kv_dtype} is not supported ({', '.join(map(dtype_name, KV_DTYPES))})"
        if self.sliding_window is not None and self.sliding_window < 1:
            return f"sliding window {self.sliding_window} must be >= 1"
        return None


WriteFn = Callable[..., None]  # (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None, in place
AttendFn = Callable[..., torch.Tensor]  # (q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale) -> out


@dataclass(frozen=True)
class AttentionCandidate:
    name: str
    supports: Callable[[AttentionProblem], tuple[bool, str]]
    write_kv: WriteFn
    attend: AttendFn
    summary: str

    def verdict(self, problem: AttentionProblem, forced: bool = False) -> tuple[bool, str]:
        why = problem.invalid()
        return (False, why) if why else self.supports(problem)


@dataclass
class PreparedAttention:
    """A layer's attention kernel: its name, why it was chosen, and its KV write and attention call."""

    name: str
    write_kv: WriteFn
    attend: AttendFn
    reason: str = ""


def _triton_supports(p: AttentionProblem) -> tuple[bool, str]:
    why = triton_unavailable(p.device)
    if why:
        return False, why
    if p.head_dim > TRITON_MAX_HEAD_DIM:
        return False, f"head dim {p.head_dim} is above the kernels' {TRITON_MAX_HEAD_DIM}"
    if p.kv_dtype == torch.float8_e4m3fn and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        return False, "an fp8 KV cache needs compute capability >= 8.9 (Ada, Hopper)"
    split = "flash-decoding splits for long contexts" if p.sliding_window is None else "starts at the window"
    return True, f"Triton paged decode ({split}) and chunked prefill, {dtype_name(p.kv_dtype)} KV"


def _cpu_supports(p: AttentionProblem) -> tuple[bool, str]:
    if p.device != "cpu":
        return False, f"runs on CPU tensors (the layer is on {p.device})"
    return True, "gathers each sequence's visible K/V, then scaled_dot_product_attention (native GQA)"


def _cpu_native_supports(p: AttentionProblem) -> tuple[bool, str]:
    return native_paged_supports(p.device, p.dtype, p.kv_dtype)


def _cpu_batched_supports(p: AttentionProblem) -> tuple[bool, str]:
    if p.device != "cpu":
        return False, f"runs on CPU tensors (the layer is on {p.device})"
    return True, "one block gather per decode group into reused buffers, then scaled_dot_product_attention (GQA)"


def _always(p: AttentionProblem) -> tuple[bool, str]:
    return True, "gathers every sequence's K/V to fp32 and applies an explicit masked softmax (the oracle)"


ATTENTION_KERNELS: list[AttentionCandidate] = [
    AttentionCandidate("triton_paged", _triton_supports, TritonFunction("paged_attention", "write_kv_triton"),
                       TritonFunction("paged_attention", "paged_attention_triton"),
                       "paged attention in Triton: KV write, split-K decode + merge, chunked prefill; int8/fp8 KV"),
    AttentionCandidate("cpu_native_paged", _cpu_native_supports, write_kv_native, paged_attention_native,
                       "paged attention on CPU: native decode (keys in place, split-K, fp32 softmax), SDPA prefill"),
    AttentionCandidate("cpu_paged_sdpa", _cpu_supports, write_kv_cpu, paged_attention_cpu,
                       "paged attention on CPU: index_copy_ KV write, gather + SDPA (batched decode)"),
    AttentionCandidate("cpu_paged_batched", _cpu_batched_supports, write_kv_cpu, paged_attention_cpu_batched,
                       "paged attention on CPU: decode plan from tensors, reused gather buffers, SDPA per group"),
    AttentionCandidate("paged_reference", _always, write_kv_reference, paged_attention_reference,
                       "gather to fp32, explicit masked softmax (the oracle)"),
]
