"""Serving metrics under vLLM's names (`vllm bench serve`): one schema for `tokq bench` on tokq's engine and
`tokq bench --base-url` against a server.

Latencies are in milliseconds, per metric `mean_<m>_ms`, `median_<m>_ms`, `std_<m>_ms` and `p<q>_<m>_ms` for m in
ttft (time to first token), tpot (time per output token after the first, per request), itl (inter-token latency:
every gap between consecutive tokens) and e2el (end-to-end latency); totals and throughputs as vLLM names them.
A leaf module: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (99.0,)


def latency_stats(values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean / median / std / p<q> of `values_s` (seconds) in milliseconds; an empty series counts as one 0 (vLLM)."""
    import numpy as np

    arr = np.asarray(list(values_s) or [0.0], dtype=float) * 1000
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    out |= {f"p{int(p) if int(p) == p else p}": float(np.percentile(arr, p)) for p in percentiles}
    return out


def serving_summary(*, duration_s: float, completed: int, failed: int, input_tokens: int, output_tokens: int,
                    series_s: dict[str, Sequence[float]], percentiles: Iterable[float] = DEFAULT_PERCENTILES,
                    metrics: Iterable[str] = METRICS) -> dict[str, float]:
    """vLLM's result keys from a run's totals and its latency series (seconds, keyed by METRICS names)."""
    percentiles = list(percentiles)
    out = {"duration": duration_s, "completed": completed, "failed": failed,
           "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
           "request_throughput": completed / duration_s if duration_s else float("nan"),
           "output_throughput": output_tokens / duration_s if duration_s else float("nan"),
           "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s else float("nan")}
    for metric in metrics:
        for stat, value in latency_stats(series_s[metric], percentiles).items():
            out[f"{stat}_{metric}_ms"] = value
    return out
