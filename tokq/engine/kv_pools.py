"""KV pools per layer group: one `BlockManager` per group of layers sharing a window, one block table each.

A hybrid model (Gemma 3: five sliding-window layers per global one) would waste most of a single pool on its
sliding layers, which never read further back than their window. Each group (kv_cache.layer_groups) gets its
own pool, sized for its own need (blocks_held_at_most with its window), and every sequence holds one block
table per pool (`Sequence.block_tables`, indexed by the group). The sliding group's table frees the blocks
that fall out of its window as the sequence advances; the full group keeps everything.

`KVPools` is what the scheduler and the engine talk to: admission, growth, preemption and freeing act on
every pool at once (a sequence runs only when every pool has room for its next piece). A model with one
group (llama, an all-sliding Mistral) has one pool and behaves exactly as a bare BlockManager.

Prefix caching across groups stays exact: a prompt's full blocks are hashed by one chain for every pool. A
hit of h blocks (computation restarts at position h * block_size) needs, in a global pool, every block
0 .. h - 1, and in a pool of window W only the blocks holding positions h * block_size - W + 1 onwards
(what the first computed query can see; the earlier ones enter the table as DROPPED). The longest h
that every pool can serve is taken. A sliding pool holds few blocks, so its cached ones are evicted soon and
long prompts mostly hit in the global pool only: such a hit then shrinks to what the sliding pool still
has, which keeps the result exact at the cost of recomputing more.
"""

from __future__ import annotations

from tokq.engine.block_manager import BlockManager, BlockStats
from tokq.engine.sequence import Sequence


class KVPools:
    """The block pools of every layer group, acting together on a sequence's block tables."""

    def __init__(self, groups: list[BlockManager]):
        if not groups or [g.group for g in groups] != list(range(len(groups))):
            raise ValueError("KVPools needs pools numbered 0 .. n-1 in order")
        self.groups = groups
        self.block_size = groups[0].block_size
        self.enable_prefix_caching = groups[0].enable_prefix_caching
        self._hit_tokens = 0  # prefix statistics of a several-pool admission (one pool counts its own)
        self._query_tokens = 0

    # Pool state ------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)

    @property
    def num_free(self) -> int:
        return sum(g.num_free for g in self.groups)

    @property
    def num_used(self) -> int:
        return sum(g.num_used for g in self.groups)

    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    @property
    def stats(self) -> BlockStats:
        if len(self.groups) == 1:
            return self.groups[0].stats
        return BlockStats(self._hit_tokens, self._query_tokens, sum(g.stats.allocated_blocks for g in self.groups),
                          sum(g.stats.evicted_cached_blocks for g in self.groups))

    # Admission -------------------------------------------------------------------------------------

    def admit(self, seq: Sequence) -> int:
        """Prefix-cache lookup for a sequence that holds no blocks in any pool; returns the tokens hit."""
        if len(self.groups) == 1:
            return self.groups[0].admit(seq)
        if not self.enable_prefix_caching or seq.needs_every_position:
            for g in self.groups:
                g.admit(seq)  # takes nothing; starts the sequence's hash chain
            return 0
        bs, tokens = self.block_size, seq.token_ids
        usable = (len(tokens) - 1) // bs  # full blocks that still leave a token to compute
        found: list[list[int | None]] = [[] for _ in self.groups]
        hashes: list[int] = []
        parent = None
        for i in range(usable):
            chunk = tuple(tokens[i * bs: (i + 1) * bs])
            parent = self.groups[0]._chain(parent, chunk)
            looked = [g.lookup(parent, chunk) for g in self.groups]
            if any(b is None for g, b in zip(self.groups, looked, strict=True) if g.window is None):
                break  # a global pool must hold every block of the hit
            hashes.append(parent)
            for row, b in zip(found, looked, strict=True):
                row.append(b)
        hit_blocks = next(h for h in range(len(hashes), -1, -1) if self._servable(found, h))
        for g, row in zip(self.groups, found, strict=True):
            g.take_cached(seq, row, hit_blocks, self._first_needed(g, hit_blocks),
                          hashes[hit_blocks - 1] if hit_blocks else None)
        hit = hit_blocks * bs
        seq.num_computed = hit
        seq.num_cached_tokens += hit
        self._hit_tokens += hit
        self._query_tokens += len(tokens)
        return hit

    def _first_needed(self, pool: BlockManager, hit_blocks: int) -> int:
        """The first block a query at position hit_blocks * block_size can see in `pool`."""
        if pool.window is None:
            return 0
        return max(0, hit_blocks * self.block_size - pool.window + 1) // self.block_size

    def _servable(self, found: list[list[int | None]], hit_blocks: int) -> bool:
        return all(all(row[i] is not None for i in range(self._first_needed(g, hit_blocks), hit_blocks))
                   for g, row in zip(self.groups, found, strict=True))

    def undo_admit(self, seq: Sequence, hit: int) -> None:
        """Give back what `admit` took when the sequence cannot start this step after all."""
        if len(self.groups) == 1:
            self.groups[0].undo_admit(seq, hit)
            return
        counted = self.enable_prefix_caching and not seq.needs_every_position
        self.release(seq)
        seq.num_cached_tokens -= hit
        if counted:
            self._hit_tokens -= hit
            self._query_tokens -= len(seq.token_ids)

    # Growth and freeing ----------------------------------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return all(g.can_append(seq, num_new_tokens) for g in self.groups)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` the blocks its next `num_new_tokens` tokens need in every pool (call can_append first)."""
        for g in self.groups:
            g.append_slots(seq, num_new_tokens)

    def computed(self, seq: Sequence) -> None:
        for g in self.groups:
            g.computed(seq)

    def drop_outside_windows(self, seq: Sequence) -> int:
        """Free, in every sliding pool, the blocks no future query of `seq` can see; returns how many."""
        return sum(g.drop_outside_window(seq, g.window) for g in self.groups if g.window is not None)

    def release(self, seq: Sequence) -> None:
        """Free the sequence's blocks in every pool (finished or preempted)."""
        for g in self.groups:
            g.release(seq)

    def waste(self, running: list[Sequence]) -> tuple[int, int]:
        """(allocated slots, slots holding a token's K/V), summed over the pools."""
        pairs = [g.waste(running) for g in self.groups]
        return sum(a for a, _ in pairs), sum(f for _, f in pairs)
