"""The gate's paired speed experiment over HTTP: base and variant measured by the same client, block by block.

Used when a side of a gate comparison is a URL (a served model): then both sides are measured over HTTP, so
both pay the same HTTP cost. A local side is served for the duration by `tokq serve`'s app (tokq.serve.app) on
127.0.0.1 and a free port, in a thread of this process (`serve_checkpoint`).

The experiment (`run_paired_http`): a *block* is one set of requests (fresh random prompts of `prompt_len`
tokens, the same texts and max_tokens on both sides, ignore_eos, temperature 0) sent to one side at the
workload's concurrency (and Poisson arrivals when it has a rate, the same gaps on both sides), then the same set
to the other side; which side goes first alternates (AB, BA, ...), so a drift in the machine's speed lands on
both. Blocks repeat until [bench] max_seconds is spent (at least `min_blocks`). Each request is streamed and
timed as vLLM's `bench serve` times it (tokq.remote.bench_serve.send_request): TTFT, ITL (gaps between chunks),
TPOT (E2EL - TTFT) / (output tokens - 1), E2EL; throughput is tokens over the side's wall time in the block.

The analysis (`analyze_http`): the vLLM-named metrics of each side over every block (mean/median/p95/p99 TTFT,
TPOT, ITL, E2EL; throughputs), and for each the variant/base ratio with a 95% interval from the same bootstrap
as the in-process experiment (evalsuite.speed_stats: `unit_weights`, `ratio_estimate`, `weighted_quantile`): the
resampling unit is a block pair, drawn with replacement on both sides at once. Mean metrics are reweighted
per-block sums; percentiles are weighted quantiles of the observations, each carrying its block's draw count
(binned on a fine log grid when there are many, for memory: the interval's width barely moves, the point
estimate is exact). A block pair where one side took > STALL_FACTOR x its typical block time and > STALL_FACTOR
x what its pair predicts (a stall: a descheduled process, another job's burst) is left out of the metrics and
counted per side, as is a block pair where a request failed on either side. So the same speed rules apply; the
memory rules cannot be measured over HTTP (the gate marks them "not measured", inconclusive).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tokq.remote.bench_serve import (
    RequestOutput,
    SampleRequest,
    ServeBenchSettings,
    run_requests,
    send_request,
)
from tokq.remote.http import EndpointClient, EndpointError
from tokq.remote.urls import redact

SIDES = ("base", "variant")
STALL_FACTOR = 4.0
MAX_EXACT_OBSERVATIONS = 4096  # above this, a metric's bootstrap quantiles use a log grid of this many bins


@dataclass
class HttpSide:
    """One side of the experiment: where it is served, and the served model's name (None: the first listed)."""

    url: str
    model: str | None = None
    served: str = "url"  # "url": a server someone runs; "in_process": a local checkpoint served for the run


@dataclass
class HttpWorkload:
    """The [bench] workload as requests: each block sends len(output_lens) prompts of prompt_len tokens."""

    prompt_len: int
    output_lens: list[int]
    concurrency: int
    arrival_rate: float | None = None  # requests/s (Poisson); None: all at once


@dataclass
class SideBlock:
    """One side's run of one block."""

    seconds: float  # wall time from the first request sent to the last response done
    outputs: list[RequestOutput]
    output_tokens: list[int]  # per request: the server's usage, else counted with the tokenizer (0: failed)
    input_tokens: list[int]

    @property
    def errors(self) -> list[str]:
        return [o.error or "failed" for o in self.outputs if not o.success]


@dataclass
class HttpBlock:
    index: int
    first: str  # the side that ran first
    sides: dict[str, SideBlock]


@dataclass
class HttpPairedTrace:
    """Everything the experiment measured (the input of analyze_http)."""

    blocks: list[HttpBlock]
    seconds: float
    budget_s: float
    stopped_by: str  # "budget" or "max_blocks"
    models: dict[str, str]  # side -> served model name
    urls: dict[str, str]
    machine_load: dict = field(default_factory=dict)  # the client's (tokq.machine_load), over the experiment


