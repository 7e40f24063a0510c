"""One request as the engine tracks it: its tokens, its blocks, where its computation stands, its timings.

`token_ids` holds the prompt followed by every generated token. `num_computed` counts the leading
tokens whose K/V are in the cache (prefix-cache hits included); the tokens after it are what the
next steps must run. A sequence is in prefill while num_computed < len(token_ids) - 1 would leave
prompt tokens unrun; it samples a token whenever a step leaves num_computed == len(token_ids).
Preemption by recompute frees the blocks and sets num_computed back to 0: the prompt and the tokens
generated so far are run again as one longer prompt, so nothing generated is lost.

`block_tables` holds one block table per KV pool (engine/kv_pools.py: one pool per group of layers that
share a window); `block_table` is the first one, the only one of a model whose layers all share a window.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from tokq.engine.sampling import SamplingParams


@dataclass
class TokenLogprob:
    """One token's log-probability in the model's raw distribution (log_softmax of the fp32 logits), its
    1-based rank there (1 = the argmax) and the top-k (token_id, logprob) pairs, descending (empty for k = 0)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ScoreRequest:
    """Score the prompt instead of generating: the log-probability of every actual next token and the
    top-k log-probabilities at every position. `decode_from`: positions from here on are run one token
    per step through the decode path (None: chunked prefill only). A generating request's prompt_logprobs
    are one too (`Sequence.prompt_scores`, with ranks)."""

    topk: int = 0
    decode_from: int | None = None
    gather_ids: torch.Tensor | None = None  # int64 [L - 1, k]: also keep the log-probabilities of these ids
    full_rows: torch.Tensor | None = None  # bool [L - 1]: keep the whole vocabulary's log-probabilities there
    keep_ranks: bool = False  # also keep each actual next token's rank
    num_kept: int = 0  # leading positions kept (a preempted sequence's rerun does not keep them twice)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # fp32 [n] per chunk
    topk_ids: list[torch.Tensor] = field(default_factory=list)  # int64 [n, topk]
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)  # fp32 [n, topk]
    gathered: list[torch.Tensor] = field(default_factory=list)  # fp32 [n, k] at gather_ids
    full_logprobs: list[torch.Tensor] = field(default_factory=list)  # fp32 [rows of full_rows in n, vocab]
    ranks: list[torch.Tensor] = field(default_factory=list)  # int64 [n], with keep_ranks


@dataclass
class Sequence:
    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    score: ScoreRequest | None = None
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    num_prompt_tokens: int = 0
    num_computed: int = 0
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])  # one per KV pool (layer group)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (all admissions)
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: Exception | None = None  # finish_reason "error": why its sampling failed
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each generated token was produced
    finish_time: float | None = None
    text: str = ""  # decoded output (when the engine has a tokenizer)
    padding: bool = False  # finished inside a static batch: keeps its seat, recomputing its last token
    # params.prompt_logprobs: the prompt's scores while its prefill runs, then (once complete) the entries
    prompt_scores: ScoreRequest | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    logprobs: list[TokenLogprob] | None = None  # params.logprobs: one per generated token

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def table(self, group: int) -> list[int]:
        """The block table of KV pool `group` (created empty on first use)."""
        while len(self.block_tables) <= group:
            self.block_tables.append([])
        return self.block_tables[group]

    def set_table(self, group: int, table: list[int]) -> None:
        self.table(group)
        self.block_tables[group] = table

    @property
    def block_table(self) -> list[int]:
        """The first pool's block table (a single-pool model's only one)."""
        return self.table(0)

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.set_table(0, table)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def remaining(self) -> int:
        """Tokens whose K/V still have to be computed before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def needs_every_position(self) -> bool:
        """Scoring, or prompt logprobs still to keep: no position may be skipped as a prefix-cache hit."""
        return self.score is not None or self.prompt_scores is not None

    @property
    def in_prefill(self) -> bool:
        return self.remaining > 1

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold: its prompt plus max_tokens (scoring: the prompt)."""
        return self.num_prompt_tokens + (0 if self.score is not None else self.params.max_tokens)

    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def tbts(self) -> list[float]:
        """Time between consecutive generated tokens (the first token's time is TTFT, not a TBT)."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]
