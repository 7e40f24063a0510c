"""Paged attention in Triton: KV write, decode (flash-decoding split + merge) and chunked prefill.

Over 400 lines: its four kernels share the cache addressing, quantized-KV handling and launch policy.

Contract and layouts: kernels/paged.py (k_cache/v_cache [num_blocks, block_size, Hkv, D], block
tables, seq_lens, query_start_loc, slot_mapping, int8/fp8 KV with per-kv-head fp32 scales).

Kernels (all softmax statistics and accumulators in fp32; exp2 with the scale folded into log2 units):
- `_write_kv_kernel`: one program per token, tile [Hkv_pad, D_pad]; converts to the cache dtype or
  quantizes (int8: IEEE division by the head's scale, round half to even, clamp +-127 -- bit-equal to
  the reference; fp8: clamp +-448, cast). Padding slots (< 0) store nothing.
- `_decode_kernel`: one program per (sequence, kv head, split). It loads the q rows of the kv head's
  whole query-head group [GROUP_PAD >= 16, D_pad] (padded rows are zeros, never stored) so each K/V
  tile is read once per group and feeds `tl.dot`. Tiles of BLOCK_N tokens are addressed per token
  through the block table (page = table[pos // block_size], row = pos % block_size), so BLOCK_N and
  block_size are independent and any block size works. With a sliding window the loop starts at the
  window's first position (blocks before it are never read). With num_splits > 1, split s covers
  context positions [lo + s * split_size, lo + (s + 1) * split_size) and writes its normalized
  partial output and log2-sum-exp; `_merge_kernel` (one program per (sequence, q head)) combines
  them: out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max).
- `_prefill_kernel`: one program per (sequence, block of BLOCK_M queries, q head). Query j of a
  sequence has position seq_len - q_len + j; the program reads keys [window start of its first
  query, position of its last query] from the cache (the prefix and the chunk itself, written
  before) and masks by position: causal, window, and the ragged edges.

K/V tiles are cast to q's dtype for `tl.dot` (a float cache may have another dtype than q: fp16
into fp32 q is exact, fp32 into fp16 q rounds). int8 and fp8 values convert exactly to fp16/bf16, and
their per-head scales are folded in outside the dot (k_scale into the softmax scale, v_scale into the
final accumulator). fp32 q uses `input_precision="ieee"` (no TF32), so fp32 results
match the fp32 reference to rounding. Head dims are padded to a power of two >= 16 with masks (64,
80, 96, 128, 192, 256, ...; at most 256).

Under the interpreter (`TRITON_INTERPRET=1`, tests) the kernels run with one fixed small config; on
GPUs `triton.autotune` picks tile sizes per (head dim, group, dtypes, context or query-length bucket),
unless `TOKQ_TRITON_AUTOTUNE=0` asks for one fixed config (GPU tests: no tuning time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..paged import (
    FP8_E4M3_MAX,
    INT8_KV_MAX,
    KV_DTYPES,
    PagedAttentionMetadata,
    check_attention_inputs,
    check_slots,
    check_write_inputs,
)
from . import autotune_enabled, interpreting

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
MIN_TILE = 16  # tl.dot needs every dimension >= 16
MAX_SPLITS = 32
NO_WINDOW = 1 << 30  # the window passed when there is none: no branch in the kernels, no int32 overflow
MIN_SPLIT_TOKENS = 256  # below this much context per split, a split's launch/merge costs more than it saves
_QUANT = {torch.int8: 1, torch.float8_e4m3fn: 2}  # QUANT constexpr: 0 = float cache


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


# KV write ------------------------------------------------------------------------------------------------

@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _store_kv(src_ptr, stride_t, stride_h, cache_ptr, scale_ptr, t, dst, heads, dims, mask,
              QUANT: tl.constexpr, QMAX: tl.constexpr):
    x = tl.load(src_ptr + t * stride_t + heads * stride_h + dims, mask=mask, other=0.0)
    if QUANT == 0:
        y = x.to(cache_ptr.dtype.element_ty)
    else:
        scale = tl.load(scale_ptr + heads + 0 * dims, mask=mask, other=1.0)
        y = tl.math.div_rn(x.to(tl.float32), scale)  # IEEE division: the same codes as the torch reference
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if QUANT == 1:
            y = _round_half_even(y)
        y = y.to(cache_ptr.dtype.element_ty)
    tl.store(cache_ptr + dst, y, mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_co, stride_ch, block_size,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                     QUANT: tl.constexpr, QMAX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    heads = tl.arange(0, H_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    # Masks are built from block-shaped comparisons only: the interpreter rejects masks broadcast from a scalar.
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & ((slot + 0 * heads) >= 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + heads * stride_ch + dims
    _store_kv(k_ptr, stride_kt, stride_kh, k_cache_ptr, k_scale_ptr, t, dst, heads, dims, mask, QUANT, QMAX)
    _store_kv(v_ptr, stride_vt, stride_vh, v_cache_ptr, v_scale_ptr, t, dst, heads, dims, mask, QUANT, QMAX)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, validate: bool = False) -> None:
    """Write k/v [T, Hkv, D] into the caches at slot_mapping (in place; slots < 0 are skipped).

    `validate=True` also checks that every slot is inside the cache (a device sync).
    """
    check_write_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _check_cache_layout(k_cache, v_cache)
    if validate:
        check_slots(slot_mapping, k_cache)
    k, v = _inner_contiguous(k), _inner_contiguous(v)
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    quant = _QUANT.get(k_cache.dtype, 0)
    qmax = INT8_KV_MAX if quant == 1 else FP8_E4M3_MAX
    dummy = k_cache  # float caches take no scales; the pointer is never read
    _write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping, dummy if k_scale is None else k_scale,
        dummy if v_scale is None else v_scale, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
        NUM_KV_HEADS=heads, HEAD_DIM=dim, H_PAD=_pow2(heads), D_PAD=_pow2(dim), QUANT=quant, QMAX=qmax)


# Shared tile loaders ------------------------------------------------------------------------------------

@triton.jit
def _kv_tile_offsets(block_table_ptr, pos, valid, BLOCK_SIZE: tl.constexpr, stride_cb, stride_co, head_offset):
    """Cache offsets [BLOCK_N] of positions `pos` of one sequence (page via its block table row).
    BLOCK_SIZE is a compile-time constant so // and % become shifts for powers of two."""
    page = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return page * stride_cb + (pos % BLOCK_SIZE) * stride_co + head_offset


