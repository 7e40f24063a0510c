"""Paged attention through tokq's native CPU kernels (native/attention.cpp) for decode steps; everything else
through the torch-op path (attention.py).

- `write_kv_native`: the new keys/values copied into their slots by `tokq_native::paged_write` (every slot
  bounds-checked before any is written). int8/fp8 caches, or new K/V of another dtype than the cache, go
  through `write_kv_cpu`, which quantizes or casts.
- `paged_attention_native`: a step in which every sequence has exactly one query (a decode step) runs
  `tokq_native::paged_decode`: each sequence's keys read in place through its block table, fp32 softmax, split
  over (sequence, chunk of 128 keys with every KV head) and merged by log-sum-exp. Prefill chunks, mixed steps, quantized caches
  and a cache dtype other than the queries' run `paged_attention_cpu`.

Measured (2-core Xeon, 1 thread, bf16, SmolLM2's 9/3 heads x 64, 600 keys, batch 1, best of 40): 60 us a call
against 176 us for `paged_attention_cpu` (SDPA on views of the cache); 43 us at 2 threads. Inside a decode step the
caches come from memory (the weights streamed between layers evict them): there it is 72 us a call, thanks to
prefetching each key's slot ahead (157 us without). A decode step of SmolLM2 int4 + int8 head, step-alternated:
1.20x (1 thread) / 1.27x (2 threads) the step with `cpu_paged_sdpa`, and 1.41x at 2 threads when the compiled
graph calls the op directly (engine/compiled_decode.py, `NativeGraphAttention`). Checks: metadata the engine validated once per step (`trusted`) is not re-checked in
Python; the C++ op checks shapes, dtypes, every block id it reads and every slot it writes regardless, and its
errors are raised as ValueError like the Python path's.
"""

from __future__ import annotations

import torch

from ..paged import PagedAttentionMetadata, check_attention_inputs, check_write_inputs
from . import native
from .attention import paged_attention_cpu, write_kv_cpu


def native_paged_supports(device: str, dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[bool, str]:
    if device != "cpu":
        return False, f"runs on CPU tensors (the layer is on {device})"
    if kv_dtype != dtype:
        return False, f"reads a cache in the queries' dtype; this one is {kv_dtype} (the torch-op path dequantizes)"
    why = native.unavailable()
    if why:
        return False, why
    return True, "decode: tokq's native paged decode (keys read in place, split-K); prefill: gather + SDPA"


def _native_error(exc: RuntimeError) -> ValueError:
    """The op's TORCH_CHECK message, first line only (the rest is a C++ backtrace), as the ValueError the Python
    path raises for bad input."""
    return ValueError(str(exc).strip().splitlines()[0])


def write_kv_native(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Write k/v [T, Hkv, D] into the caches at slot_mapping (in place; slots < 0 are skipped)."""
    if k_scale is not None or v_scale is not None or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        write_kv_cpu(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    check_write_inputs(k, v, k_cache, v_cache, slot_mapping)
    try:
        torch.ops.tokq_native.paged_write(k, v, k_cache, v_cache, slot_mapping)
    except RuntimeError as exc:
        raise _native_error(exc) from None


def paged_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedAttentionMetadata, scale: float, sliding_window: int | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D], the contract of `paged_attention_reference`."""
    decode = (meta.max_query_len == 1 and q.shape[0] == meta.num_seqs and k_scale is None and v_scale is None
              and q.dtype == k_cache.dtype == v_cache.dtype and q.device.type == "cpu")
    if not decode:
        return paged_attention_cpu(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale)
    if not meta.trusted:
        dims = check_attention_inputs(q, k_cache, v_cache, meta, scale, sliding_window, None, None)
        meta.validate(dims.num_tokens, dims.num_blocks, dims.block_size)
    try:
        return torch.ops.tokq_native.paged_decode(q.contiguous(), k_cache, v_cache, meta.block_tables.contiguous(),
                                                  meta.seq_lens, meta.query_start_loc, scale, sliding_window or 0)
    except RuntimeError as exc:
        raise _native_error(exc) from None
