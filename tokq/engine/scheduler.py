"""The scheduler: which sequences run in the next step, and how many of their tokens.

Continuous batching at iteration level (the default): every step first gives each running sequence
its next piece (one token for a decoding sequence, the next chunk of a prompt still in prefill),
then admits waiting sequences while seats (`max_num_seqs`) and the step's token budget
(`max_num_batched_tokens`) last. A long prompt is split into chunks that fit what is left of the
budget (chunked prefill), so decoding sequences keep producing tokens while it is read. A finished
sequence frees its blocks at once and its seat is filled at the next step; so does an aborted one.

While any sequence is decoding, the prefill tokens a step carries (running prompts' chunks and admissions
together) are capped at `max_prefill_tokens_with_decode` (vLLM's long_prefill_token_threshold in spirit):
a step's cost grows with its tokens, so a full-budget prefill chunk riding along with the decodes is what
makes their time between tokens spike. A step with no decode keeps the whole budget. The cap only moves
chunk boundaries (the same tokens are computed, so outputs do not change), and the oldest prompt still
gets at least the cap every step, so a long prompt always finishes.

Blocks come from the KV pools (engine/kv_pools.py: one per group of layers sharing a window); a piece runs
only when every pool has room for it. When a pool has no block for a running sequence's next piece, the
most recently admitted running sequence is preempted by recompute: its blocks are freed and it goes back to the front of the queue,
to be run again from its prompt plus what it generated (never lost, never a crash). A sequence that
could not fit even with the pool to itself is refused when it is added (the engine checks).

Static batching (`static=True`, for comparison): a batch of up to max_num_seqs waiting sequences is
admitted only when nothing runs, and runs until its longest member finishes. As in a fixed-shape batch
(HF `generate`, request-level batching servers), a member that finished keeps its seat and keeps being
computed as padding (its last token again; outputs discarded) until the whole batch is done. Prompts are
still chunked by the same token budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokq.engine.kv_pools import KVPools
from tokq.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    static: bool = False
    chunked_prefill: bool = True  # False: a prompt is admitted only when it fits the step's budget whole
    # Prefill tokens a step may carry while a sequence decodes (None: no cap; continuous chunked mode only). Off by
    # default: measured on CPU (benchmarks/results/continuous_batching.json) 256 cost 0.71x throughput with fixed
    # lengths at concurrency 16 (freed seats refilled one prompt a step) and did not bring TBT p95 under 2x TPOT.
    max_prefill_tokens_with_decode: int | None = None


@dataclass
class ScheduledStep:
    """One step's work: per sequence, how many of its tokens (from seq.num_computed) to run."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: KVPools):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _piece(self, seq: Sequence, budget: int) -> int:
        """How many tokens of `seq` to run now, within `budget`."""
        want = seq.remaining
        if seq.score is not None and seq.score.decode_from is not None:
            # decode-path scoring: prefill up to decode_from, then one token per step
            if seq.num_computed >= seq.score.decode_from:
                want = 1
            else:
                want = min(want, seq.score.decode_from - seq.num_computed)
        return min(want, budget)

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        if seq.padding:  # a finished member of a static batch: just give its seat's blocks back
            seq.num_computed = len(seq.token_ids)
            self._drop(seq)
            return
        self.blocks.release(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        step.preempted.append(seq)

    def _decodes(self, seq: Sequence) -> bool:
        """Its next piece is one token that is not part of a prompt still being read."""
        if seq.padding or seq.remaining <= 1:
            return True
        decode_from = seq.score.decode_from if seq.score is not None else None
        return decode_from is not None and seq.num_computed >= decode_from

    def _prefill_budget(self) -> int | None:
        """The step's cap on prefill tokens: None (no cap) unless a running sequence decodes."""
        cap = self.config.max_prefill_tokens_with_decode
        if cap is None or self.config.static or not self.config.chunked_prefill or not any(self._decodes(s) for s in self.running):
            return None
        return cap

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        prefill = self._prefill_budget()
        # 1. the running sequences, oldest first; make room by preempting the newest when blocks run out
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            if budget <= 0:
                break
            if seq.padding:  # rerun its last token: same position, same slot, no new block
                seq.num_computed = len(seq.token_ids) - 1
            decodes = self._decodes(seq)
            n = self._piece(seq, budget if decodes or prefill is None else min(budget, prefill))
            if n == 0:
                continue  # a prompt chunk with the step's prefill cap spent: it goes on next step
            while not self.blocks.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim, step)
                if victim is seq:
                    break
                if victim in queue:
                    queue.remove(victim)
            if seq not in self.running:  # preempted to make room
                continue
            self.blocks.append_slots(seq, n)
            step.seqs.append(seq)
            step.num_tokens.append(n)
            budget -= n
            if prefill is not None and not decodes:
                prefill -= n
        if step.preempted:
            return step  # no admissions in a step that had to preempt: the pool is full
        # 2. admit waiting sequences
        if self.config.static:
            return self._admit_static_batch(step, budget)
        if prefill is not None:
            budget = min(budget, prefill)  # what is admitted now is prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self.blocks.admit(seq)
            n = self._piece(seq, budget)
            if (not self.config.chunked_prefill and n < seq.remaining and seq.score is None) \
                    or not self.blocks.can_append(seq, n):
                self.blocks.undo_admit(seq, hit)  # try again next step
                break
            self.waiting.popleft()
            self._start(seq, n, step)
            budget -= n
        return step

    def _start(self, seq: Sequence, n: int, step: ScheduledStep) -> None:
        seq.status = Status.RUNNING
        self.running.append(seq)
        if n:
            self.blocks.append_slots(seq, n)
            step.seqs.append(seq)
            step.num_tokens.append(n)

    def _admit_static_batch(self, step: ScheduledStep, budget: int) -> ScheduledStep:
        """Static batching: only when nothing runs, the next max_num_seqs requests become the batch at once
        (their prompts are then read chunk by chunk within the token budget, as in continuous mode)."""
        if self.running:
            return step
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            self.blocks.admit(seq)
            n = self._piece(seq, budget) if budget > 0 else 0
            if n and not self.blocks.can_append(seq, n):
                n = 0  # its blocks come in a later step (or it is preempted and waits for the next batch)
            self._start(seq, n, step)
            budget -= n
        return step

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if not self.config.static:
            self._drop(seq)
            return
        seq.padding = True  # keeps its seat until the batch is done
        if all(s.padding for s in self.running):
            for member in list(self.running):
                self._drop(member)

    def abort(self, seq: Sequence) -> None:
        """Remove a waiting or running sequence now, giving its blocks back (a waiting one holds none:
        admission returns what it took when the sequence cannot start, and preemption frees them)."""
        seq.status = Status.FINISHED
        if seq in self.waiting:
            self.waiting.remove(seq)
            return
        self._drop(seq)
        if self.config.static and self.running and all(s.padding for s in self.running):
            for member in list(self.running):  # the rest of its static batch had finished: the batch is done
                self._drop(member)

    def _drop(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.padding = False
        self.running.remove(seq)
