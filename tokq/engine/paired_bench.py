"""A paired speed experiment: base and variant play the same workload in one warm process, interleaved by
blocks of engine steps, so both see the same machine at (almost) the same moment.

Why: on a shared runner the machine's speed drifts and stalls (another job, a throttled core, a page-cache
flush). Benching the base for a minute and then the variant for a minute lets that drift land on one side
only, and a 10 s stall in one round can flip a verdict. Here both engines hold the same requests (same
prompts, same output lengths, ignore_eos), so their schedulers produce the same step sequence: step j of the
base does exactly the work of step j of the variant. The experiment runs `block_steps` steps of one engine,
then the same steps of the other, alternating which goes first (ABBA...), until both finish the workload: one
*pass*. Passes repeat with fresh prompts until the time budget is spent. Each step's wall time is recorded
with the step's shape (phase, sequences, tokens) and the requests that received a token, so
the evalsuite's speed_stats can rebuild each side's serving timeline as if it had run alone, detect stalls,
and bootstrap the ratios over block pairs.

Arrivals: all at once by default. With a Poisson `arrival_rate`, a request is admitted to both engines at the
first block boundary where the base's own clock (the sum of its step times in this pass) has passed its
arrival offset, so both sides always hold the same requests; TTFT is then counted from that admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tokq.engine.llm_engine import EngineConfig, LLMEngine
from tokq.engine.models import CausalLM
from tokq.engine.sampling import SamplingParams
from tokq.engine.workload import Workload

SIDES = ("base", "variant")


@dataclass
class StepTrace:
    """One engine step of one side."""

    seconds: float
    tokens: int  # tokens run in the step (prompt chunks + one per decoding sequence)
    seqs: int  # sequences in the step
    emitted: list[int]  # request indices (within the pass) that received a token in this step

    @property
    def phase(self) -> str:
        """'prefill' when the step ran any prompt chunk (more tokens than sequences), else 'decode'."""
        return "prefill" if self.tokens > self.seqs else "decode"


@dataclass
class PassTrace:
    """One pass of the workload on both sides: aligned step lists, admissions and block boundaries."""

    steps: dict[str, list[StepTrace]] = field(default_factory=lambda: {s: [] for s in SIDES})
    admitted_at: list[int] = field(default_factory=list)  # per request: index of the step it was admitted before
    prompt_tokens: list[int] = field(default_factory=list)
    block_of_step: list[int] = field(default_factory=list)  # experiment-wide block index of each step
    first_side: list[str] = field(default_factory=list)  # per block of this pass: which side ran first

    def to_json(self) -> dict:
        return {"steps": {s: [[round(t.seconds, 7), t.tokens, t.seqs, len(t.emitted)] for t in steps]
                          for s, steps in self.steps.items()},
                "admitted_at": self.admitted_at, "prompt_tokens": self.prompt_tokens,
                "block_of_step": self.block_of_step, "first_side": self.first_side}


@dataclass
class PairedTrace:
    """Everything the experiment measured (the input of evalsuite.speed_stats)."""

    passes: list[PassTrace]
    block_steps: int
    seconds: float  # wall time of the whole experiment
    budget_s: float
    output_lengths: list[int]
    stopped_by: str  # "budget" or "max_passes"

    @property
    def num_blocks(self) -> int:
        return max((b for p in self.passes for b in p.block_of_step), default=-1) + 1


def _shape(engine: LLMEngine) -> tuple[int, int]:
    step = engine.last_scheduled
    return (step.total_tokens, len(step.seqs)) if step else (0, 0)


class _Side:
    """One engine and the ids of the current pass's requests on it."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.index_of: dict[int, int] = {}  # engine seq id -> request index in the pass
        self.clock = 0.0

    def admit(self, index: int, prompt: list[int], max_tokens: int) -> None:
        seq_id = self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.index_of[seq_id] = index

    def step(self) -> StepTrace:
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        tokens, seqs = _shape(self.engine)
        self.clock += seconds
        emitted = [self.index_of[o.seq_id] for o in outputs if o.new_token_ids and o.seq_id in self.index_of]
        return StepTrace(seconds, tokens, seqs, emitted)


