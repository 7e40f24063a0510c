"""Paged attention on CPU over native torch ops (contract and layouts: kernels/paged.py).

- `write_kv_cpu`: one `index_copy_` per cache into its flattened [num_blocks * block_size, Hkv, D]
  view (the cache must be contiguous); padding slots (< 0) are dropped first. int8/fp8 caches are
  quantized with the per-head scales exactly as the reference does.
- `paged_attention_cpu`: per sequence, gather the K/V it can see (only the sliding window's part
  when there is one) into contiguous tensors with one token-level `index_select`, dequantizing
  int8/fp8 on the way (a float cache of another dtype is cast), and run
  `F.scaled_dot_product_attention(..., enable_gqa=True)` in q's dtype.
  A mask is built only where needed: a decode query sees exactly the gathered keys (none); a chunk
  that covers the whole sequence with no window uses `is_causal`; other chunks (a prefix already in
  the cache, or a window shorter than the chunk) get an explicit boolean mask with the causal offset.

Decode batching, measured (2-core AVX2 CPU shared with other jobs, 1 thread, torch 2.13, bf16, block 16,
one decode step of B sequences with context lengths drawn from [lo, hi), median of 30 calls, ms per
call; batched = sequences sorted by length, grouped while the group's gathered K stays under the cap,
one gather of whole blocks per group (a row of the [num_blocks, block_size * Hkv * D] view per block,
padded with block 0) and one SDPA call with a position mask):

    heads (q/kv x D)   B x context       per-sequence   batched<=1MiB  <=2MiB  <=4MiB  <=8MiB
    9/3 x 64 (SmolLM2) 16 x 256-500          1.63          1.46        1.43    1.29    1.28
                       16 x 256-1500         2.75          2.75        2.68    2.69    3.24
                        8 x 2000-2100        3.06          3.16        2.98    2.71    2.55
                       64 x 100-150          4.03          2.16        2.00    1.98    1.97
    4/1 x 256 (Gemma3) 16 x 256-500          1.84          1.82        1.74    1.69    1.70

Whole-block gathers beat the token-level gather an earlier version batched with (equal lengths only,
2 MiB: 1.9 ms for 16 x 256-500), and batching pays most for many short sequences; past ~4 MiB per
call the fresh buffers leave the cache and it loses again, hence `DECODE_BATCH_BYTES` = 4 MiB.
`flex_attention` was measured too and not kept: compiled
(torch.compile, 3-20 s per new shape) on the same pre-gathered K/V it took 0.57 / 1.07 / 0.78 /
1.44 ms where SDPA took 0.46 / 1.00 / 0.65 / 1.27 ms (SmolLM2 8x512, 32x256; Gemma-3 8x512, 32x256).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..paged import (
    PagedAttentionMetadata,
    attention_mask,
    check_attention_inputs,
    check_slots,
    check_write_inputs,
    dequantize_kv,
    quantize_kv,
)

BATCH_DECODE = True  # measured above
DECODE_BATCH_BYTES = 4 << 20  # gathered K per batched SDPA call (measured above)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    if not cache.is_contiguous():
        raise ValueError(f"the CPU path needs a contiguous KV cache, got strides {cache.stride()}")
    return cache.view(-1, *cache.shape[2:])


def write_kv_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Write k/v [T, Hkv, D] into the caches at slot_mapping (in place; slots < 0 are skipped)."""
    check_write_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_slots(slot_mapping, k_cache)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    _flat(k_cache).index_copy_(0, slot_mapping, quantize_kv(k, k_scale, k_cache.dtype))
    _flat(v_cache).index_copy_(0, slot_mapping, quantize_kv(v, v_scale, v_cache.dtype))


