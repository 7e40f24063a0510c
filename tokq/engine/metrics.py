"""Serving metrics: per request TTFT and every TBT; per run TPOT, TBT percentiles, throughput, memory, KV use.

Definitions (those of the common serving benchmarks):
- TTFT: arrival of the request to its first generated token.
- TBT: the time between two consecutive generated tokens of one request (every gap is kept).
- TPOT: per request, (last token time - first token time) / (output tokens - 1); the run's TPOT is the
  mean over requests with at least two output tokens.
- throughput: output tokens (and prompt + output tokens) per second of the run's wall time.
"""

from __future__ import annotations

import resource
import statistics
from dataclasses import asdict, dataclass, field

import torch

from tokq.engine.sequence import Sequence
from tokq.serving_metrics import serving_summary


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class RequestMetrics:
    seq_id: int
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int
    preemptions: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    tbts_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @classmethod
    def of(cls, seq: Sequence) -> RequestMetrics:
        times = seq.token_times
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        e2e = None if seq.finish_time is None else seq.finish_time - seq.arrival_time
        return cls(seq.seq_id, seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens,
                   seq.num_preemptions, seq.ttft(), tpot, e2e, seq.tbts(), seq.finish_reason)


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: the most torch has allocated; CPU: the process's peak resident set (weights, cache, buffers)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass
class RunMetrics:
    requests: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    tpot_mean_s: float
    tbt_p50_s: float
    tbt_p95_s: float
    tbt_p99_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    peak_memory_bytes: int
    kv_cache_bytes: int
    kv_peak_usage: float  # most blocks in use at once / all blocks
    kv_waste: float  # allocated-but-unused slots / allocated slots, averaged over steps
    preemptions: int
    prefix_hit_rate: float
    steps: int
    tbt_samples_s: list[float] = field(default_factory=list)  # every TBT of the run (for distributions)
    # the same run under vLLM's names (tokq.serving_metrics): the keys `tokq bench --base-url` reports for a server
    serving: dict = field(default_factory=dict)

    @classmethod
    def of(cls, per_request: list[RequestMetrics], wall_s: float, **extra) -> RunMetrics:
        ttfts = [r.ttft_s for r in per_request if r.ttft_s is not None]
        tpots = [r.tpot_s for r in per_request if r.tpot_s is not None]
        tbts = [t for r in per_request for t in r.tbts_s]
        prompt = sum(r.prompt_tokens for r in per_request)
        output = sum(r.output_tokens for r in per_request)
        return cls(
            requests=len(per_request), wall_s=wall_s, prompt_tokens=prompt, output_tokens=output,
            ttft_mean_s=statistics.fmean(ttfts) if ttfts else float("nan"),
            ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
            tpot_mean_s=statistics.fmean(tpots) if tpots else float("nan"),
            tbt_p50_s=percentile(tbts, 50), tbt_p95_s=percentile(tbts, 95), tbt_p99_s=percentile(tbts, 99),
            tbt_samples_s=tbts,
            output_tokens_per_s=output / wall_s if wall_s else float("nan"),
            total_tokens_per_s=(prompt + output) / wall_s if wall_s else float("nan"),
            serving=serving_summary(
                duration_s=wall_s, completed=len(per_request), failed=0, input_tokens=prompt, output_tokens=output,
                series_s={"ttft": ttfts, "tpot": tpots, "itl": tbts,
                          "e2el": [r.e2e_s for r in per_request if r.e2e_s is not None]}),
            **extra,
        )

    def to_json(self) -> dict:
        return asdict(self)