@contextlib.contextmanager
def serve_checkpoint(checkpoint: Path, name: str, *, max_model_len: int, max_num_seqs: int, dtype: str = "auto",
                     device: str = "cpu") -> Iterator[str]:
    """Serve a local checkpoint with `tokq serve`'s app on 127.0.0.1 (a free port, a thread of this process) for
    the duration of the block; yields its base URL."""
    from tokq.dtypes import compute_dtype_name
    from tokq.engine.checkpoint import load_model
    from tokq.engine.llm_engine import EngineConfig, LLMEngine
    from tokq.engine.tokenizer import load_tokenizer
    from tokq.runtime import resolve_device
    from tokq.serve.app import build_app
    from tokq.serve.testing import serve_in_thread

    dev = resolve_device(str(device))
    tokenizer = load_tokenizer(checkpoint)
    model = load_model(checkpoint, dtype=compute_dtype_name(dtype, dev.type), device=dev)
    engine = LLMEngine(model, EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs), tokenizer)
    with serve_in_thread(build_app(engine, tokenizer, name, root=str(checkpoint))) as url:
        yield url


def block_requests(tokenizer, workload: HttpWorkload, seed: int) -> list[SampleRequest]:
    """Fresh random prompts for one block (a repeated prompt would hit a prefix cache), with its output lengths."""
    from tokq.remote.bench_serve import random_requests

    s = ServeBenchSettings(base_url="-", num_prompts=len(workload.output_lens), random_input_len=workload.prompt_len,
                           random_output_len=1, seed=seed)
    requests = random_requests(tokenizer, s, random.Random(seed))
    for req, n in zip(requests, workload.output_lens, strict=True):
        req.output_len = n
    return requests


def run_paired_http(sides: dict[str, HttpSide], tokenizer, workload: HttpWorkload, *, budget_s: float, seed: int = 0,
                    min_blocks: int = 4, max_blocks: int = 10_000, timeout_s: float = 600.0, retries: int = 8,
                    on_block: Callable[[int, float], None] | None = None) -> HttpPairedTrace:
    """Run blocks of the workload on both sides, alternating which goes first, until `budget_s` is spent (at least
    `min_blocks`; a block is never cut short, and the next starts only when the last one's duration still fits)."""
    from tokq.machine_load import LoadMonitor

    clients = {s: EndpointClient(sides[s].url, timeout_s=timeout_s, retries=retries) for s in SIDES}
    try:
        models = {s: sides[s].model or clients[s].first_model_id() for s in SIDES}
    finally:
        for client in clients.values():
            client.close()
    settings = ServeBenchSettings(base_url="-", max_concurrency=workload.concurrency,
                                  request_rate=workload.arrival_rate or math.inf, seed=seed)

    async def go() -> tuple[list[HttpBlock], str, float, dict]:
        try:
            warm = block_requests(tokenizer, HttpWorkload(workload.prompt_len, [2], 1), seed)[0]
            for s in SIDES:  # first-call costs out of the measurement; a wrong URL or model fails here, in one line
                out = await send_request(clients[s], settings, models[s], warm)
                if not out.success:
                    raise EndpointError(f"{redact(sides[s].url)}: the warm-up request to the {s} failed, nothing was "
                                        f"benchmarked: {out.error}")
            monitor = LoadMonitor()
            blocks: list[HttpBlock] = []
            start = time.perf_counter()
            stopped_by = "max_blocks"
            while len(blocks) < max_blocks:
                elapsed = time.perf_counter() - start
                if len(blocks) >= min_blocks and elapsed + elapsed / len(blocks) > budget_s:
                    stopped_by = "budget"
                    break
                requests = block_requests(tokenizer, workload, seed + 7919 * (len(blocks) + 1))
                order = SIDES if len(blocks) % 2 == 0 else SIDES[::-1]
                ran = {}
                for s in order:
                    # the same arrival gaps on both sides: run_requests seeds them from settings.seed
                    block_settings = replace(settings, seed=seed + len(blocks))
                    outputs, seconds = await run_requests(clients[s], block_settings, models[s], requests)
                    ran[s] = _side_block(requests, outputs, seconds, tokenizer)
                blocks.append(HttpBlock(len(blocks), order[0], ran))
                if on_block:
                    on_block(len(blocks), time.perf_counter() - start)
            return blocks, stopped_by, time.perf_counter() - start, monitor.stop()
        finally:
            for client in clients.values():
                await client.aclose()

    blocks, stopped_by, seconds, load = asyncio.run(go())
    return HttpPairedTrace(blocks, seconds, budget_s, stopped_by, models, {s: redact(sides[s].url) for s in SIDES}, load)


