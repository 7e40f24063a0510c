"""The paged KV cache contract shared by every attention path, and its reference (the oracle).

Over 400 lines: the contract, its checks, quantized KV and the oracle: one spec every path is tested on.

Cache (one pair per layer)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]. Token slot `s` is block
    `s // block_size`, offset `s % block_size`. Any block size >= 1 works on every path (the Triton
    kernels address K/V per token through the block table); the engine uses 16.

Writing (`write_kv_*`)
    k, v: [T, num_kv_heads, head_dim] (the new tokens' keys/values after RoPE), slot_mapping int64 [T]:
    token t goes to slot slot_mapping[t]; a slot < 0 marks padding and writes nothing.

Reading (`paged_attention_*`)
    q: [T, num_heads, head_dim] (T = all queries of the batch, packed, no padding between sequences).
    A batch of B sequences is described by `PagedAttentionMetadata`:
      block_tables    int32 [B, max_blocks_per_seq]: the physical blocks of sequence b, in order
                      (entries past ceil(seq_lens[b] / block_size) are never read);
      seq_lens        int32 [B]: tokens of sequence b in the cache, INCLUDING this step's new ones
                      (written before attention runs);
      query_start_loc int32 [B + 1]: sequence b's queries are q[qsl[b]:qsl[b + 1]], its LAST
                      q_len_b = qsl[b + 1] - qsl[b] tokens; query j has position seq_lens[b] - q_len_b + j;
      max_query_len, max_seq_len: host ints, upper bounds of q_len_b and seq_lens[b] (kernels size
                      their grids from them without reading device memory).
    Decode is every q_len_b == 1; a chunked-prefill step has any q_len_b (0 = the sequence is idle).
    A query at position i attends to keys at positions j <= i with i - j < sliding_window (when set):
    the same rule as `engine.attention.causal_mask`. Softmax scale is `scale` (not 1/sqrt(D) implied).
    GQA: query head h reads kv head h // (num_heads // num_kv_heads).

Quantized KV
    A cache of dtype int8 (or float8_e4m3fn, GPU-only) has per-kv-head fp32 scales k_scale, v_scale
    [num_kv_heads]. Stored value: int8 = clamp(round_half_even(x / scale), -127, 127); fp8 =
    clamp(x / scale, -448, 448) cast to e4m3fn (the clamp keeps out-of-range values from becoming NaN).
    Read back: stored * scale (fp32). Float caches (fp32/fp16/bf16) take no scales and store x cast to
    the cache dtype.

The reference gathers each sequence's K/V to fp32 and computes an explicit masked softmax; it checks
everything (including the metadata's contents, which costs a device sync) and raises ValueError
naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokq.dtypes import FLOAT_DTYPES, dtype_name, kv_dtype_of

FP8_E4M3_MAX = 448.0
INT8_KV_MAX = 127.0
QUANT_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)
KV_DTYPES = FLOAT_DTYPES + QUANT_KV_DTYPES


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Where each sequence of a batch lives in the paged cache and which of its tokens are queries.

    Layouts as in the module docstring. `max_query_len` / `max_seq_len` are host-side bounds: kernels
    size grids and pick decode vs prefill from them, so they must not be smaller than the real maxima
    (`validate` checks; larger only wastes programs), and max_seq_len must fit the block table
    (max_blocks_per_seq * block_size; every path checks that without a sync). GPU kernels trust the
    tensors' contents; `validate` (a device sync) checks them and the reference and CPU path run it.
    """

    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    max_query_len: int
    max_seq_len: int
    # Set by a caller that built the tensors itself and validated them once (the engine, once per step
    # rather than once per layer): `validate` then checks only shapes.
    trusted: bool = False

    @classmethod
    def from_lists(cls, block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int],
                   query_lens: Sequence[int], device: torch.device | str = "cpu") -> PagedAttentionMetadata:
        """Build from host lists; block tables are right-padded with block 0 (never read)."""
        if not (len(block_tables) == len(seq_lens) == len(query_lens)):
            raise ValueError(f"block_tables, seq_lens and query_lens must have one entry per sequence, got "
                             f"{len(block_tables)}, {len(seq_lens)}, {len(query_lens)}")
        width = max([len(t) for t in block_tables] + [1])
        table = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for b, row in enumerate(block_tables):
            table[b, : len(row)] = torch.tensor(list(row), dtype=torch.int32)
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(list(query_lens), dtype=torch.int64).cumsum(0).to(torch.int32)
        return cls(table.to(device), torch.tensor(list(seq_lens), dtype=torch.int32, device=device), qsl.to(device),
                   max(query_lens, default=0), max(seq_lens, default=0))

    @classmethod
    def from_tensors(cls, block_tables: torch.Tensor, seq_lens: Sequence[int],
                     query_lens: Sequence[int]) -> PagedAttentionMetadata:
        """Build from an already padded int32 block table [B, width] (kept as is) and host lists."""
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(list(query_lens), dtype=torch.int64).cumsum(0).to(torch.int32)
        return cls(block_tables, torch.tensor(list(seq_lens), dtype=torch.int32), qsl,
                   max(query_lens, default=0), max(seq_lens, default=0))

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_query_len <= 1

    def to(self, device: torch.device | str) -> PagedAttentionMetadata:
        return PagedAttentionMetadata(self.block_tables.to(device), self.seq_lens.to(device),
                                      self.query_start_loc.to(device), self.max_query_len, self.max_seq_len,
                                      self.trusted)

    def check_shapes(self) -> None:
        """Shape/dtype checks that read no device memory (every path runs these)."""
        for name, t, dims in (("block_tables", self.block_tables, 2), ("seq_lens", self.seq_lens, 1),
                              ("query_start_loc", self.query_start_loc, 1)):
            if t.dim() != dims or t.dtype != torch.int32:
                raise ValueError(f"metadata {name} must be a {dims}-D int32 tensor, got {t.dim()}-D "
                                 f"{dtype_name(t.dtype)} {tuple(t.shape)}")
        b = self.seq_lens.shape[0]
        if self.block_tables.shape[0] != b or self.query_start_loc.shape[0] != b + 1:
            raise ValueError(f"metadata for {b} sequences needs block_tables [{b}, max_blocks] and query_start_loc "
                             f"[{b + 1}], got {tuple(self.block_tables.shape)} and {tuple(self.query_start_loc.shape)}")
        if self.max_query_len < 0 or self.max_seq_len < self.max_query_len:
            raise ValueError(f"metadata max_query_len={self.max_query_len} must be >= 0 and <= max_seq_len="
                             f"{self.max_seq_len}")

    def validate(self, num_tokens: int, num_blocks: int, block_size: int) -> None:
        """Every check, including the tensors' contents (a device sync): the reference and CPU path run it."""
        self.check_shapes()
        if self.trusted:
            return
        seq_lens = self.seq_lens.cpu().long()
        qsl = self.query_start_loc.cpu().long()
        q_lens = qsl[1:] - qsl[:-1]
        if qsl[0] != 0 or (q_lens < 0).any() or qsl[-1] != num_tokens:
            raise ValueError(f"query_start_loc must rise from 0 to the number of queries ({num_tokens}), got "
                             f"{qsl.tolist()}")
        bad = (q_lens > seq_lens).nonzero().flatten()
        if len(bad):
            b = bad[0].item()
            raise ValueError(f"sequence {b} has {q_lens[b].item()} queries but seq_len {seq_lens[b].item()}: the queries "
                             f"are the last tokens of the sequence, already written to the cache")
        if len(q_lens) and (q_lens.max() > self.max_query_len or seq_lens.max() > self.max_seq_len):
            raise ValueError(f"metadata max_query_len={self.max_query_len} / max_seq_len={self.max_seq_len} are below "
                             f"the real maxima {q_lens.max().item()} / {seq_lens.max().item()}")
        need = (seq_lens + block_size - 1) // block_size
        width = self.block_tables.shape[1]
        short = (need > width).nonzero().flatten()
        if len(short):
            b = short[0].item()
            raise ValueError(f"block table too short: sequence {b} has seq_len {seq_lens[b].item()}, which needs "
                             f"{need[b].item()} blocks of {block_size}, but block_tables has {width} columns")
        table = self.block_tables.cpu()
        used = torch.arange(width).unsqueeze(0) < need.unsqueeze(1)
        ids = table[used]
        if len(ids) and (ids.min() < 0 or ids.max() >= num_blocks):
            raise ValueError(f"block_tables names block {ids.min().item() if ids.min() < 0 else ids.max().item()}, "
                             f"outside the cache's {num_blocks} blocks")


