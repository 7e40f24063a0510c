"""Paged attention on CPU with every decode query of a step in one gather + one SDPA call per group.

`paged_attention_cpu_batched` has the contract of `paged_attention_reference` (kernels/paged.py) and
shares the KV write and the prefill path with `paged_attention_cpu` (cpu/attention.py). It differs in
how a step's decode queries (q_len == 1) are planned and run:

- the plan is computed from the metadata tensors (no Python loop over sequences or tokens): the
  decode rows, their first visible block (sliding window), their block counts, one padded block
  table per group (an advanced index into `block_tables`) and the validity mask (positions in
  [window start, seq_len));
- each group's K and V are gathered with one `index_select` of whole blocks (rows of the
  [num_blocks, block_size * Hkv * D] view) into buffers owned by the plan, so the 30-odd layers of a
  step reuse the same memory instead of allocating (and page-faulting) fresh buffers per layer;
- one `scaled_dot_product_attention(..., enable_gqa=True)` per group with an additive float mask.

Groups: sequences sorted by block count, split while the group's gathered K stays under
`DECODE_BATCH_BYTES` (cpu/attention.py measured the cap); a step of 16 SmolLM2 sequences of ~300
tokens is one group. benchmarks/continuous_batching.py measures this kernel against
`cpu_paged_sdpa` in the same run.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ..paged import PagedAttentionMetadata, attention_mask, check_attention_inputs, dequantize_kv
from . import attention as base


@dataclass
class _Group:
    rows: torch.Tensor  # int64 [n]: the sequences' query rows in q
    blocks: torch.Tensor  # int64 [n * width]: blocks to gather (padding: block 0, masked out)
    width: int
    mask: torch.Tensor  # fp32 [n, 1, 1, width * block_size]: 0 where visible, -inf elsewhere
    buffers: dict = field(default_factory=dict)  # (dtype, row bytes) -> (k, v) gather buffers
    masks: dict = field(default_factory=dict)  # query dtype -> the mask in it

    def mask_in(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.masks:
            self.masks[dtype] = self.mask.to(dtype)
        return self.masks[dtype]


@dataclass
class _Plan:
    prefill: list[base._PrefillPart]
    decode: list[_Group]


_plan_cache: dict = {"meta": None, "plans": {}}


def _plan(meta: PagedAttentionMetadata, window: int | None, bs: int, key_bytes: int) -> _Plan:
    """The plan for this metadata (one per engine step; every layer reuses it)."""
    cached = _plan_cache["meta"]
    if cached is None or cached() is not meta:
        _plan_cache["meta"], _plan_cache["plans"] = weakref.ref(meta), {}
    key = (window, bs, key_bytes)
    plan = _plan_cache["plans"].get(key)
    if plan is None:
        plan = _plan_cache["plans"][key] = _make_plan(meta, window, bs, key_bytes)
    return plan


def _make_plan(meta: PagedAttentionMetadata, window: int | None, bs: int, key_bytes: int) -> _Plan:
    qsl = meta.query_start_loc.long()
    seq_lens = meta.seq_lens.long()
    q_lens = qsl[1:] - qsl[:-1]
    # Prefill chunks (q_len > 1) take the shared per-sequence path: few per step, each one big call.
    prefill = [_prefill_part(meta, b, qsl, seq_lens, window, bs) for b in (q_lens > 1).nonzero().flatten().tolist()]
    decode = (q_lens == 1).nonzero().flatten()
    if not len(decode):
        return _Plan(prefill, [])
    lens = seq_lens[decode]
    lo = torch.zeros_like(lens) if window is None else (lens - window).clamp_min(0)  # first visible key
    first = lo // bs
    nblocks = (lens + bs - 1) // bs - first
    order = torch.argsort(nblocks, stable=True)  # similar lengths share a group: little padding
    decode, lens, lo, first, nblocks = decode[order], lens[order], lo[order], first[order], nblocks[order]
    groups = []
    sizes = nblocks.tolist()
    start = 0
    for end in range(1, len(sizes) + 1):  # O(B) host ints: where the byte cap splits the sorted rows
        if end == len(sizes) or (end - start + 1) * sizes[end] * bs * key_bytes > base.DECODE_BATCH_BYTES:
            groups.append(_group(meta, qsl, decode[start:end], lens[start:end], lo[start:end], first[start:end],
                                 nblocks[start:end], sizes[end - 1], bs))
            start = end
    return _Plan(prefill, groups)


def _prefill_part(meta: PagedAttentionMetadata, b: int, qsl: torch.Tensor, seq_lens: torch.Tensor,
                  window: int | None, bs: int) -> base._PrefillPart:
    """Sequence b's chunk of queries: the keys it can see, and SDPA's causal flag or an explicit mask."""
    q_start, q_stop, seq_len = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
    q_len = q_stop - q_start
    start = 0 if window is None else max(0, seq_len - q_len - window + 1)  # first key any query sees
    slots = base._token_slots(meta.block_tables[b], start, seq_len, bs)
    if start == 0 and q_len == seq_len and (window is None or window >= seq_len):
        return base._PrefillPart(slice(q_start, q_stop), slots, None, True)  # is_causal: queries == keys
    return base._PrefillPart(slice(q_start, q_stop), slots, attention_mask(q_len, seq_len, start, window), False)


def _group(meta: PagedAttentionMetadata, qsl: torch.Tensor, seqs: torch.Tensor, lens: torch.Tensor,
           lo: torch.Tensor, first: torch.Tensor, nblocks: torch.Tensor, width: int, bs: int) -> _Group:
    cols = torch.arange(width)
    index = (first[:, None] + cols[None, :]).clamp_max(meta.block_tables.shape[1] - 1)
    table = meta.block_tables[seqs[:, None], index].long()
    table = torch.where(cols[None, :] < nblocks[:, None], table, 0)
    pos = first[:, None] * bs + torch.arange(width * bs)[None, :]
    visible = (pos >= lo[:, None]) & (pos < lens[:, None])
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None, :]
    return _Group(qsl[seqs], table.flatten(), width, mask)


def _gather_into(cache: torch.Tensor, blocks: torch.Tensor, buf: torch.Tensor, scale: torch.Tensor | None,
                 dtype: torch.dtype, n: int) -> torch.Tensor:
    """The group's blocks into `buf` (reused across layers) -> [n, width * block_size, Hkv, D] in `dtype`."""
    src = base._bytes(cache).view(cache.shape[0], -1)
    torch.index_select(src, 0, blocks, out=buf)
    rows = base._from_bytes(buf, cache.dtype).view(n, -1, *cache.shape[2:])
    if scale is not None:
        return dequantize_kv(rows, scale).to(dtype)
    return rows.to(dtype)


