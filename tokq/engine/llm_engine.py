"""`LLMEngine`: requests in, tokens (or scores) out, through the scheduler, the paged cache and the model.

Over 400 lines: one class whose request, step, abort, scoring and metrics methods share its scheduler, cache
and runner (the logprob arithmetic lives in tokq.engine.logprobs).

    engine = LLMEngine(model, EngineConfig(kv_memory=512 << 20), tokenizer)
    outputs = engine.generate(["Once upon a time"], SamplingParams(max_tokens=32))
    scores = engine.score([window_token_ids], topk=20)

`add_request` / `step` are the streaming interface: each step returns the tokens it produced (with their
log-probabilities, and the prompt's once its prefill completes, when the request asked: see
`tokq.engine.logprobs`), and `abort` drops a request between steps, freeing its blocks at once. A
request that cannot be served (prompt longer than the context, sampling parameters out of range, a
stop string without a tokenizer, more tokens than the whole cache holds) is refused in add_request
with a clear error, and the requests already running carry on. `check_request` (and `check_window` for
scoring) make the same checks without queueing anything, so a caller can check a whole batch before any
of it runs. The rules themselves (validation, stops, outputs) live in `tokq.engine.requests`, shared
with speculative decoding.

`score(windows)` runs each window as a prompt through chunked prefill into the paged cache and keeps,
at every position, the log-probability of the actual next token and the top-k log-probabilities.
With `decode_from=d`, positions from d on are run one token per step through the decode kernels
(the prefill-then-decode path, the one a quantized KV cache affects the way serving does). With
`full_rows` masks it also keeps the whole vocabulary's log-probabilities at the selected positions only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from tokq.engine import huge_pages
from tokq.engine.block_manager import BlockManager, WasteMeter, blocks_held_at_most
from tokq.engine.kv_cache import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MEMORY_FRACTION,
    KVCacheSpec,
    LayerGroup,
    allocate_kv_cache,
    default_kv_budget,
    format_bytes,
    group_spec,
    layer_groups,
    split_budget,
)
from tokq.engine.kv_pools import KVPools
from tokq.engine.kv_scales import plan_kv_cache
from tokq.engine.logprobs import keep_scores, prompt_logprobs, sampled_logprobs
from tokq.engine.metrics import RequestMetrics, RunMetrics, peak_memory_bytes
from tokq.engine.models import CausalLM
from tokq.engine.requests import (  # EngineError and RequestOutput are re-exported: they are the engine's API
    EngineError,
    RequestOutput,
    TokenLogprob,
    check_blocks,
    finish,
    pair_params,
    prompt_tokens,
    prompt_too_long,
    record_token,
    request_output,
    stop_reason,
    validate_request,
)
from tokq.engine.runner import ModelRunner
from tokq.engine.sampling import SamplingParams, make_generator, sample
from tokq.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from tokq.engine.sequence import ScoreRequest, Sequence, Status
from tokq.engine.tokenizer import check_token_ids
from tokq.errors import ModelError

log = logging.getLogger("tokq")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_memory: int | None = None  # bytes for the KV cache; None: the default budget (below)
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    # None/"auto": the checkpoint's calibrated KV cache dtype if it has one, else the model's; "fp16", "bf16",
    # "fp32", "fp8", "int8"
    kv_dtype: str | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    static: bool = False
    chunked_prefill: bool = True
    # while a sequence decodes, a step's prefill tokens are capped here (None: no cap); see tokq.engine.scheduler
    max_prefill_tokens_with_decode: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    attention_kernels: str | None = None  # a TOKQ_KERNELS-style selection for attention (None: the env's)
    # int8/fp8 caches: "auto" divides by the checkpoint's calibrated scales when it has them; "unit" by 1 (fp8)
    kv_scales: str = "auto"
    # pure decode steps through the model's compiled graph (engine/compiled_decode.py); None: $TOKQ_COMPILE (on)
    compile_decode: bool | None = None


def _sample_isolated(logits: torch.Tensor, samplers: list[Sequence]) -> tuple[list[int], list[Exception | None]]:
    """Each sequence's next token, or the error its own sampling raised: the batch is sampled at once, and only
    when that fails row by row, so that one request's bad parameters or non-finite logits end that request alone
    rather than every request in the step."""
    params, generators = [s.params for s in samplers], [s.generator for s in samplers]
    try:
        return sample(logits, params, generators).tolist(), [None] * len(samplers)
    except Exception as exc:
        if len(samplers) == 1:
            return [-1], [exc]
    tokens: list[int] = []
    errors: list[Exception | None] = []
    for i in range(len(samplers)):
        try:
            tokens.append(int(sample(logits[i: i + 1], params[i: i + 1], generators[i: i + 1])[0]))
            errors.append(None)
        except Exception as exc:
            tokens.append(-1)
            errors.append(exc)
    return tokens, errors


@dataclass
class StepOutput:
    seq_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token when params.logprobs is not None
    # params.prompt_logprobs: set once, in the step whose prefill completed the prompt (entry 0: None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: Exception | None = None  # finish_reason "error": why this sequence's sampling failed (others went on)


@dataclass
class WindowScores:
    """Per position p < len(window) - 1: log P(window[p + 1] | window[:p + 1]) and the top-k at p."""

    token_ids: list[int]
    logprobs: torch.Tensor  # fp32 [L - 1]
    topk_ids: torch.Tensor | None  # int64 [L - 1, k]
    topk_logprobs: torch.Tensor | None  # fp32 [L - 1, k]
    decode_from: int | None = None
    gathered: torch.Tensor | None = None  # fp32 [L - 1, k]: log-probabilities at the requested gather_ids
    full_logprobs: torch.Tensor | None = None  # fp32 [rows set in full_rows, vocab], in position order

    @property
    def nll(self) -> torch.Tensor:
        """Per position, the negative log-likelihood of the actual next token (fp32 [L - 1])."""
        return -self.logprobs


def _full_logprobs(score: ScoreRequest, vocab: int) -> torch.Tensor | None:
    """The kept whole-vocabulary rows of one scored window (an empty [0, vocab] when the mask selects none)."""
    if score.full_rows is None:
        return None
    if not score.full_logprobs:
        return torch.empty(0, vocab)
    return torch.cat(score.full_logprobs)


@dataclass
class _RunState:
    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    peak_blocks: int = 0
    waste: WasteMeter = field(default_factory=WasteMeter)
    finished: list[Sequence] = field(default_factory=list)


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig | None = None, tokenizer=None):
        self.model, self.config, self.tokenizer = model, config or EngineConfig(), tokenizer
        cfg = self.config
        mc = model.config
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if cfg.max_prefill_tokens_with_decode is not None and cfg.max_prefill_tokens_with_decode < 1:
            raise EngineError(f"max_prefill_tokens_with_decode={cfg.max_prefill_tokens_with_decode}: must be >= 1 "
                              "(None for no cap)")
        if cfg.max_num_seqs < 1 or cfg.max_num_batched_tokens < 1:
            raise EngineError(f"max_num_seqs={cfg.max_num_seqs}, max_num_batched_tokens={cfg.max_num_batched_tokens}: "
                              "both must be >= 1")
        # getattr: a model assembled outside build_model/load_model (a wrapper, a test double) may lack kv_scales
        self.kv_plan = plan_kv_cache(cfg.kv_dtype, model.dtype, getattr(model, "kv_scales", None), mc.num_layers,
                                     mc.num_kv_heads, cfg.kv_scales, model.device)
        self.kv_spec = KVCacheSpec.of(mc, self.kv_plan.dtype, cfg.block_size)
        # One pool per group of layers sharing a window (kv_pools.py); a sliding group's blocks behind its
        # window are freed as sequences advance.
        self.layer_groups: list[LayerGroup] = layer_groups(mc)
        self.group_specs = [group_spec(self.kv_spec, g) for g in self.layer_groups]
        self.group_blocks = self._plan_blocks()  # per group
        self.num_blocks = sum(self.group_blocks)
        blocks_of_layer = [0] * mc.num_layers
        for group, n in zip(self.layer_groups, self.group_blocks, strict=True):
            for layer in group.layers:
                blocks_of_layer[layer] = n
        if model.device.type == "cpu":  # the weights decode streams, gathered onto huge pages (once per model)
            huge_pages.gather_streamed_weights(model)
        self.caches = allocate_kv_cache(self.kv_spec, blocks_of_layer, model.device)
        self.blocks = KVPools([BlockManager(n, cfg.block_size, cfg.enable_prefix_caching, i, g.window)
                               for i, (g, n) in enumerate(zip(self.layer_groups, self.group_blocks, strict=True))])
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.static,
                                                   cfg.chunked_prefill, cfg.max_prefill_tokens_with_decode),
                                   self.blocks)
        self.runner = ModelRunner(model, self.kv_spec, self.caches, cfg.attention_kernels, self.kv_plan.scales,
                                  self.layer_groups, cfg.compile_decode)
        eos = mc.eos_token_id
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids |= {tokenizer.eos_token_id}
        self._next_id = 0
        self._seqs: dict[int, Sequence] = {}
        self._run = _RunState()
        self.last_scheduled: ScheduledStep | None = None

    # Set-up ---------------------------------------------------------------------------------------

    def _plan_blocks(self) -> list[int]:
        """Blocks per group's pool: the budget split across the groups in proportion to what one sequence of
        max_model_len needs in each (so the sequences that fit, fit in every pool at once), each capped at
        what max_num_seqs such sequences could use. One group: all of the budget, as a single pool."""
        cfg = self.config
        one_seq = [self._blocks_per_seq(self.max_model_len, i) for i in range(len(self.layer_groups))]
        need = sum(n * s.bytes_per_block for n, s in zip(one_seq, self.group_specs, strict=True))
        if cfg.kv_memory is not None:
            budget = cfg.kv_memory
            source = f"--kv-memory {format_bytes(budget)}"
        else:
            budget = default_kv_budget(self.model.device, cfg.memory_fraction)
            source = f"the default budget ({cfg.memory_fraction:.0%} of the device's memory: {format_bytes(budget)})"
        blocks = split_budget(budget, one_seq, [s.bytes_per_block for s in self.group_specs])
        if budget < need:
            if len(one_seq) == 1:
                spec = self.group_specs[0]
                held = (f"holds {blocks[0]} KV blocks ({blocks[0] * spec.block_size} tokens at "
                        f"{format_bytes(spec.bytes_per_token)} a token)")
                needs = f"{one_seq[0]} blocks"
            else:
                held = "is too small"
                needs = " + ".join(f"{n} blocks for the {g.name} layers ({format_bytes(n * s.bytes_per_block)})"
                                   for n, g, s in zip(one_seq, self.layer_groups, self.group_specs, strict=True))
            raise EngineError(
                f"{source} {held}, but one sequence of max_model_len {self.max_model_len} needs {needs} = "
                f"{format_bytes(need)}: give --kv-memory of at least {format_bytes(need)} or a smaller --max-model-len")
        return [min(b, n * cfg.max_num_seqs + 1) for b, n in zip(blocks, one_seq, strict=True)]

    def _blocks_per_seq(self, tokens: int, group: int) -> int:
        """The most blocks one sequence of `tokens` tokens holds at once in the group's pool."""
        return blocks_held_at_most(tokens, self.config.block_size, self.layer_groups[group].window,
                                   self.config.max_num_batched_tokens)

    @property
    def kv_cache_bytes(self) -> int:
        """The bytes of every layer's K and V cache (each group's pool at its own size)."""
        return sum(n * s.bytes_per_block for n, s in zip(self.group_blocks, self.group_specs, strict=True))

    @property
    def kernel_names(self) -> dict[str, list[str]]:
        from tokq.engine.quant_linear import QuantizedLinearMethod

        linear = sorted({m.method.kernel_name for m in self.model.modules()
                         if isinstance(getattr(m, "method", None), QuantizedLinearMethod)}) or ["dense"]
        return {"linear": linear, "attention": self.runner.kernel_names, "decode": [self.runner.decode_path]}

    # Requests -------------------------------------------------------------------------------------

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, *, truncate: bool = False,
                    score: ScoreRequest | None = None, arrival_time: float | None = None) -> int:
        """Queue a request; returns its id. Raises EngineError (or SamplingError) for one that cannot be served."""
        params, tokens = self.check_request(prompt, params, truncate=truncate, score=score is not None)
        seq = Sequence(self._next_id, tokens, params, score=score,
                       generator=make_generator(params.seed, self.model.device))
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None and score is None:
            seq.prompt_scores = ScoreRequest(topk=params.prompt_logprobs, keep_ranks=True)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self._next_id += 1
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def check_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, *, truncate: bool = False,
                      score: bool = False) -> tuple[SamplingParams, list[int]]:
        """What add_request would queue, (params, prompt token ids), queueing nothing: raises EngineError (or
        SamplingError) for a request that cannot be served. `score`: a prompt to score (no new tokens)."""
        params, tokens = validate_request(prompt, params, self.model, self.tokenizer)
        new_tokens = 0 if score else params.max_tokens
        limit = self.max_model_len - new_tokens
        if len(tokens) > limit:
            if not truncate or score or limit < 1:
                raise prompt_too_long(len(tokens), new_tokens, f"the model's context of {self.max_model_len}", limit,
                                      "shorten it, lower max_tokens, or pass truncate=True (keeps the prompt's end)")
            tokens = tokens[-limit:]
        for group, num_blocks in enumerate(self.group_blocks):
            check_blocks(self._blocks_per_seq(len(tokens) + new_tokens, group), num_blocks)
        return params, tokens

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # The step -------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        step = self.scheduler.schedule()
        self.last_scheduled = step  # what the step ran (the paired bench records its shape)
        if not step:
            if self.scheduler.running or self.scheduler.waiting:
                raise EngineError("the scheduler could not place any request (KV cache too small for the next one); "
                                  "raise --kv-memory")
            return []
        now = time.perf_counter()
        for seq in step.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        hidden, inputs = self.runner.run(step)
        outputs = self._postprocess(step, hidden, inputs.query_start)
        run = self._run
        run.steps += 1
        run.peak_blocks = max(run.peak_blocks, self.blocks.num_used)
        run.waste.add(*self.blocks.waste(self.scheduler.running))
        return outputs

    def _postprocess(self, step: ScheduledStep, hidden: torch.Tensor, query_start: list[int]) -> list[StepOutput]:
        sample_rows, samplers = [], []
        outputs: list[StepOutput] = []
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_tokens, strict=True)):
            if seq.padding:  # a finished static-batch member recomputed as padding: nothing to keep
                seq.num_computed = len(seq.token_ids)
                continue
            scores, end = ((seq.score, len(seq.token_ids) - 1) if seq.score is not None
                           else (seq.prompt_scores, seq.num_prompt_tokens - 1))
            if scores is not None:
                keep_scores(scores, seq.token_ids, hidden[query_start[i]: query_start[i + 1]], seq.num_computed,
                            end, self.runner.logits)
            seq.num_computed += n
            self.blocks.computed(seq)
            self.blocks.drop_outside_windows(seq)
            if seq.score is None and seq.num_computed == len(seq.token_ids):
                if seq.params.max_tokens == 0:  # prompt only (e.g. to warm the prefix cache, or its logprobs)
                    self._finish(seq, "length", time.perf_counter())
                    outputs.append(StepOutput(seq.seq_id, [], True, "length",
                                              prompt_logprobs=self._prompt_done(seq)))
                    continue
                sample_rows.append(query_start[i + 1] - 1)
                samplers.append(seq)
        if samplers:
            # every row, in order (a decode step): the hidden states as they are, not a gathered copy
            logits = self.runner.logits(hidden if len(sample_rows) == hidden.shape[0] else hidden[sample_rows])
            tokens, errors = _sample_isolated(logits, samplers)
            now = time.perf_counter()
            for seq, error in zip(samplers, errors, strict=True):
                if error is not None:
                    log.warning("sampling failed for request %d (%s); that request ends, the others go on",
                                seq.seq_id, error)
                    self._finish(seq, "error", now)
                    seq.error = error
                    outputs.append(StepOutput(seq.seq_id, [], True, "error", error=error))
            kept = [i for i, error in enumerate(errors) if error is None]
            if len(kept) < len(samplers):
                samplers, tokens, logits = [samplers[i] for i in kept], [tokens[i] for i in kept], logits[kept]
            # logprobs of the raw logits (not what sampling made of them); nothing is computed unless asked
            token_lps = sampled_logprobs(logits, tokens, [s.params.logprobs for s in samplers])
            for seq, token, lp in zip(samplers, tokens, token_lps, strict=True):
                prompt_lps = self._prompt_done(seq) if seq.num_output_tokens == 0 else None
                record_token(seq, token, now)
                if lp is not None:
                    seq.logprobs.append(lp)
                reason = stop_reason(seq, self.tokenizer, self.eos_ids)
                if reason:
                    self._finish(seq, reason, now)
                outputs.append(StepOutput(seq.seq_id, [token], seq.is_finished, seq.finish_reason,
                                          None if lp is None else [lp], prompt_lps))
        for seq in step.seqs:
            if seq.score is not None and seq.num_computed >= len(seq.token_ids) and seq.finish_reason is None:
                self._finish(seq, "scored", time.perf_counter())
                outputs.append(StepOutput(seq.seq_id, [], True, "scored"))
        return outputs

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        finish(seq, reason, now)
        self.scheduler.finish(seq)
        self._run.finished.append(seq)

    @staticmethod
    def _prompt_done(seq: Sequence) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs once its prefill completed (None when not asked); from here on the request
        may use the prefix cache again (after a preemption) since no prompt position is left to score."""
        if seq.prompt_scores is None:
            return None
        seq.prompt_logprobs = prompt_logprobs(seq.prompt_scores, seq.token_ids[: seq.num_prompt_tokens])
        seq.prompt_scores = None
        return seq.prompt_logprobs

    def abort(self, seq_id: int) -> bool:
        """Drop a waiting or running request (between steps): its blocks go back to the pool now and it
        finishes with reason "abort". False when the id is unknown or the request already finished."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.abort(seq)
        finish(seq, "abort", time.perf_counter())
        self._run.finished.append(seq)
        return True

    # Batch APIs -----------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Pay first-call costs before anything is timed or served: one short request, and when decode steps are
        compiled (engine/compiled_decode.py) two at once too, so that both the one-sequence graph and the graph for
        several are compiled here rather than inside a measurement. Metrics are reset afterwards."""
        vocab = self.model.config.vocab_size
        new = max(1, min(3, self.max_model_len - 1))
        length = max(1, min(16, self.max_model_len - new))
        params = SamplingParams(max_tokens=new, ignore_eos=True)
        self.generate([[1000 % vocab] * length], params)
        if self.runner.compile_decode and self.config.max_num_seqs > 1 and new > 1:
            self.generate([[1000 % vocab] * length, [1001 % vocab] * length], params)
        self.reset_metrics()

    def reset_metrics(self) -> None:
        self._run = _RunState()
        if self.model.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.model.device)

    def _drain(self, ids: list[int], progress: Callable[[int], None] | None = None) -> None:
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.finished and out.seq_id in pending:
                    pending.discard(out.seq_id)
                    if progress:
                        progress(1)

    def generate(self, prompts: Iterable[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, truncate: bool = False, progress: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Run the prompts to completion (all arriving now); outputs in the prompts' order."""
        prompts, plist = pair_params(prompts, params)
        ids = [self.add_request(p, sp, truncate=truncate) for p, sp in zip(prompts, plist, strict=True)]
        self._drain(ids, progress)
        for i in ids:  # one caller owns the whole batch here: its failure is this call's error
            if self._seqs[i].error is not None:
                raise EngineError(f"sampling failed for prompt {ids.index(i)}: {self._seqs[i].error}")
        return [self.output(i) for i in ids]

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None, *,
               truncate: bool = False) -> Iterator[StepOutput]:
        """Generate for one prompt, yielding each step's new tokens as they come (other queued requests
        run alongside; their outputs are kept for `output`)."""
        seq_id = self.add_request(prompt, params, truncate=truncate)
        while True:
            for out in self.step():
                if out.seq_id == seq_id:
                    yield out
                    if out.finished:
                        return

    def output(self, seq_id: int) -> RequestOutput:
        return request_output(self._seqs[seq_id], self.tokenizer)

    def score(self, windows: Iterable[Seq[int] | torch.Tensor], topk: int = 0, decode_from: int | None = None,
              progress: Callable[[int], None] | None = None,
              gather_ids: Seq[torch.Tensor | None] | None = None,
              full_rows: Seq[torch.Tensor | None] | None = None) -> list[WindowScores]:
        """Score token windows (see the module docstring); results in the windows' order.

        `gather_ids`: per window, an int64 [len - 1, k] tensor of token ids whose log-probabilities to
        keep at each position as well (a candidate scored at its baseline's top-k ids, for KL).
        `full_rows`: per window, a bool [len - 1] mask of positions whose whole-vocabulary log-probabilities
        (fp32) to keep as well: the full KL at a sample of positions, without rows x vocab for all."""
        if topk < 0 or topk > self.model.config.vocab_size:
            raise EngineError(f"topk={topk}: must be between 0 and the vocabulary size {self.model.config.vocab_size}")
        if decode_from is not None and decode_from < 1:
            raise EngineError(f"decode_from={decode_from}: must be >= 1 (the first token is always prefilled)")
        ids = []
        windows = list(windows)
        gathers = list(gather_ids) if gather_ids is not None else [None] * len(windows)
        fulls = list(full_rows) if full_rows is not None else [None] * len(windows)
        for name, given in (("gather_ids", gathers), ("full_rows", fulls)):
            if len(given) != len(windows):
                raise EngineError(f"{name} has {len(given)} entries for {len(windows)} windows: give one per window")
        for window, gather, full in zip(windows, gathers, fulls, strict=True):
            tokens = self.check_window(window, gather, full)
            ids.append(self.add_request(tokens, SamplingParams(max_tokens=0),
                                        score=ScoreRequest(topk=topk, decode_from=decode_from, gather_ids=gather,
                                                           full_rows=full)))
        self._drain(ids, progress)
        results = []
        for i in ids:
            seq = self._seqs.pop(i)
            s = seq.score
            results.append(WindowScores(
                seq.token_ids, torch.cat(s.logprobs),
                torch.cat(s.topk_ids) if s.topk else None, torch.cat(s.topk_logprobs) if s.topk else None,
                decode_from, torch.cat(s.gathered) if s.gather_ids is not None else None,
                _full_logprobs(s, self.model.config.vocab_size)))
        return results

    def check_window(self, window: str | Seq[int] | torch.Tensor, gather_ids: torch.Tensor | None = None,
                     full_rows: torch.Tensor | None = None) -> list[int]:
        """The token ids `score` would run for one window, queueing nothing: raises EngineError for a window
        (or its gather_ids / full_rows) that cannot be scored."""
        tokens = prompt_tokens(window, self.tokenizer)
        if len(tokens) < 2:
            raise EngineError(f"a window of {len(tokens)} token(s) has nothing to score: give at least 2 tokens")
        gather, full = gather_ids, full_rows
        if gather is not None and (gather.dim() != 2 or gather.shape[0] != len(tokens) - 1):
            raise EngineError(f"gather_ids for a window of {len(tokens)} tokens must be [{len(tokens) - 1}, k], "
                              f"got {tuple(gather.shape)}")
        if gather is not None:
            try:  # they index the log-probabilities: one beyond the vocabulary is an IndexError in torch
                check_token_ids(gather, self.model.config.vocab_size, self.model.name)
            except ModelError as exc:
                raise EngineError(f"gather_ids: {exc.message}") from None
        if full is not None and (full.dtype != torch.bool or full.shape != (len(tokens) - 1,)):
            raise EngineError(f"full_rows for a window of {len(tokens)} tokens must be a bool [{len(tokens) - 1}] "
                              f"mask, got {full.dtype} {tuple(full.shape)}")
        return self.check_request(tokens, SamplingParams(max_tokens=0), score=True)[1]

    def metrics(self, seq_ids: Iterable[int] | None = None) -> RunMetrics:
        """The run's metrics since the last reset_metrics (over the given requests, default: all finished)."""
        run = self._run
        seqs = [self._seqs[i] for i in seq_ids] if seq_ids is not None else run.finished
        wall = (max((s.finish_time for s in seqs if s.finish_time), default=run.start)
                - min((s.arrival_time for s in seqs), default=run.start))
        stats = self.blocks.stats
        return RunMetrics.of(
            [RequestMetrics.of(s) for s in seqs], wall,
            peak_memory_bytes=peak_memory_bytes(self.model.device), kv_cache_bytes=self.kv_cache_bytes,
            kv_peak_usage=run.peak_blocks / self.num_blocks, kv_waste=run.waste.fraction,
            preemptions=sum(s.num_preemptions for s in seqs),
            prefix_hit_rate=stats.prefix_hit_tokens / stats.prefix_query_tokens if stats.prefix_query_tokens else 0.0,
            steps=run.steps)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop finished requests' records (long-running servers)."""
        for i in seq_ids:
            seq = self._seqs.get(i)
            if seq is not None and seq.status == Status.FINISHED:
                del self._seqs[i]