@dataclass(frozen=True)
class PagedDims:
    """The sizes of one attention call, read off the tensors' shapes."""

    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None, kv_dtypes: Sequence[torch.dtype]) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in kv_dtypes:
        raise ValueError(f"KV cache dtype {dtype_name(k_cache.dtype)}/{dtype_name(v_cache.dtype)} is not supported "
                         f"here ({', '.join(dtype_name(d) for d in kv_dtypes)}, the same for k and v)")
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache is on {k_cache.device} but v_cache on {v_cache.device}")
    heads = k_cache.shape[2]
    if k_cache.dtype in QUANT_KV_DTYPES:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or s.shape != (heads,) or s.dtype != torch.float32:
                got = "None" if s is None else f"{dtype_name(s.dtype)} {tuple(s.shape)}"
                raise ValueError(f"a {dtype_name(k_cache.dtype)} KV cache needs {name} as fp32 [{heads}] (one scale per "
                                 f"kv head), got {got}")
            if s.device != k_cache.device:
                raise ValueError(f"{name} is on {s.device} but the cache on {k_cache.device}")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale/v_scale were given for a {dtype_name(k_cache.dtype)} KV cache, which stores "
                         f"values unscaled (scales go with int8/fp8 caches)")


def check_write_inputs(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None, kv_dtypes: Sequence[torch.dtype] = KV_DTYPES) -> None:
    """Shape/dtype checks of a KV write (no device sync)."""
    _check_cache(k_cache, v_cache, k_scale, v_scale, kv_dtypes)
    _, _, heads, dim = k_cache.shape
    if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != (heads, dim):
        raise ValueError(f"k and v must both be [T, {heads}, {dim}] to match the cache, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.dtype not in FLOAT_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"k/v must be fp32, fp16 or bf16 (the same for both), got {dtype_name(k.dtype)}/"
                         f"{dtype_name(v.dtype)}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}] (one slot per token), got "
                         f"{dtype_name(slot_mapping.dtype)} {tuple(slot_mapping.shape)}")
    if not (k.device == v.device == slot_mapping.device == k_cache.device):
        raise ValueError(f"k, v, slot_mapping and the cache must share a device, got {k.device}, {v.device}, "
                         f"{slot_mapping.device}, {k_cache.device}")