def paired_engines(models: dict[str, CausalLM], workload: Workload, max_num_seqs: int) -> dict[str, LLMEngine]:
    """One engine per side with identical settings (same block count: the same schedule on both)."""
    max_len = workload.prompt_len + max(workload.output_lengths())
    engines = {s: LLMEngine(models[s], EngineConfig(max_model_len=max_len, max_num_seqs=max_num_seqs))
               for s in SIDES}
    blocks = min(e.num_blocks for e in engines.values())
    if any(e.num_blocks != blocks for e in engines.values()):  # same pool size, so preemptions match too
        # the budget that gives `blocks` in all (one pool: blocks x its block bytes; pools per layer group
        # split a budget in fixed proportions, so scaling this side's budget scales every pool alike)
        engines = {s: LLMEngine(models[s], EngineConfig(
                       max_model_len=max_len, max_num_seqs=max_num_seqs,
                       kv_memory=-(-engines[s].kv_cache_bytes * blocks // engines[s].num_blocks)))
                   for s in SIDES}
    return engines


def run_paired(engines: dict[str, LLMEngine], workload: Workload, vocab_size: int, *, budget_s: float,
               block_steps: int = 8, min_passes: int = 2, max_passes: int = 1000,
               documents: list[list[int]] | None = None,
               on_pass: Callable[[int, float], None] | None = None) -> PairedTrace:
    """Play `workload` on both engines, interleaved by blocks of `block_steps` steps, pass after pass, until
    `budget_s` seconds are spent (at least `min_passes`; a pass is never cut short, and the next one only
    starts when the last pass's duration still fits the budget)."""
    if block_steps < 1:
        raise ValueError(f"block_steps must be >= 1, got {block_steps}")
    for engine in engines.values():  # first-call costs (allocations, compiled decode graphs) out of the measurement
        engine.warm_up()
    lengths = workload.output_lengths()
    offsets = workload.arrival_offsets()
    passes: list[PassTrace] = []
    start = time.perf_counter()
    next_block = 0
    stopped_by = "max_passes"
    while len(passes) < max_passes:
        elapsed = time.perf_counter() - start
        last = (elapsed / len(passes)) if passes else 0.0
        if len(passes) >= min_passes and elapsed + last > budget_s:
            stopped_by = "budget"
            break
        # fresh prompts each pass (a repeated prompt would hit the prefix cache), the same on both sides
        prompts = replace(workload, seed=workload.seed + 7919 * (len(passes) + 1)).prompts(vocab_size, documents)
        trace, next_block = _one_pass(engines, prompts, lengths, offsets, block_steps, next_block,
                                      base_first=len(passes) % 2 == 0)
        passes.append(trace)
        if on_pass:
            on_pass(len(passes), time.perf_counter() - start)
    return PairedTrace(passes, block_steps, time.perf_counter() - start, budget_s, lengths, stopped_by)


def _one_pass(engines: dict[str, LLMEngine], prompts: list[list[int]], lengths: list[int], offsets: list[float],
              block_steps: int, first_block: int, base_first: bool = True) -> tuple[PassTrace, int]:
    """One pass; blocks alternate which side runs first, starting with the base when `base_first`. The first block
    of a pass (new prompts admitted, caches cold after the last pass) favours the side that runs second: passes
    alternate who starts, so that no side gets it every pass (an A/A run found the variant ~0.6% faster, every
    interval that missed 1 on the variant's side)."""
    sides = {s: _Side(engines[s]) for s in SIDES}
    trace = PassTrace(admitted_at=[-1] * len(prompts), prompt_tokens=[len(p) for p in prompts])
    pending = sorted(range(len(prompts)), key=lambda i: offsets[i])
    block = first_block
    while pending or sides["base"].engine.has_unfinished():
        # Admissions at the block boundary, on the base's clock, to both sides alike; an idle engine takes the
        # next request at once (idle time is not on either clock: both measure busy time).
        idle = not sides["base"].engine.has_unfinished()
        while pending and (idle or offsets[pending[0]] <= sides["base"].clock):
            i = pending.pop(0)
            trace.admitted_at[i] = len(trace.block_of_step)
            for side in sides.values():
                side.admit(i, prompts[i], lengths[i])
            idle = False
        order = SIDES if ((block - first_block) % 2 == 0) == base_first else SIDES[::-1]
        trace.first_side.append(order[0])
        ran: dict[str, list[StepTrace]] = {}
        for s in order:
            ran[s] = []
            while len(ran[s]) < block_steps and sides[s].engine.has_unfinished():
                ran[s].append(sides[s].step())
        if len(ran["base"]) != len(ran["variant"]) or any(
                (a.tokens, a.seqs, sorted(a.emitted)) != (b.tokens, b.seqs, sorted(b.emitted))
                for a, b in zip(ran["base"], ran["variant"], strict=True)):
            raise RuntimeError("paired bench: base and variant schedules diverged in one block; the step pairing "
                               "would be invalid")
        for s in SIDES:
            trace.steps[s].extend(ran[s])
        trace.block_of_step.extend([block] * len(ran["base"]))
        block += 1
    for side in sides.values():
        side.engine.forget(list(side.index_of))
    return trace, block
