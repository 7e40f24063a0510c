"""The block pool: ref-counted KV blocks, allocated to sequences on demand, with prefix caching.

One BlockManager is one pool of blocks for one group of layers (engine/kv_pools.py groups the layers by
window; a sequence has one block table per pool). Sliding windows: when the pool's layers attend within a
window W, a block whose positions all lie W or more behind the next query can never be read again;
`drop_outside_window` frees it at once and leaves the placeholder `DROPPED` in the block table
(positions keep their index; kernels start reading at the window, so the placeholder is never
dereferenced). The pool of global layers (Gemma 3's full-attention ones) keeps every block.

Blocks are handed out as a sequence's computation reaches them (chunked prefill allocates only the
blocks of the chunk being run), so a sequence never holds more than one partly-filled block: the
KV waste (allocated but unused slots) is under one block per running sequence.

Prefix caching: once a block is full, its content is named by a chained hash, hash(previous block's
hash, its tokens), and recorded. A new sequence whose prompt starts with the same full blocks takes
those blocks (their ref count goes up) instead of computing them again; at least one prompt token is
always left to compute, since its logits give the first sample. A freed block whose ref count drops
to 0 keeps its content and hash until the pool reuses it, least recently freed first, so a prompt
that comes back soon still hits. Hits are verified against the stored tokens, so a hash collision
can never hand out the wrong K/V.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokq.engine.sequence import Sequence

DROPPED = -1  # a block-table entry whose block fell out of the window and went back to the pool


def blocks_held_at_most(tokens: int, block_size: int, window: int | None, chunk: int) -> int:
    """The most blocks one sequence of `tokens` tokens holds at once in one pool: all of them, or, when the
    pool's layers slide, its window plus one step's chunk of `chunk` tokens (block-aligned)."""
    full = -(-tokens // block_size)
    if window is None:
        return full
    return min(full, -(-(window - 1 + chunk) // block_size) + 1)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()


@dataclass
class _SeqHashes:
    blocks: int = 0  # leading blocks of the sequence already hashed
    last: int | None = None  # the hash of the last of them (the chain's next parent)


@dataclass
class BlockStats:
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    allocated_blocks: int = 0
    evicted_cached_blocks: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, group: int = 0,
                 window: int | None = None):
        """`group`: which of a sequence's block tables this pool fills (engine/kv_pools.py: one pool per group
        of layers sharing a window); `window`: that group's sliding window (None: the layers read everything)."""
        self.group, self.window = group, window
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.enable_prefix_caching = enable_prefix_caching
        self._hashes: dict[int, _SeqHashes] = {}
        self.stats = BlockStats()

    # Pool state ------------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def table(self, seq: Sequence) -> list[int]:
        """The sequence's block table in this pool."""
        return seq.table(self.group)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        want = -(-(seq.num_computed + num_new_tokens) // self.block_size)
        return max(0, want - len(self.table(seq)))

    # Allocation -----------------------------------------------------------------------------------

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)  # the least recently freed
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached content
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.tokens = None, ()
            self.stats.evicted_cached_blocks += 1
        block.ref_count = 1
        self.stats.allocated_blocks += 1
        return block_id

    def _chain(self, parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def admit(self, seq: Sequence) -> int:
        """Prefix-cache lookup for a sequence that holds no blocks: take the cached full blocks its
        tokens start with (leaving at least one token to compute)."""
        table = self.table(seq)
        assert not table and seq.num_computed == 0
        self._hashes[seq.seq_id] = _SeqHashes()
        if not self.enable_prefix_caching or seq.needs_every_position:
            return 0  # scoring or prompt logprobs need the logits of every position: nothing may be skipped
        bs, tokens = self.block_size, seq.token_ids
        usable = (len(tokens) - 1) // bs  # full blocks that still leave a token to compute
        state = self._hashes[seq.seq_id]
        self.stats.prefix_query_tokens += len(tokens)
        for i in range(usable):
            chunk = tuple(tokens[i * bs: (i + 1) * bs])
            h = self._chain(state.last, chunk)
            block_id = self.lookup(h, chunk)
            if block_id is None:
                break
            self._hold(block_id)
            table.append(block_id)
            state.blocks, state.last = i + 1, h
        hit = len(table) * bs
        seq.num_computed = hit
        seq.num_cached_tokens += hit
        self.stats.prefix_hit_tokens += hit
        return hit

    def lookup(self, h: int, chunk: tuple[int, ...]) -> int | None:
        """The cached block holding `chunk` under chain hash `h` (its tokens verified), or None."""
        block_id = self.cached.get(h)
        if block_id is None or self.blocks[block_id].tokens != chunk:
            return None
        return block_id

    def _hold(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def take_cached(self, seq: Sequence, found: list[int | None], hit_blocks: int, first: int,
                    last_hash: int | None) -> None:
        """Admit `seq` with its first `hit_blocks` blocks from the prefix cache, holding only blocks
        first .. hit_blocks - 1 (`found[i]`, looked up by `lookup`); the ones before `first` are out of this
        pool's window and enter the table as DROPPED. Prefix statistics are the caller's (kv_pools.KVPools)."""
        table = self.table(seq)
        assert not table and seq.num_computed == 0
        for i in range(hit_blocks):
            if i < first:
                table.append(DROPPED)
                continue
            block_id = found[i]
            assert block_id is not None
            self._hold(block_id)
            table.append(block_id)
        self._hashes[seq.seq_id] = _SeqHashes(hit_blocks, last_hash)

    def undo_admit(self, seq: Sequence, hit: int) -> None:
        """Give back what `admit` took when the sequence cannot start this step after all."""
        counted = self.enable_prefix_caching and not seq.needs_every_position  # admit counted its query
        self.release(seq)
        seq.num_cached_tokens -= hit
        self.stats.prefix_hit_tokens -= hit
        if counted:
            self.stats.prefix_query_tokens -= len(seq.token_ids)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` the blocks its next `num_new_tokens` tokens need (call can_append first)."""
        table = self.table(seq)
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            table.append(self._take_free())

    def computed(self, seq: Sequence) -> None:
        """After a step advanced seq.num_computed: hash and record its newly full blocks."""
        if not self.enable_prefix_caching:
            return
        state = self._hashes.setdefault(seq.seq_id, _SeqHashes())
        bs = self.block_size
        table = self.table(seq)
        full = min(seq.num_computed // bs, len(table))
        for i in range(state.blocks, full):
            chunk = tuple(seq.token_ids[i * bs: (i + 1) * bs])
            h = self._chain(state.last, chunk)
            block = self.blocks[table[i]] if table[i] != DROPPED else None
            if block is not None and block.hash is None and h not in self.cached:
                block.hash, block.tokens = h, chunk
                self.cached[h] = block.block_id
            state.blocks, state.last = i + 1, h

    def _unref(self, block_id: int) -> None:
        """One holder fewer; a block nobody holds goes back to the pool (its cached content stays until reused)."""
        if block_id == DROPPED:
            return
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def release(self, seq: Sequence) -> None:
        """Free the sequence's blocks (finished or preempted); cached ones stay reusable until evicted."""
        for block_id in reversed(self.table(seq)):  # the tail is evicted before the shared head
            self._unref(block_id)
        seq.set_table(self.group, [])
        seq.num_computed = 0
        self._hashes.pop(seq.seq_id, None)

    def drop_outside_window(self, seq: Sequence, window: int) -> int:
        """Free the blocks no future query of `seq` can see (every layer attends within `window`);
        returns how many were freed. A query at position p sees keys p - window + 1 .. p, and the next
        query is at seq.num_computed or later."""
        first_visible = seq.num_computed - window + 1
        freed = 0
        table = self.table(seq)
        for i in range(max(0, first_visible) // self.block_size):  # blocks ending before first_visible
            if table[i] == DROPPED:
                continue
            self._unref(table[i])
            table[i] = DROPPED
            freed += 1
        return freed

    # Accounting -----------------------------------------------------------------------------------

    def waste(self, running: list[Sequence]) -> tuple[int, int]:
        """(allocated slots, slots holding a token's K/V) over the distinct blocks the running sequences hold."""
        used: dict[int, int] = {}
        bs = self.block_size
        for seq in running:
            held = seq.num_computed
            for i, block_id in enumerate(self.table(seq)):
                if block_id == DROPPED:
                    continue
                used[block_id] = max(used.get(block_id, 0), min(bs, max(0, held - i * bs)))
        return len(used) * bs, sum(used.values())


@dataclass
class WasteMeter:
    """KV waste sampled every step: allocated-but-unused slots over allocated slots (time-averaged)."""

    allocated: int = 0
    filled: int = 0
    samples: list[float] = field(default_factory=list)

    def add(self, allocated: int, filled: int) -> None:
        if allocated:
            self.allocated += allocated
            self.filled += filled
            self.samples.append(1 - filled / allocated)

    @property
    def fraction(self) -> float:
        return 1 - self.filled / self.allocated if self.allocated else 0.0