def check_slots(slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Every slot is padding (< 0) or inside the cache (a device sync)."""
    capacity = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.numel() and slot_mapping.max().item() >= capacity:
        raise ValueError(f"slot {slot_mapping.max().item()} is outside the cache ({k_cache.shape[0]} blocks of "
                         f"{k_cache.shape[1]} = {capacity} slots)")


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedAttentionMetadata, scale: float, sliding_window: int | None,
                           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                           kv_dtypes: Sequence[torch.dtype] = KV_DTYPES) -> PagedDims:
    """Shape/dtype checks of an attention call (no device sync); returns its sizes."""
    _check_cache(k_cache, v_cache, k_scale, v_scale, kv_dtypes)
    meta.check_shapes()
    num_blocks, block_size, kv_heads, dim = k_cache.shape
    if q.dim() != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got {tuple(q.shape)}")
    tokens, heads, q_dim = q.shape
    if q_dim != dim:
        raise ValueError(f"head dims do not match: q has {q_dim}, the KV cache {dim}")
    if heads % kv_heads:
        raise ValueError(f"num_heads {heads} is not a multiple of num_kv_heads {kv_heads} (GQA needs whole groups)")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be fp32, fp16 or bf16, got {dtype_name(q.dtype)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if not scale > 0:
        raise ValueError(f"softmax scale must be > 0, got {scale}")
    devices = {t.device for t in (q, k_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)}
    if len(devices) > 1:
        raise ValueError(f"q, the KV cache and the metadata must share a device, got {sorted(map(str, devices))}")
    if meta.max_seq_len > meta.block_tables.shape[1] * block_size:
        raise ValueError(f"block table too short: max_seq_len {meta.max_seq_len} needs "
                         f"{-(-meta.max_seq_len // block_size)} blocks of {block_size}, block_tables has "
                         f"{meta.block_tables.shape[1]} columns")
    return PagedDims(tokens, heads, kv_heads, dim, num_blocks, block_size)


# Quantized KV ---------------------------------------------------------------------------------------------

def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x [..., Hkv, D] -> what the cache stores (module docstring); scale fp32 [Hkv] for int8/fp8."""
    if dtype not in QUANT_KV_DTYPES:
        return x.to(dtype)
    y = x.float() / scale.unsqueeze(-1)
    if dtype == torch.int8:
        return torch.round(y).clamp(-INT8_KV_MAX, INT8_KV_MAX).to(torch.int8)
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored cache values [..., Hkv, D] -> fp32 (times the per-head scale for int8/fp8)."""
    out = stored.float()
    return out if stored.dtype not in QUANT_KV_DTYPES else out * scale.unsqueeze(-1)


def kv_scales(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-kv-head scales covering x [..., Hkv, D] without clipping: amax / qmax (fp32 [Hkv])."""
    qmax = INT8_KV_MAX if dtype == torch.int8 else FP8_E4M3_MAX
    return (x.float().abs().amax(dim=tuple(range(x.dim() - 2)) + (-1,)) / qmax).clamp_min(1e-8)


# Reference -------------------------------------------------------------------------------------------------

def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> None:
    """Write k/v [T, Hkv, D] into the caches at slot_mapping (in place; slots < 0 are skipped)."""
    check_write_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_slots(slot_mapping, k_cache)
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = quantize_kv(k[t], k_scale, k_cache.dtype)
        v_cache[slot // block_size, slot % block_size] = quantize_kv(v[t], v_scale, v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Tokens [start, stop) of one sequence from its block table row -> [stop - start, Hkv, D] (cache dtype)."""
    block_size = cache.shape[1]
    first, last = start // block_size, -(-stop // block_size)
    blocks = cache.index_select(0, block_table[first:last].long())
    flat = blocks.reshape(-1, *cache.shape[2:])
    return flat[start - first * block_size: stop - first * block_size]


def attention_mask(q_len: int, seq_len: int, kv_start: int, window: int | None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [q_len, seq_len - kv_start] (True = attend): queries are the last q_len of seq_len
    positions, keys are positions kv_start..seq_len-1 (same rule as engine.attention.causal_mask)."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_start, seq_len, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    return allowed


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: PagedAttentionMetadata, scale: float, sliding_window: int | None = None,
                              k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: per sequence, gather all its K/V to fp32 and apply an explicit masked softmax.

    q [T, Hq, D] -> [T, Hq, D] in q's dtype (layouts and masking rule in the module docstring).
    """
    dims = check_attention_inputs(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale)
    meta.validate(dims.num_tokens, dims.num_blocks, dims.block_size)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for b, seq_len in enumerate(seq_lens):
        start, stop = qsl[b], qsl[b + 1]
        if stop == start:
            continue
        table = meta.block_tables[b]
        k = dequantize_kv(gather_kv(k_cache, table, 0, seq_len), k_scale).repeat_interleave(dims.group, dim=1)
        v = dequantize_kv(gather_kv(v_cache, table, 0, seq_len), v_scale).repeat_interleave(dims.group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:stop].float(), k) * scale
        mask = attention_mask(stop - start, seq_len, 0, sliding_window, q.device)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out[start:stop] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(q.dtype)


# Layouts for tests and benchmarks ------------------------------------------------------------------------

@dataclass(frozen=True)
class PagedLayout:
    """A batch placed in a cache: its metadata, the slot of every token of every sequence, and (when
    asked for) a cache of that size filled with random K/V."""

    meta: PagedAttentionMetadata
    num_blocks: int
    block_size: int
    seq_slots: list[torch.Tensor]  # int64 [seq_len_b] per sequence: positions 0.. -> slots
    new_slot_mapping: torch.Tensor  # int64 [T]: the slots of the query tokens (this step's new tokens), packed
    k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None  # fp32 [Hkv] for int8/fp8 caches
    v_scale: torch.Tensor | None = None


def random_paged_layout(seq_lens: Sequence[int], query_lens: Sequence[int], block_size: int = 16, *,
                        num_kv_heads: int | None = None, head_dim: int | None = None,
                        dtype: torch.dtype = torch.float32, kv_dtype: str | torch.dtype | None = None,
                        device: torch.device | str = "cpu", generator: torch.Generator | None = None,
                        seed: int = 0, spare_blocks: int = 3, extra_table_columns: int = 1) -> PagedLayout:
    """Give each sequence the blocks it needs, drawn from a random permutation of the cache's blocks
    (so neighbouring positions are not neighbouring blocks), with `spare_blocks` never used and
    `extra_table_columns` padding columns in the block table.

    With num_kv_heads and head_dim, also allocate the caches and fill every slot with N(0, 1) K/V
    stored as `kv_dtype` (default: `dtype`; int8/fp8 get per-head scales covering the data). Randomness
    comes from `generator` (a CPU generator) or else `seed`; the K/V are drawn on `device`.
    """
    if len(seq_lens) != len(query_lens) or any(q > s for q, s in zip(query_lens, seq_lens, strict=True)):
        raise ValueError(f"need one query_len <= seq_len per sequence, got seq_lens {list(seq_lens)} and "
                         f"query_lens {list(query_lens)}")
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used: used + n])
        used += n
    width = max(need, default=0) + extra_table_columns
    padded = [t + [0] * (width - len(t)) for t in tables]
    meta = PagedAttentionMetadata.from_lists(padded, seq_lens, query_lens, device)
    seq_slots = []
    for table, s in zip(tables, seq_lens, strict=True):
        pos = torch.arange(s)
        seq_slots.append(torch.tensor(table, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
                         if s else torch.zeros(0, dtype=torch.int64))
    new = [slots[len(slots) - q:] for slots, q in zip(seq_slots, query_lens, strict=True)]
    new_slots = torch.cat(new) if new else torch.zeros(0, dtype=torch.int64)
    caches: dict[str, torch.Tensor | None] = {}
    if num_kv_heads is not None and head_dim is not None:
        stored = kv_dtype_of(kv_dtype) if kv_dtype is not None else dtype
        device_gen = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=g)))
        for name in ("k", "v"):
            x = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=device_gen, device=device)
            scale = kv_scales(x, stored) if stored in QUANT_KV_DTYPES else None
            caches[f"{name}_cache"], caches[f"{name}_scale"] = quantize_kv(x, scale, stored), scale
            del x
    return PagedLayout(meta, num_blocks, block_size, [s.to(device) for s in seq_slots], new_slots.to(device),
                       **caches)
