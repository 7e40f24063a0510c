"""Paged attention on CPU over native torch ops (contract and layouts: kernels/paged.py).

- `write_kv_cpu`: one `index_copy_` per cache into its flattened [num_blocks * block_size, Hkv, D]
  view (the cache must be contiguous); padding slots (< 0) are dropped first. int8/fp8 caches are
  quantized with the per-head scales exactly as the reference does.
- `paged_attention_cpu`: a prefill chunk gathers the K/V its sequence can see (only the sliding
  window's part when there is one) with one token-level `index_select`, dequantizing int8/fp8 on the
  way (a float cache of another dtype is cast), and runs `F.scaled_dot_product_attention(...,
  enable_gqa=True)` in q's dtype: `is_causal` when the chunk covers the whole sequence with no window
  cutting it, else an explicit boolean mask with the causal offset. Decode queries are batched (below).
  Which keys each query sees, the decode groups and the masks depend only on the metadata and the
  window: that plan is built once per metadata object (once per engine step) and reused by every
  layer (a batch-1 decode call: 87 us with the plan reused, 141 us building it per layer; SmolLM2
  heads, 600 tokens, bf16).

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

Whole-block gathers beat a token-level gather of the same groups (equal lengths only, 2 MiB: 1.9 ms
for 16 x 256-500), and batching pays most for many short sequences; past ~4 MiB per call the fresh
buffers leave the cache and it loses again, hence `DECODE_BATCH_BYTES` = 4 MiB. `flex_attention` is
slower: compiled (torch.compile, 3-20 s per new shape) on the same pre-gathered K/V it takes 0.57 /
1.07 / 0.78 / 1.44 ms where SDPA takes 0.46 / 1.00 / 0.65 / 1.27 ms (SmolLM2 8x512, 32x256; Gemma-3
8x512, 32x256).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

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
# A step with at most this many decode sequences reads each one's keys in place when its visible blocks are
# consecutive (a fresh engine's batch-1 decode always; a long-running server's often): a view instead of a
# gather. Measured below, batch 1 (SmolLM2 heads, 600 keys, bf16, 1 thread): 63 us against 80 us gathered.
VIEW_DECODE_MAX_SEQS = 1
VIEW_MAX_RUNS = 4  # more runs of consecutive blocks than this: gathered instead


def _flat(cache: torch.Tensor) -> torch.Tensor:
    if not cache.is_contiguous():
        raise ValueError(f"the CPU path needs a contiguous KV cache, got strides {cache.stride()}")
    return cache.view(-1, *cache.shape[2:])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (index_copy_/index_select have no fp8 kernels on CPU); others unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _from_bytes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if t.dtype != dtype else t


def write_kv_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Write k/v [T, Hkv, D] into the caches at slot_mapping (in place; slots < 0 are skipped)."""
    check_write_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = _checked_slots(slot_mapping, k_cache)
    if keep is not None:
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    _bytes(_flat(k_cache)).index_copy_(0, slot_mapping, _bytes(quantize_kv(k, k_scale, k_cache.dtype)))
    _bytes(_flat(v_cache)).index_copy_(0, slot_mapping, _bytes(quantize_kv(v, v_scale, v_cache.dtype)))


_slots_cache: dict = {"slots": None, "checked": {}}