def paged_attention_cpu_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                meta: PagedAttentionMetadata, scale: float, sliding_window: int | None = None,
                                k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] in q's dtype, same contract as `paged_attention_reference`."""
    dims = check_attention_inputs(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale)
    if q.device.type != "cpu":
        raise ValueError(f"paged_attention_cpu_batched runs on CPU tensors, got q on {q.device}")
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError(f"the CPU path needs a contiguous KV cache, got strides {k_cache.stride()}")
    meta.validate(dims.num_tokens, dims.num_blocks, dims.block_size)
    key_bytes = dims.num_kv_heads * dims.head_dim * q.element_size()
    plan = _plan(meta, sliding_window, dims.block_size, key_bytes)
    out = torch.empty_like(q)
    for part in plan.prefill:
        k = base._gather(k_cache, part.slots, k_scale, q.dtype).unsqueeze(0)
        v = base._gather(v_cache, part.slots, v_scale, q.dtype).unsqueeze(0)
        out[part.rows] = base._attend(q[part.rows].unsqueeze(0), k, v, scale, part.mask, part.causal)[0]
    row_bytes = k_cache[0].numel() * k_cache.element_size()
    for group in plan.decode:
        n = group.rows.shape[0]
        key = (k_cache.dtype, row_bytes)
        if key not in group.buffers:
            shape = (group.blocks.shape[0], row_bytes)
            group.buffers[key] = (torch.empty(shape, dtype=torch.uint8), torch.empty(shape, dtype=torch.uint8))
        kbuf, vbuf = (b.view(base._bytes(k_cache).dtype).view(group.blocks.shape[0], -1)
                      for b in group.buffers[key])
        k = _gather_into(k_cache, group.blocks, kbuf, k_scale, q.dtype, n)
        v = _gather_into(v_cache, group.blocks, vbuf, v_scale, q.dtype, n)
        out[group.rows] = base._attend(q[group.rows].unsqueeze(1), k, v, scale, group.mask_in(q.dtype), False)[:, 0]
    return out
