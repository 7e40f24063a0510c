"""Speculative decoding: a small draft model proposes tokens, the target model checks them all in one forward.

Over 400 lines: admission, prefill, proposal, verification and rollback act on the same two caches; the
docstring carries the algorithm and why its output keeps the target's distribution.

    decoder = SpeculativeDecoder(target_engine, draft_engine, num_speculative_tokens=4)
    outputs = decoder.generate([prompt_ids, ...], SamplingParams(max_tokens=64, temperature=0.7, seed=1))
    decoder.stats.acceptance_rate, decoder.stats.tokens_per_target_forward
    decoder.stats.warn_if_slower(baseline_tpot_s)   # logs when the draft costs more than it saves

The algorithm (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"), per step and
per request, with n committed tokens of which the target has computed all but the last:

1. Draft: k forwards of the draft model, one new token each (the first one also catches the draft up on
   the committed tokens it has not computed yet). Proposal x_i is drawn from the draft's processed
   distribution q_i (`processed_logprobs`: temperature, top-k, top-p), and q_i is kept.
2. Target: ONE forward over [the last committed token, x_1 .. x_k] gives its processed distributions
   p_1 .. p_{k+1} at the k+1 positions (p_i is the target's distribution for the token x_i stands in for).
3. Verify: x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order. At the first rejection
   the step emits a token drawn from the residual norm(max(0, p_i - q_i)) and stops; if all k are accepted
   it emits a bonus token drawn from p_{k+1}. A step therefore emits between 1 and k+1 tokens.

Why the output keeps the target's distribution: for one position, P(emit t) = q(t) min(1, p(t)/q(t)) +
P(reject) norm(max(0, p - q))(t) = min(q(t), p(t)) + max(0, p(t) - q(t)) = p(t), since P(reject) =
1 - sum min(p, q) = sum max(0, p - q). Positions after an accepted token condition on the same prefix the
target would have, so by induction every emitted token has the target's conditional distribution. With
greedy parameters p and q are one-hot (`processed_logprobs`), so this reduces to "accept while the draft's
token is the target's argmax, then take the target's argmax": the output is the target's greedy output
exactly, and it is computed without random draws.

KV caches: target and draft are two `LLMEngine`s, each with its own paged cache, block pool and runner;
this module builds `ScheduledStep`s for their runners directly (their schedulers stay idle). Proposals
are written into the caches speculatively; after verification each sequence's `num_computed` is set back
to the end of the accepted tokens, so a rejected proposal's KV slot is simply overwritten by the next
step (its block stays with the sequence until it finishes, then every block goes back to the pool; in the
pool of a sliding-window layer group, blocks behind the committed tokens' window go back at once).
Only committed tokens are ever reported to the block manager (`computed`), so the prefix cache never
hashes a block that holds a rejected proposal.

Batching: up to min(max_num_seqs) requests run together, one forward per model per draft position and
one target forward per step for the whole batch; a finished request's seat is refilled at the next step.
A request is admitted only when both pools can hold its worst case (prompt + max_tokens), so a running
request never runs out of blocks (no preemption is needed). Prompts are prefilled (all but their last
token) in chunks of max_num_batched_tokens when admitted.

Each seeded request owns one torch.Generator (`make_generator(seed)`), used in a fixed order for the
draft's proposals, the acceptance uniforms and the residual/bonus draw: its output depends only on its
seed, not on the batch around it.

Requests are validated, stopped (stop ids and strings, eos, min_tokens, max_tokens) and reported
(`RequestOutput`) by `tokq.engine.requests`, the rules `LLMEngine` applies, against the target's
tokenizer and eos ids; only the context (the smaller of the two) and the KV need (both pools) are this
module's own. A stop inside a step's accepted tokens cuts the step there.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field

import torch

from tokq.engine.block_manager import DROPPED, BlockManager, WasteMeter, blocks_held_at_most
from tokq.engine.llm_engine import LLMEngine
from tokq.engine.metrics import RequestMetrics, RunMetrics, peak_memory_bytes
from tokq.engine.requests import (
    EngineError,
    RequestOutput,
    check_blocks,
    finish,
    pair_params,
    prompt_too_long,
    record_token,
    request_output,
    stop_reason,
    validate_request,
)
from tokq.engine.sampling import SamplingParams, make_generator, processed_logprobs
from tokq.engine.scheduler import ScheduledStep
from tokq.engine.sequence import Sequence, Status

logger = logging.getLogger("tokq")


@dataclass
class SpeculativeStats:
    """Counters of one `generate` call.

    A "verification" is one target forward for one request (a batched target forward verifies every
    running request at once, so it counts once per request); plain decoding emits exactly one token
    per verification, so `tokens_per_target_forward` is the factor by which speculation cuts the
    number of target forwards a request needs.
    """

    num_speculative_tokens: int = 0
    requests: int = 0
    steps: int = 0  # batched speculative steps (one target forward each)
    verifications: int = 0  # request-steps: sum over steps of the requests in the batch
    proposed: int = 0  # draft tokens put to the target
    accepted: int = 0  # of those, accepted by rejection sampling (before any stop truncation)
    emitted: int = 0  # tokens added to outputs (accepted + residual/bonus, after stop truncation)
    target_forwards: int = 0  # batched target forward passes (prefill chunks + verifications)
    draft_forwards: int = 0  # batched draft forward passes (prefill chunks + proposals)
    wall_s: float = 0.0
    tpot_s: float = math.nan  # mean over requests with >= 2 output tokens of (last - first) / (tokens - 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (nan when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else math.nan

    @property
    def mean_accepted_per_step(self) -> float:
        """Draft tokens accepted per verification (0 .. k)."""
        return self.accepted / self.verifications if self.verifications else math.nan

    @property
    def tokens_per_target_forward(self) -> float:
        """Tokens a request gains per target forward (plain decoding: 1; at most k + 1)."""
        return self.emitted / self.verifications if self.verifications else math.nan

    def net_speedup(self, baseline_tpot_s: float) -> float:
        """Plain decoding's time per output token over speculative decoding's (> 1: speculation pays off).

        `baseline_tpot_s` is the target alone on the same workload (e.g. `LLMEngine.metrics().tpot_mean_s`).
        This is the net effect: the draft's forwards and the wider verification forward are included,
        which `tokens_per_target_forward` alone ignores.
        """
        if not self.tpot_s or math.isnan(self.tpot_s) or math.isnan(baseline_tpot_s):
            return math.nan
        return baseline_tpot_s / self.tpot_s

    def warn_if_slower(self, baseline_tpot_s: float, log: logging.Logger | None = None) -> float:
        """Log a warning when speculation is slower than plain decoding; returns the net speedup."""
        speedup = self.net_speedup(baseline_tpot_s)
        if speedup < 1:  # False for nan: nothing measured, nothing to warn about
            (log or logger).warning(
                f"speculative decoding is slower than plain decoding here (x{speedup:.2f}): the draft is too slow "
                f"or too different (acceptance {self.acceptance_rate:.0%})")
        return speedup

    def to_json(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_accepted_per_step": self.mean_accepted_per_step,
                "tokens_per_target_forward": self.tokens_per_target_forward}


@dataclass
class _Request:
    """One request: its sequence in each engine (own token list, blocks, num_computed) and its generator."""

    index: int
    params: SamplingParams
    target: Sequence  # the request's record: its token_ids are the committed tokens, its times the metrics
    draft: Sequence
    generator: torch.Generator | None
    need: dict[int, int]  # id(block pool) -> worst-case blocks the request can ever hold there
    # scratch of the current step
    k: int = 0
    proposals: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)  # the draft's probabilities per proposal (sampled only)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from (unnormalized) probabilities [V] with the request's generator (None: the global RNG)."""
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def verify_greedy(proposals: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """Greedy verification: the longest prefix of proposals equal to the target's argmax, then the target's
    argmax at the first mismatch (or the bonus position). Returns (tokens to emit, proposals accepted)."""
    for i, x in enumerate(proposals):
        if x != target_argmax[i]:
            return proposals[:i] + [target_argmax[i]], i
    return proposals + [target_argmax[len(proposals)]], len(proposals)


def verify_sampled(proposals: list[int], q: list[torch.Tensor], p: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    """Rejection sampling (module docstring): p [k+1, V] target probabilities, q[i] [V] the draft's for
    proposal i. Returns (tokens to emit, proposals accepted)."""
    k = len(proposals)
    if k:
        ids = torch.tensor(proposals, device=p.device)
        rows = torch.arange(k, device=p.device)
        q_x = torch.stack(q)[rows, ids]
        p_x = p[rows, ids]
        u = torch.rand(k, generator=generator, device=p.device)
        accept = (u * q_x < p_x).tolist()  # u < p/q without dividing; q(x) > 0 since x was drawn from q
        for i in range(k):
            if not accept[i]:
                residual = (p[i] - q[i]).clamp_min(0)
                # p <= q everywhere only up to rounding (p == q would never reject): fall back to p
                if not float(residual.sum()) > 0:
                    residual = p[i]
                return proposals[:i] + [_draw(residual, generator)], i
    return proposals + [_draw(p[k], generator)], k


class SpeculativeDecoder:
    """Generate with `target`'s distribution, using `draft` to propose `num_speculative_tokens` per step.

    Both engines must be idle (no requests of their own in flight) while `generate` runs: their block
    pools and runners are used directly. They may be the same engine (the sequences are distinct).
    """

    def __init__(self, target: LLMEngine, draft: LLMEngine, num_speculative_tokens: int = 4):
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise EngineError(f"num_speculative_tokens={k!r}: must be an integer >= 1")
        tv, dv = target.model.config.vocab_size, draft.model.config.vocab_size
        if tv != dv:
            raise EngineError(f"the draft model's vocabulary ({dv}) differs from the target's ({tv}): "
                              "a draft must share the tokenizer")
        self.target, self.draft, self.k = target, draft, k
        self.max_model_len = min(target.max_model_len, draft.max_model_len)
        self.max_num_seqs = min(target.config.max_num_seqs, draft.config.max_num_seqs)
        self.device = target.model.device  # where verification and every request's generator live
        self.stats = SpeculativeStats(num_speculative_tokens=k)
        self._next_id = 0
        self._finished: list[Sequence] = []
        self._kv_peak = 0.0
        self._waste = WasteMeter()

    # Requests -------------------------------------------------------------------------------------

    def _request(self, prompt: str | Seq[int], params: SamplingParams | None, arrival: float) -> _Request:
        """Validate one request (the engine's rules, against both models) and build its two sequences."""
        target = self.target
        params, tokens = validate_request(prompt, params, target.model, target.tokenizer, who="the target engine")
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise EngineError("speculative decoding does not return logprobs: drop logprobs/prompt_logprobs from "
                              "the sampling params, or run the request on the engine without a draft model")
        total = len(tokens) + params.max_tokens
        if total > self.max_model_len:
            raise prompt_too_long(len(tokens), params.max_tokens,
                                  f"the context of {self.max_model_len} (the smaller of target's and draft's)",
                                  self.max_model_len - params.max_tokens, "shorten it or lower max_tokens")
        need: dict[int, int] = {}
        for engine in (self.target, self.draft):
            # a forward runs at most a prefill chunk or k + 1 tokens (the draft's catch-up and proposal, or the
            # target's check) beyond the committed ones
            chunk = max(engine.config.max_num_batched_tokens, self.k + 2)
            for group in engine.blocks.groups:  # one pool per layer group (kv_pools.py)
                pool = id(group)
                # The whole request stays in a global pool; a sliding one frees what leaves its window once
                # committed. One engine serving as both target and draft holds it twice in its pools.
                need[pool] = need.get(pool, 0) + blocks_held_at_most(total, group.block_size, group.window, chunk)
                check_blocks(need[pool], group.num_blocks)
        seq_id = self._next_id
        self._next_id += 1
        # Distinct ids, so that one engine serving as both target and draft keeps the two apart.
        target = Sequence(seq_id, list(tokens), params, arrival_time=arrival)
        draft = Sequence(-1 - seq_id, list(tokens), params, arrival_time=arrival)
        return _Request(seq_id, params, target, draft, make_generator(params.seed, self.device), need)

    def _pools(self) -> dict[int, BlockManager]:
        return {id(g): g for e in (self.target, self.draft) for g in e.blocks.groups}

    def _claim(self, claimed: dict[int, int], r: _Request) -> None:
        """Count the blocks the request's two sequences hold in every pool (not those out of a window)."""
        for engine, seq in ((self.target, r.target), (self.draft, r.draft)):
            for group in engine.blocks.groups:
                claimed[id(group)] += sum(b != DROPPED for b in group.table(seq))

    def _admit(self, waiting: deque[_Request], running: list[_Request]) -> list[_Request]:
        """Admit waiting requests (in order) while seats last and both pools can hold their worst case
        on top of what the running requests may still claim."""
        pools = self._pools()
        claimed = dict.fromkeys(pools, 0)
        for r in running:
            self._claim(claimed, r)
            for pool, n in r.need.items():
                claimed[pool] -= n
        # claimed[pool] is now -(blocks the running requests may still take there)
        admitted = []
        while waiting and len(running) < self.max_num_seqs:
            r = waiting[0]
            if any(pools[p].num_free + claimed[p] < n for p, n in r.need.items()):
                break
            waiting.popleft()
            now = time.perf_counter()
            for engine, seq in ((self.target, r.target), (self.draft, r.draft)):
                engine.blocks.admit(seq)  # prefix-cache hits (only committed prompt blocks)
                seq.status = Status.RUNNING
                seq.first_scheduled_time = now
            for pool, n in r.need.items():
                claimed[pool] -= n
            self._claim(claimed, r)
            running.append(r)
            admitted.append(r)
        return admitted

    # Forwards -------------------------------------------------------------------------------------

    @staticmethod
    def _forward(engine: LLMEngine, seqs: list[Sequence], num_tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Run seq.token_ids[num_computed : num_computed + n] of each sequence through the engine's model,
        writing their K/V into its cache; advances num_computed. Returns (hidden [T, H], query_start)."""
        step = ScheduledStep(list(seqs), list(num_tokens))
        for seq, n in zip(seqs, num_tokens, strict=True):
            engine.blocks.append_slots(seq, n)  # admission reserved the worst case: always fits
        hidden, inputs = engine.runner.run(step)
        for seq, n in zip(seqs, num_tokens, strict=True):
            seq.num_computed += n
        return hidden, inputs.query_start

    def _prefill(self, admitted: list[_Request]) -> None:
        """Compute every prompt token but the last in both models, in chunks of max_num_batched_tokens
        (the last token goes with the first speculative step, which needs its logits)."""
        for engine, side in ((self.target, "target"), (self.draft, "draft")):
            seqs = [getattr(r, side) for r in admitted]
            while True:
                budget = engine.config.max_num_batched_tokens
                batch, sizes = [], []
                for seq in seqs:
                    n = min(seq.remaining - 1, budget)
                    if n > 0:
                        batch.append(seq)
                        sizes.append(n)
                        budget -= n
                if not batch:
                    break
                self._forward(engine, batch, sizes)
                for seq in batch:
                    engine.blocks.computed(seq)  # prompt tokens are committed: their full blocks may be cached
                    engine.blocks.drop_outside_windows(seq)
                if side == "target":
                    self.stats.target_forwards += 1
                else:
                    self.stats.draft_forwards += 1

    # The step -------------------------------------------------------------------------------------

    def _propose(self, running: list[_Request]) -> None:
        """k_max draft forwards; forward j runs every request with k > j (catching up first, at j = 0)."""
        for j in range(max((r.k for r in running), default=0)):
            batch = [r for r in running if r.k > j]
            seqs = [r.draft for r in batch]
            hidden, query_start = self._forward(self.draft, seqs, [s.remaining for s in seqs])
            self.stats.draft_forwards += 1
            logits = self.draft.runner.logits(hidden[[query_start[i + 1] - 1 for i in range(len(batch))]])
            logits = logits.to(self.device)
            probs = processed_logprobs(logits, [r.params for r in batch]).exp()
            argmax = logits.argmax(dim=-1).tolist()
            for i, r in enumerate(batch):
                if r.params.greedy:
                    x = argmax[i]
                else:
                    x = _draw(probs[i], r.generator)
                    r.q.append(probs[i])
                r.proposals.append(x)
                r.draft.token_ids.append(x)

    def _step(self, running: list[_Request]) -> None:
        """One speculative step for every running request (module docstring, steps 1-3)."""
        stats = self.stats
        for r in running:
            n = len(r.target.token_ids)
            left = r.params.max_tokens - r.target.num_output_tokens  # >= 1 for a running request
            # A step emits up to k + 1 tokens: never propose past max_tokens, nor past the context (the
            # target's forward reaches position n - 1 + k).
            r.k = max(0, min(self.k, left - 1, self.max_model_len - n))
            r.proposals, r.q = [], []
        self._propose(running)

        seqs = [r.target for r in running]
        for r in running:
            r.target.token_ids.extend(r.proposals)
        hidden, query_start = self._forward(self.target, seqs, [s.remaining for s in seqs])
        stats.target_forwards += 1
        stats.steps += 1
        rows = [row for i, r in enumerate(running) for row in range(query_start[i + 1] - r.k - 1, query_start[i + 1])]
        logits = self.target.runner.logits(hidden[rows])
        sampled = [i for i, r in enumerate(running) if not r.params.greedy]
        probs = None
        if sampled:
            row_params = [r.params for r in running for _ in range(r.k + 1)]
            probs = processed_logprobs(logits, row_params).exp()
        argmax = logits.argmax(dim=-1).tolist()
        now = time.perf_counter()

        offset = 0
        for r in running:
            span = slice(offset, offset + r.k + 1)
            offset += r.k + 1
            if r.params.greedy:
                tokens, accepted = verify_greedy(r.proposals, argmax[span])
            else:
                tokens, accepted = verify_sampled(r.proposals, r.q, probs[span], r.generator)
            stats.verifications += 1
            stats.proposed += r.k
            stats.accepted += accepted
            self._commit(r, tokens, accepted, now)
        self._kv_peak = max(self._kv_peak, self.target.blocks.usage())
        self._waste.add(*self.target.blocks.waste([r.target for r in running if not r.target.is_finished]))

    def _commit(self, r: _Request, tokens: list[int], accepted: int, now: float) -> None:
        """Keep the verified tokens (cut at a stop), roll both caches back to them, or finish the request."""
        base = len(r.target.token_ids) - r.k  # committed tokens before this step
        for seq in (r.target, r.draft):
            del seq.token_ids[base:]
        reason = None
        for token in tokens:
            record_token(r.target, token, now)
            r.draft.token_ids.append(token)
            self.stats.emitted += 1
            reason = stop_reason(r.target, self.target.tokenizer, self.target.eos_ids)
            if reason:
                break
        # The K/V of the first base + accepted positions are right in both caches (the accepted proposals
        # were run with exactly these tokens), as far as a stop kept them; later slots hold rejected
        # proposals and are overwritten next step. Report the committed blocks to the prefix cache even
        # when the request finishes now, as the engine does.
        for engine, seq in ((self.target, r.target), (self.draft, r.draft)):
            seq.num_computed = min(seq.num_computed, base + accepted, len(seq.token_ids))
            engine.blocks.computed(seq)
            engine.blocks.drop_outside_windows(seq)  # behind the committed tokens' windows: never read again
        if reason:
            self._finish(r, reason, now)

    def _finish(self, r: _Request, reason: str, now: float) -> None:
        finish(r.target, reason, now)
        for engine, s in ((self.target, r.target), (self.draft, r.draft)):
            s.status = Status.FINISHED
            engine.blocks.release(s)
        self._finished.append(r.target)

    # Batch API ------------------------------------------------------------------------------------

    def generate(self, prompts: Iterable[str | Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run the prompts to completion (all arriving now); outputs in the prompts' order.

        Every request is validated before any runs. `stats` and `metrics()` then describe this call.
        """
        for engine, name in ((self.target, "target"), (self.draft, "draft")):
            if engine.has_unfinished():
                raise EngineError(f"the {name} engine has requests in flight: speculative decoding uses its "
                                  "cache directly, so let them finish first")
        prompts, plist = pair_params(prompts, params)
        start = time.perf_counter()
        requests = [self._request(p, sp, start) for p, sp in zip(prompts, plist, strict=True)]
        self.stats = SpeculativeStats(num_speculative_tokens=self.k, requests=len(requests))
        self._finished, self._kv_peak, self._waste = [], 0.0, WasteMeter()
        waiting: deque[_Request] = deque()
        for r in requests:
            if r.params.max_tokens == 0:
                self._finish(r, "length", start)  # prompt only: nothing to generate
            else:
                waiting.append(r)
        running: list[_Request] = []
        try:
            while waiting or running:
                admitted = self._admit(waiting, running)
                if not running:  # cannot happen: _request refused anything larger than an empty pool
                    raise EngineError("no request fits the KV cache: raise --kv-memory")
                if admitted:
                    self._prefill(admitted)
                self._step(running)
                running = [r for r in running if not r.target.is_finished]
        finally:
            for r in running:  # an error mid-run must not leak blocks
                for engine, seq in ((self.target, r.target), (self.draft, r.draft)):
                    engine.blocks.release(seq)
        self.stats.wall_s = time.perf_counter() - start
        tpots = [m.tpot_s for m in (RequestMetrics.of(r.target) for r in requests) if m.tpot_s is not None]
        self.stats.tpot_s = statistics.fmean(tpots) if tpots else math.nan
        return [request_output(r.target, self.target.tokenizer) for r in requests]

    def metrics(self) -> RunMetrics:
        """The last generate's serving metrics (TTFT, TPOT, TBT, throughput; KV use of the target's pool)."""
        seqs = self._finished
        wall = (max((s.finish_time for s in seqs if s.finish_time), default=0.0)
                - min((s.arrival_time for s in seqs), default=0.0))
        engines = {id(e): e for e in (self.target, self.draft)}.values()
        prompt = sum(s.num_prompt_tokens for s in seqs)
        return RunMetrics.of(
            [RequestMetrics.of(s) for s in seqs], wall,
            peak_memory_bytes=peak_memory_bytes(self.device),
            kv_cache_bytes=sum(e.kv_cache_bytes for e in engines),
            kv_peak_usage=self._kv_peak, kv_waste=self._waste.fraction, preemptions=0,
            prefix_hit_rate=sum(s.num_cached_tokens for s in seqs) / prompt if prompt else 0.0,
            steps=self.stats.steps)

    # Report ---------------------------------------------------------------------------------------

    def net_speedup(self, baseline_tpot_s: float) -> float:
        """See SpeculativeStats.net_speedup (for the last generate)."""
        return self.stats.net_speedup(baseline_tpot_s)

    def warn_if_slower(self, baseline_tpot_s: float) -> float:
        """See SpeculativeStats.warn_if_slower (for the last generate)."""
        return self.stats.warn_if_slower(baseline_tpot_s)