def _side_block(requests: list[SampleRequest], outputs: list[RequestOutput], seconds: float, tokenizer) -> SideBlock:
    out_tokens, in_tokens = [], []
    for req, out in zip(requests, outputs, strict=True):
        n_out = out.output_tokens
        if n_out is None:  # the server reported no usage: count what it sent
            n_out = len(tokenizer(out.generated_text, add_special_tokens=False)["input_ids"])
        out_tokens.append(n_out if out.success else 0)
        in_tokens.append(out.server_prompt_tokens if out.server_prompt_tokens is not None else req.prompt_len)
    return SideBlock(seconds, outputs, out_tokens, in_tokens)


# -- analysis -----------------------------------------------------------------------------------------------------


def _observations(block: SideBlock) -> dict[str, list[float]]:
    """A side's latency observations in one block, in seconds, as vLLM's bench computes them."""
    obs: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": [], "e2el": []}
    for out, n in zip(block.outputs, block.output_tokens, strict=True):
        if not out.success:
            continue
        obs["ttft"].append(out.ttft)
        obs["e2el"].append(out.latency)
        obs["itl"].extend(out.itl)
        if n > 1:
            obs["tpot"].append((out.latency - out.ttft) / (n - 1))
    return obs


def _stalled(blocks: list[HttpBlock]) -> dict[str, list[int]]:
    """Per side, the blocks (list positions) where it stalled (see the module docstring)."""
    secs = {s: np.array([b.sides[s].seconds for b in blocks]) for s in SIDES}
    ratio = float(np.median(secs["variant"] / secs["base"]))
    predicted = {"base": secs["variant"] / ratio, "variant": secs["base"] * ratio}
    return {s: [int(i) for i in np.nonzero((secs[s] > STALL_FACTOR * np.median(secs[s]))
                                           & (secs[s] > STALL_FACTOR * predicted[s]))[0]] for s in SIDES}