def _token_slots(table: torch.Tensor, start: int, stop: int, block_size: int) -> torch.Tensor:
    """Slots of positions [start, stop) of a sequence whose block table row is `table` (int64)."""
    pos = torch.arange(start, stop)
    return table[pos // block_size].long() * block_size + pos % block_size


def _gather(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    """Cache rows at `slots` [..., n] -> [..., n, Hkv, D] in `dtype` (int8/fp8 dequantized in fp32 first)."""
    rows = _flat(cache).index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[2:])
    if scale is not None:
        return dequantize_kv(rows, scale).to(dtype)
    return rows.to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
            causal: bool) -> torch.Tensor:
    """q [n, ql, Hq, D], k/v [n, kv, Hkv, D] -> [n, ql, Hq, D] through SDPA's native GQA."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata,
                        scale: float, sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, batch_decode: bool | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] in q's dtype, same contract as `paged_attention_reference`.

    `batch_decode` (default: the module's measured choice) runs decode sequences that see the same
    number of keys as one SDPA call instead of one call each.
    """
    dims = check_attention_inputs(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale)
    if q.device.type != "cpu":
        raise ValueError(f"paged_attention_cpu runs on CPU tensors, got q on {q.device}")
    meta.validate(dims.num_tokens, dims.num_blocks, dims.block_size)
    batch_decode = BATCH_DECODE if batch_decode is None else batch_decode
    out = torch.empty_like(q)
    qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    bs = dims.block_size
    key_bytes = dims.num_kv_heads * dims.head_dim * q.element_size()

    def kv_start(b: int) -> int:  # first key any query of sequence b can see
        first_query = seq_lens[b] - (qsl[b + 1] - qsl[b])
        return 0 if sliding_window is None else max(0, first_query - sliding_window + 1)

    decode: list[int] = []
    for b, seq_len in enumerate(seq_lens):
        q_len = qsl[b + 1] - qsl[b]
        if q_len == 0:
            continue
        start = kv_start(b)
        if q_len == 1 and batch_decode:
            decode.append(b)
            continue
        slots = _token_slots(meta.block_tables[b], start, seq_len, bs)
        k = _gather(k_cache, slots, k_scale, q.dtype).unsqueeze(0)
        v = _gather(v_cache, slots, v_scale, q.dtype).unsqueeze(0)
        window_cuts = sliding_window is not None and sliding_window < seq_len - start
        mask, causal = None, False
        if q_len > 1 and start == 0 and q_len == seq_len and not window_cuts:
            causal = True  # SDPA's is_causal is top-left aligned: right only when queries == keys
        elif q_len > 1:
            mask = attention_mask(q_len, seq_len, start, sliding_window)
        out[qsl[b]: qsl[b + 1]] = _attend(q[qsl[b]: qsl[b + 1]].unsqueeze(0), k, v, scale, mask, causal)[0]
    if decode:
        first_block = {b: kv_start(b) // bs for b in decode}
        blocks = {b: -(-seq_lens[b] // bs) - first_block[b] for b in decode}
        decode.sort(key=blocks.__getitem__)  # similar lengths share a call: little padding
        block_bytes = bs * key_bytes
        group: list[int] = []
        for b in decode:
            if group and (len(group) + 1) * blocks[b] * block_bytes > DECODE_BATCH_BYTES:
                _decode_group(q, out, k_cache, v_cache, meta, group, qsl, first_block, blocks, kv_start, seq_lens,
                              scale, k_scale, v_scale)
                group = []
            group.append(b)
        _decode_group(q, out, k_cache, v_cache, meta, group, qsl, first_block, blocks, kv_start, seq_lens, scale,
                      k_scale, v_scale)
    return out


def _decode_group(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: PagedAttentionMetadata, seqs: Sequence[int], qsl: Sequence[int], first_block: dict[int, int],
                  blocks: dict[int, int], kv_start, seq_lens: Sequence[int], scale: float,
                  k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """Decode queries of several sequences in one SDPA call: gather whole blocks (one row per block of the
    [num_blocks, block_size * Hkv * D] view, padded to the longest with block 0), mask by position."""
    bs = k_cache.shape[1]
    width = max(blocks[b] for b in seqs)
    host = meta.block_tables.tolist() if not isinstance(meta.block_tables, list) else meta.block_tables
    table = torch.tensor([host[b][first_block[b]: first_block[b] + blocks[b]] + [0] * (width - blocks[b])
                          for b in seqs], dtype=torch.long)
    k = _gather_blocks(k_cache, table, k_scale, q.dtype)
    v = _gather_blocks(v_cache, table, v_scale, q.dtype)
    first = torch.tensor([first_block[b] * bs for b in seqs])
    pos = first[:, None] + torch.arange(width * bs)[None, :]
    lo = torch.tensor([kv_start(b) for b in seqs])
    hi = torch.tensor([seq_lens[b] for b in seqs])
    mask = ((pos >= lo[:, None]) & (pos < hi[:, None]))[:, None, None, :]  # [n, 1, 1, keys]
    rows = torch.tensor([qsl[b] for b in seqs])
    out[rows] = _attend(q[rows].unsqueeze(1), k, v, scale, mask, False)[:, 0]


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """Blocks table [n, w] of the cache -> [n, w * block_size, Hkv, D] in `dtype` (int8/fp8 dequantized)."""
    n, w = table.shape
    rows = cache.index_select(0, table.flatten()).view(n, w * cache.shape[1], *cache.shape[2:])
    if scale is not None:
        return dequantize_kv(rows, scale).to(dtype)
    return rows.to(dtype)