def _checked_slots(slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor | None:
    """Check the slots against the cache's size (a sync) and return the mask of real ones (None: all are).

    A step writes every layer at the same slots: both answers are kept per slot tensor (by identity) and cache
    capacity, so a 30-layer decode step syncs once rather than 60 times."""
    capacity = k_cache.shape[0] * k_cache.shape[1]
    cached = _slots_cache["slots"]
    if cached is None or cached() is not slot_mapping:
        _slots_cache["slots"], _slots_cache["checked"] = weakref.ref(slot_mapping), {}
    if capacity not in _slots_cache["checked"]:
        check_slots(slot_mapping, k_cache)
        keep = slot_mapping >= 0
        _slots_cache["checked"][capacity] = None if bool(keep.all()) else keep
    return _slots_cache["checked"][capacity]


def _token_slots(table: torch.Tensor, start: int, stop: int, block_size: int) -> torch.Tensor:
    """Slots of positions [start, stop) of a sequence whose block table row is `table` (int64)."""
    pos = torch.arange(start, stop)
    return table[pos // block_size].long() * block_size + pos % block_size


def _gather(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    """Cache rows at `slots` [..., n] -> [..., n, Hkv, D] in `dtype` (int8/fp8 dequantized in fp32 first)."""
    rows = _from_bytes(_bytes(_flat(cache)).index_select(0, slots.flatten()), cache.dtype)
    rows = rows.view(*slots.shape, *cache.shape[2:])
    if scale is not None:
        return dequantize_kv(rows, scale).to(dtype)
    return rows.to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
            causal: bool) -> torch.Tensor:
    """q [n, ql, Hq, D], k/v [n, kv, Hkv, D] -> [n, ql, Hq, D] through SDPA's native GQA."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


@dataclass(frozen=True)
class _PrefillPart:
    rows: slice  # its queries in q
    slots: torch.Tensor  # int64 [keys]: the visible keys' cache slots
    mask: torch.Tensor | None
    causal: bool


@dataclass(frozen=True)
class _DecodeGroup:
    rows: torch.Tensor  # int64 [n]: the sequences' query rows in q
    blocks: torch.Tensor  # int64 [n * width]: the blocks to gather (padded with block 0)
    width: int
    mask: torch.Tensor  # bool [n, 1, 1, width * block_size]


@dataclass(frozen=True)
class _DecodeView:
    """A decode sequence whose visible keys lie in a few runs of consecutive physical blocks: read in place, no
    gather (a prefix-cache hit typically makes two runs: the shared prefix's blocks and the sequence's own)."""

    row: int  # its query row in q
    runs: tuple[tuple[int, int], ...]  # (first row in the flattened [num_blocks * block_size, Hkv, D] cache, keys)


@dataclass(frozen=True)
class _Plan:
    """What a call does for one metadata and window, independent of the layer: computed once per step
    (every layer of a model reuses it) and cached by the metadata object's identity."""

    prefill: list[_PrefillPart]
    decode: list[_DecodeGroup]
    views: list[_DecodeView]


_plan_cache: dict = {"meta": None, "plans": {}}


def _plan(meta: PagedAttentionMetadata, sliding_window: int | None, block_size: int, key_bytes: int,
          batch_decode: bool) -> _Plan:
    cached = _plan_cache["meta"]
    if cached is None or cached() is not meta:
        _plan_cache["meta"], _plan_cache["plans"] = weakref.ref(meta), {}
    key = (sliding_window, block_size, key_bytes, batch_decode)
    plan = _plan_cache["plans"].get(key)
    if plan is None:
        plan = _plan_cache["plans"][key] = _make_plan(meta, sliding_window, block_size, key_bytes, batch_decode)
    return plan


def _make_plan(meta: PagedAttentionMetadata, sliding_window: int | None, bs: int, key_bytes: int,
               batch_decode: bool) -> _Plan:
    qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    tables = meta.block_tables.tolist()

    def kv_start(b: int) -> int:  # first key any query of sequence b can see
        first_query = seq_lens[b] - (qsl[b + 1] - qsl[b])
        return 0 if sliding_window is None else max(0, first_query - sliding_window + 1)

    prefill, decode = [], []
    for b, seq_len in enumerate(seq_lens):
        q_len = qsl[b + 1] - qsl[b]
        if q_len == 0:
            continue
        start = kv_start(b)
        if q_len == 1 and batch_decode:
            decode.append(b)
            continue
        slots = _token_slots(meta.block_tables[b], start, seq_len, bs)
        window_cuts = sliding_window is not None and sliding_window < seq_len - start
        mask, causal = None, False
        if q_len > 1 and start == 0 and q_len == seq_len and not window_cuts:
            causal = True  # SDPA's is_causal is top-left aligned: right only when queries == keys
        elif q_len > 1:
            mask = attention_mask(q_len, seq_len, start, sliding_window)
        prefill.append(_PrefillPart(slice(qsl[b], qsl[b + 1]), slots, mask, causal))
    views = []
    if len(decode) <= VIEW_DECODE_MAX_SEQS:
        for b in list(decode):
            start = kv_start(b)
            first_block, last_block = start // bs, (seq_lens[b] - 1) // bs
            runs = _block_runs(tables[b][first_block: last_block + 1], start - first_block * bs,
                               seq_lens[b] - start, bs)
            if len(runs) <= VIEW_MAX_RUNS:
                views.append(_DecodeView(qsl[b], runs))
                decode.remove(b)
    groups: list[_DecodeGroup] = []
    if decode:
        first_block = {b: kv_start(b) // bs for b in decode}
        blocks = {b: -(-seq_lens[b] // bs) - first_block[b] for b in decode}
        decode.sort(key=blocks.__getitem__)  # similar lengths share a call: little padding
        group: list[int] = []
        for b in decode + [None]:
            if group and (b is None or (len(group) + 1) * blocks[b] * bs * key_bytes > DECODE_BATCH_BYTES):
                width = max(blocks[g] for g in group)
                table = torch.tensor([tables[g][first_block[g]: first_block[g] + blocks[g]] + [0] * (width - blocks[g])
                                      for g in group], dtype=torch.long)
                pos = torch.tensor([first_block[g] * bs for g in group])[:, None] + torch.arange(width * bs)[None, :]
                lo = torch.tensor([kv_start(g) for g in group])[:, None]
                hi = torch.tensor([seq_lens[g] for g in group])[:, None]
                groups.append(_DecodeGroup(torch.tensor([qsl[g] for g in group]), table.flatten(), width,
                                           ((pos >= lo) & (pos < hi))[:, None, None, :]))
                group = []
            if b is not None:
                group.append(b)
    return _Plan(prefill, groups, views)


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata,
                        scale: float, sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, batch_decode: bool | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] in q's dtype, same contract as `paged_attention_reference`.

    `batch_decode` (default: the module's measured choice) runs decode sequences in groups, one SDPA
    call per group, instead of one call each. The plan (which keys each query sees, the groups, the
    masks) depends only on the metadata and the window, so it is built once per step and reused by
    every layer (the metadata object is the key).
    """
    dims = check_attention_inputs(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale)
    if q.device.type != "cpu":
        raise ValueError(f"paged_attention_cpu runs on CPU tensors, got q on {q.device}")
    meta.validate(dims.num_tokens, dims.num_blocks, dims.block_size)
    batch_decode = BATCH_DECODE if batch_decode is None else batch_decode
    key_bytes = dims.num_kv_heads * dims.head_dim * q.element_size()
    plan = _plan(meta, sliding_window, dims.block_size, key_bytes, batch_decode)
    if len(plan.views) == 1 and not plan.prefill and not plan.decode and dims.num_tokens == 1:
        return _attend_view(q, k_cache, v_cache, plan.views[0], scale, k_scale, v_scale)  # batch-1 decode
    out = torch.empty_like(q)
    for view in plan.views:
        out[view.row: view.row + 1] = _attend_view(q[view.row: view.row + 1], k_cache, v_cache, view, scale,
                                                   k_scale, v_scale)
    for part in plan.prefill:
        k = _gather(k_cache, part.slots, k_scale, q.dtype).unsqueeze(0)
        v = _gather(v_cache, part.slots, v_scale, q.dtype).unsqueeze(0)
        out[part.rows] = _attend(q[part.rows].unsqueeze(0), k, v, scale, part.mask, part.causal)[0]
    for group in plan.decode:
        n = group.rows.shape[0]
        k = _gather_blocks(k_cache, group.blocks, n, k_scale, q.dtype)
        v = _gather_blocks(v_cache, group.blocks, n, v_scale, q.dtype)
        out[group.rows] = _attend(q[group.rows].unsqueeze(1), k, v, scale, group.mask, False)[:, 0]
    return out


def _block_runs(blocks: list[int], offset: int, length: int, bs: int) -> tuple[tuple[int, int], ...]:
    """`length` keys starting `offset` keys into `blocks` (physical ids, in order) as runs of consecutive blocks:
    (first row of the flattened cache, keys) each."""
    runs: list[list[int]] = []
    for i, block in enumerate(blocks):
        lo = offset if i == 0 else 0
        hi = min(bs, offset + length - i * bs)
        if runs and block == runs[-1][2] + 1:
            runs[-1][1] += hi - lo
            runs[-1][2] = block
        else:
            runs.append([block * bs + lo, hi - lo, block])
    return tuple((first, keys) for first, keys, _ in runs)


def _attend_view(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, view: _DecodeView, scale: float,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> torch.Tensor:
    """One decode query [1, Hq, D] against its keys read in place from the cache (views, no copy for a cache in
    q's dtype). Several runs: each run's attention with its log-sum-exp, merged exactly (softmax over the union).

    The query's Hq heads are laid out as Hkv groups of G "query positions" ([1, Hkv, G, D]): one query token, so
    no mask is needed, and each KV head is read once for its group (GQA without repeating K/V)."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    grouped = q.reshape(kv_heads, heads // kv_heads, dim).unsqueeze(0)  # [1, Hkv, G, D]
    outs, lses = [], []
    for first, keys in view.runs:
        rows = slice(first, first + keys)
        k = _view_rows(k_cache, rows, k_scale, q.dtype)[0].transpose(0, 1).unsqueeze(0)  # [1, Hkv, keys, D]
        v = _view_rows(v_cache, rows, v_scale, q.dtype)[0].transpose(0, 1).unsqueeze(0)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(grouped, k, v, scale=scale)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0].reshape(1, heads, dim)
    lse = torch.stack(lses)  # [runs, 1, Hkv, G]
    weights = torch.softmax(lse, dim=0).unsqueeze(-1)  # each run's share of the union's softmax mass
    merged = (torch.stack(outs).float() * weights).sum(0)
    return merged.to(q.dtype).reshape(1, heads, dim)


def _view_rows(cache: torch.Tensor, rows: slice, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    part = _from_bytes(_bytes(_flat(cache))[rows], cache.dtype).unsqueeze(0)
    if scale is not None:
        return dequantize_kv(part, scale).to(dtype)
    return part if part.dtype == dtype else part.to(dtype)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, n: int, scale: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """n sequences' blocks (flattened [n * w]) -> [n, w * block_size, Hkv, D] in `dtype` (int8/fp8 dequantized)."""
    rows = _from_bytes(_bytes(cache).index_select(0, blocks), cache.dtype).view(n, -1, *cache.shape[2:])
    if scale is not None:
        return dequantize_kv(rows, scale).to(dtype)
    return rows.to(dtype)