def _quantile_grid(values: np.ndarray, block_of: np.ndarray, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, [blocks, values] counts): the observations themselves, or a fine log grid when there are many."""
    if len(values) <= MAX_EXACT_OBSERVATIONS:
        counts = np.zeros((n_blocks, len(values)))
        counts[block_of, np.arange(len(values))] = 1.0
        return values, counts
    lo, hi = np.log(max(values.min(), 1e-9)), np.log(max(values.max(), 1e-9))
    edges = np.linspace(lo, hi + 1e-12, MAX_EXACT_OBSERVATIONS + 1)
    bins = np.clip(np.searchsorted(edges, np.log(np.maximum(values, 1e-9)), side="right") - 1, 0,
                   MAX_EXACT_OBSERVATIONS - 1)
    counts = np.zeros((n_blocks, MAX_EXACT_OBSERVATIONS))
    np.add.at(counts, (block_of, bins), 1.0)
    return np.exp((edges[:-1] + edges[1:]) / 2), counts


def analyze_http(trace: HttpPairedTrace, seed: int = 0, resamples: int | None = None):
    """Metrics per side and variant/base ratios with intervals (a speed_stats.SpeedAnalysis, so the gate's speed
    rules read it as they read the in-process experiment's)."""
    from tokq.evalsuite.speed_stats import (
        LATENCY_METRICS,
        RESAMPLES,
        THROUGHPUT_METRICS,
        SpeedAnalysis,
        ratio_estimate,
        unit_weights,
        weighted_quantile,
    )

    stalls = _stalled(trace.blocks) if trace.blocks else {s: [] for s in SIDES}
    failed = [i for i, b in enumerate(trace.blocks) if any(b.sides[s].errors for s in SIDES)]
    dropped = set(failed) | {i for s in SIDES for i in stalls[s]}
    blocks = [b for i, b in enumerate(trace.blocks) if i not in dropped]
    n = len(blocks)
    weights = unit_weights(np.zeros(n, dtype=np.int64), seed, resamples or RESAMPLES)  # [R, block pairs]
    per_block = {s: [_observations(b.sides[s]) for b in blocks] for s in SIDES}
    metrics: dict[str, dict[str, float]] = {s: {} for s in SIDES}
    boots: dict[str, dict[str, np.ndarray]] = {s: {} for s in SIDES}
    for s in SIDES:
        for name, (kind, what) in LATENCY_METRICS.items():
            values = np.array([v for obs in per_block[s] for v in obs[kind]], dtype=np.float64)
            block_of = np.array([i for i, obs in enumerate(per_block[s]) for _ in obs[kind]], dtype=np.int64)
            if not len(values):
                metrics[s][name] = float("nan")
                continue
            if what == "mean":
                metrics[s][name] = float(values.mean()) * 1e3
                sums, counts = np.bincount(block_of, values, n), np.bincount(block_of, minlength=n).astype(float)
                boots[s][name] = (weights @ sums) / np.maximum(weights @ counts, 1e-300)
            else:
                metrics[s][name] = float(np.percentile(values, what)) * 1e3  # vLLM's percentile
                grid, counts = _quantile_grid(values, block_of, n)
                boots[s][name] = weighted_quantile(grid, weights @ counts, what / 100)
        busy = np.array([b.sides[s].seconds for b in blocks])
        out_tokens = np.array([sum(b.sides[s].output_tokens) for b in blocks], dtype=np.float64)
        in_tokens = np.array([sum(b.sides[s].input_tokens) for b in blocks], dtype=np.float64)
        done = np.array([sum(o.success for o in b.sides[s].outputs) for b in blocks], dtype=np.float64)
        total_busy = float(busy.sum()) or float("nan")
        for name, count in zip(THROUGHPUT_METRICS, (out_tokens, out_tokens + in_tokens, done), strict=True):
            metrics[s][name] = float(count.sum()) / total_busy
            boots[s][name] = (weights @ count) / np.maximum(weights @ busy, 1e-300)
        metrics[s].update(busy_s=float(busy.sum()), completed=int(done.sum()), total_output_tokens=int(
            out_tokens.sum()), total_input_tokens=int(in_tokens.sum()))
    ratios = {name: ratio_estimate(name, metrics, boots["variant"][name] / boots["base"][name], (n, n))
              for name in [*LATENCY_METRICS, *THROUGHPUT_METRICS]
              if name in boots["base"] and name in boots["variant"] and n}
    warnings = _warnings(trace, failed, stalls)
    itl_ms = {s: [round(v * 1e3, 3) for obs in per_block[s] for v in obs["itl"]][:5000] for s in SIDES}
    stall_rows = {s: [{"block": i, "seconds": trace.blocks[i].sides[s].seconds} for i in stalls[s]] for s in SIDES}
    return SpeedAnalysis(metrics, ratios, stall_rows, 0, n, n, warnings, itl_ms, method=(
        "paired over HTTP: blocks of the same requests sent to base and variant by one client, alternating which "
        "goes first; block pairs with a stall (> {f:g}x the side's median block and its pair's prediction) or a "
        "failed request left out; {r} bootstrap resamples of block pairs, t interval of the log ratio with the "
        "bootstrap standard error"))


def _warnings(trace: HttpPairedTrace, failed: list[int], stalls: dict[str, list[int]]) -> list[str]:
    out = []
    if failed:
        first = next(e for i in failed for s in SIDES for e in trace.blocks[i].sides[s].errors)
        out.append(f"{len(failed)} of {len(trace.blocks)} block pairs had a failed request and were left out "
                   f"(first error: {first})")
    n_base, n_var = len(stalls["base"]), len(stalls["variant"])
    if n_var >= n_base + 2 and n_var >= 2 * max(n_base, 1):
        out.append(f"the variant stalled in {n_var} blocks, the base in {n_base}: stalled block pairs are left out "
                   "of the ratios, but a variant that stalls more often may have a real latency problem")
    return out