# Decode ---------------------------------------------------------------------------------------------------

@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   block_tables_ptr, seq_lens_ptr, query_start_ptr, k_scale_ptr, v_scale_ptr,
                   scale_log2, window, split_size, context_bucket,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_co, stride_ch,
                   num_splits,
                   BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   QUANT: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_row  # decode: 0 (idle) or 1
    active = q_len > 0
    seq_len = tl.load(seq_lens_ptr + seq)
    # The query at position seq_len - 1 sees the last `window` keys (window = NO_WINDOW when there is none).
    lo = tl.maximum(seq_len - window, 0)
    split_lo = lo + split * split_size
    split_hi = tl.minimum(split_lo + split_size, seq_len)
    split_hi = tl.where(active, split_hi, split_lo)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    row_ok = (g < GROUP) & ((q_len + 0 * g) > 0)  # block-shaped: the interpreter rejects scalar-broadcast masks
    d_ok = d < HEAD_DIM
    q_off = q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    qk_scale = scale_log2
    if QUANT != 0:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for start in range(split_lo, split_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < split_hi
        off = _kv_tile_offsets(table, pos, valid, BLOCK_SIZE, stride_cb, stride_co, kv_head * stride_ch)
        kv_mask = valid[:, None] & d_ok[None, :]
        k_t = tl.load(k_cache_ptr + off[None, :] + d[:, None], mask=valid[None, :] & d_ok[:, None],
                      other=0.0).to(q.dtype)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile has >= 1 valid key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    if QUANT != 0:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    if SPLIT:
        # Partial results [T, Hq, num_splits, D_PAD] and log2-sum-exp [T, Hq, num_splits]; empty splits: -inf.
        part = (q_row.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * D_PAD + d[None, :], out,
                 mask=row_ok[:, None] & (d[None, :] < D_PAD))
        lse = tl.where(denom > 0, m + tl.log2(tl.where(denom > 0, denom, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
    else:
        o_off = q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, query_start_ptr, stride_ot, stride_oh, num_splits,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_row
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = (s < num_splits) & ((q_len + 0 * s) > 0)
    part = (q_row.to(tl.int64) * NUM_HEADS + head) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)  # finite for an active sequence: split 0 always holds keys
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    o = tl.load(part_out_ptr + part[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    merged = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    o_off = q_row.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(out_ptr + o_off, merged.to(out_ptr.dtype.element_ty), mask=(d < HEAD_DIM) & ((q_len + 0 * d) > 0))


# Prefill (chunks of any length) ------------------------------------------------------------------------

@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
                    k_scale_ptr, v_scale_ptr, scale_log2, window, query_bucket,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_co, stride_ch,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first = q_block * BLOCK_M
    j = first + tl.arange(0, BLOCK_M)
    row_ok = j < q_len
    q_pos = seq_len - q_len + j
    # Keys this block of queries can see: [window start of its first query, its last query's position].
    hi = seq_len - q_len + tl.minimum(first + BLOCK_M, q_len)
    lo = tl.maximum(seq_len - q_len + first - window + 1, 0)
    hi = tl.where(first < q_len, hi, lo)

    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_off = (q_start + j).to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qk_scale = scale_log2
    if QUANT != 0:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        off = _kv_tile_offsets(table, pos, valid, BLOCK_SIZE, stride_cb, stride_co, kv_head * stride_ch)
        kv_mask = valid[:, None] & d_ok[None, :]
        k_t = tl.load(k_cache_ptr + off[None, :] + d[:, None], mask=valid[None, :] & d_ok[:, None],
                      other=0.0).to(q.dtype)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        allowed = allowed & ((q_pos[:, None] - pos[None, :]) < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see no key in this tile yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    if QUANT != 0:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    o_off = (q_start + j).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# Tile configs: one fixed small config under the interpreter, autotuned on GPUs -------------------------

def _prune(configs, named_args, **kwargs):
    """Drop tiles whose K/V stages would not fit in shared memory (~228 KB on Hopper, kept with margin)
    and query tiles too large for registers."""
    args = {**named_args, **kwargs}
    d_pad = args.get("D_PAD", MAX_HEAD_DIM)
    item = max(args["q_ptr"].element_size(), 2)  # tiles are cast to q's dtype after loading
    kept = [c for c in configs if 2 * c.kwargs["BLOCK_N"] * d_pad * item * max(c.num_stages, 1) <= 160 * 1024
            and c.kwargs.get("BLOCK_M", 16) * d_pad <= 64 * 256]  # q tile + fp32 accumulator stay in registers
    return kept or configs[:1]


# (BLOCK_N, warps, stages) and (BLOCK_M, BLOCK_N, warps, stages): a short list, so a new shape bucket
# costs seconds of tuning, not minutes.
_DECODE_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in (
    (16, 4, 2), (32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3))]
_PREFILL_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in (
    (16, 32, 4, 2), (32, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 3))]
# Fixed tiles: the interpreter's (small: it is slow) and the GPU's when autotuning is off.
_INTERPRETER_DECODE = {"BLOCK_N": 16}
_INTERPRETER_PREFILL = {"BLOCK_M": 16, "BLOCK_N": 16}
_FIXED_DECODE = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
_FIXED_PREFILL = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def _fixed_tiles(decode: bool) -> dict | None:
    """The fixed tile config to launch with, or None to autotune (GPU, unless TOKQ_TRITON_AUTOTUNE=0:
    tests and quick checks skip the tuning's compile time; results are the same, only speed differs)."""
    if interpreting():
        return _INTERPRETER_DECODE if decode else _INTERPRETER_PREFILL
    if not autotune_enabled():
        return _FIXED_DECODE if decode else _FIXED_PREFILL
    return None


_decode_tuned = triton.autotune(_DECODE_CONFIGS, key=["HEAD_DIM", "GROUP_PAD", "QUANT", "context_bucket"],
                                prune_configs_by={"early_config_prune": _prune})(_decode_kernel)
_prefill_tuned = triton.autotune(_PREFILL_CONFIGS, key=["HEAD_DIM", "GROUP", "QUANT", "query_bucket"],
                                 prune_configs_by={"early_config_prune": _prune})(_prefill_kernel)


# Host side ------------------------------------------------------------------------------------------------

def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"k_cache and v_cache need the same strides with a contiguous head dim, got "
                         f"{k_cache.stride()} and {v_cache.stride()}")
    if k_cache.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {k_cache.shape[-1]} is not supported by the Triton kernels "
                         f"(at most {MAX_HEAD_DIM})")


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a token value, so tests see the same policy at small sizes


def decode_splits(num_seqs: int, num_kv_heads: int, context: int, device: torch.device) -> int:
    """How many context splits a decode step uses: enough programs for about two waves on the GPU,
    each split holding at least MIN_SPLIT_TOKENS keys, at most MAX_SPLITS."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-2 * _multiprocessors(device) // programs)
    return max(1, min(wanted, context // MIN_SPLIT_TOKENS, MAX_SPLITS))


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata,
                        scale: float, sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Decode step (every q_len is 0 or 1): q [T, Hq, D] -> [T, Hq, D] in q's dtype.

    `num_splits` (default: `decode_splits`) splits each sequence's context for flash-decoding.
    """
    dims = check_attention_inputs(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, KV_DTYPES)
    _check_cache_layout(k_cache, v_cache)
    if meta.max_query_len > 1:
        raise ValueError(f"the decode kernel takes one query per sequence, max_query_len is {meta.max_query_len}; "
                         f"use paged_attention_triton")
    q = _inner_contiguous(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if dims.num_tokens == 0 or meta.num_seqs == 0:
        return out
    context = max(1, min(meta.max_seq_len, sliding_window or meta.max_seq_len))
    splits = num_splits or decode_splits(meta.num_seqs, dims.num_kv_heads, context, q.device)
    split_size = -(-context // max(1, splits))
    split_size = -(-split_size // MIN_TILE) * MIN_TILE
    splits = -(-context // split_size)
    group_pad = _pow2(dims.group, MIN_TILE)
    d_pad = _pow2(dims.head_dim, MIN_TILE)
    if splits > 1:
        part_out = torch.empty(dims.num_tokens, dims.num_heads, splits, d_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(dims.num_tokens, dims.num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # never touched
    quant = _QUANT.get(k_cache.dtype, 0)
    args = (q, k_cache, v_cache, out, part_out, part_lse, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            k_cache if k_scale is None else k_scale, k_cache if v_scale is None else v_scale,
            scale * LOG2E, min(sliding_window or NO_WINDOW, NO_WINDOW), split_size, _pow2(split_size),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), splits)
    consts = dict(BLOCK_SIZE=dims.block_size, NUM_HEADS=dims.num_heads, GROUP=dims.group, GROUP_PAD=group_pad,
                  HEAD_DIM=dims.head_dim, D_PAD=d_pad, QUANT=quant, SPLIT=splits > 1,
                  DOT_PRECISION=_dot_precision(q.dtype))
    grid = (meta.num_seqs, dims.num_kv_heads, splits)
    fixed = _fixed_tiles(decode=True)
    if fixed is not None:
        _decode_kernel[grid](*args, **consts, **fixed)
    else:
        _decode_tuned[grid](*args, **consts)
    if splits > 1:
        _merge_kernel[(meta.num_seqs, dims.num_heads)](
            part_out, part_lse, out, meta.query_start_loc, out.stride(0), out.stride(1), splits,
            NUM_HEADS=dims.num_heads, HEAD_DIM=dims.head_dim, D_PAD=d_pad, S_PAD=_pow2(splits))
    return out


def paged_prefill_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: PagedAttentionMetadata, scale: float, sliding_window: int | None = None,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Chunked prefill (any q_len per sequence): q [T, Hq, D] -> [T, Hq, D] in q's dtype."""
    dims = check_attention_inputs(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, KV_DTYPES)
    _check_cache_layout(k_cache, v_cache)
    q = _inner_contiguous(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if dims.num_tokens == 0 or meta.num_seqs == 0 or meta.max_query_len == 0:
        return out
    quant = _QUANT.get(k_cache.dtype, 0)
    args = (q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            k_cache if k_scale is None else k_scale, k_cache if v_scale is None else v_scale,
            scale * LOG2E, min(sliding_window or NO_WINDOW, NO_WINDOW), _pow2(meta.max_query_len),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    consts = dict(BLOCK_SIZE=dims.block_size, GROUP=dims.group, HEAD_DIM=dims.head_dim,
                  D_PAD=_pow2(dims.head_dim, MIN_TILE), QUANT=quant, DOT_PRECISION=_dot_precision(q.dtype))

    def grid(cfg):
        return (meta.num_seqs, triton.cdiv(meta.max_query_len, cfg["BLOCK_M"]), dims.num_heads)

    fixed = _fixed_tiles(decode=False)
    if fixed is not None:
        _prefill_kernel[grid(fixed)](*args, **consts, **fixed)
    else:
        _prefill_tuned[grid](*args, **consts)
    return out


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedAttentionMetadata, scale: float, sliding_window: int | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Paged attention, same contract as `paged_attention_reference`: the decode kernel when every
    sequence has at most one query (meta.max_query_len <= 1, read on the host), else the prefill kernel.

    Shapes, dtypes and devices are checked on the host; the metadata's contents are trusted (no device
    sync): call `meta.validate(...)` when they may be wrong.
    """
    if meta.is_decode:
        return paged_decode_triton(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, num_splits)
    return paged_prefill_triton(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32: no TF32 rounding; ignored for 16-bit inputs

