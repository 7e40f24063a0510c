"""The gate's rule names and what each one measures: the one table that tokq.toml's checks (tokq.config),
compare's thresholds (evalsuite.compare) and the speed verdicts (evalsuite.gate_rules) all read.

Light on purpose (no torch, no numpy): `tokq init` and tokq.toml parsing import it.
"""

from __future__ import annotations

# Quality rules: name -> (aggregate metric of evalsuite.compare, direction). A threshold passes when the 95%
# CI's unfavourable bound is within it ("max": the metric must stay at or below it, "min": at or above), fails
# when the whole CI is beyond it, and is inconclusive when the CI holds it (evalsuite.quality_rules).
THRESHOLD_METRICS = {"max_kl": ("kl", "max"), "min_top1": ("top1", "min"), "max_ppl_ratio": ("ppl_ratio", "max"),
                     "max_flip_rate": ("flip_rate", "max"),
                     "max_kl_p90": ("kl_p90", "max"), "max_kl_p95": ("kl_p95", "max"), "max_kl_p99": ("kl_p99", "max"),
                     "max_kl_p999": ("kl_p999", "max"), "max_rms_delta_p": ("rms_delta_p", "max")}
# Per-token KL quantiles: a lower bound unless every token's KL is exact (evalsuite.compare._kl_tails_from).
KL_TAIL_METRICS = {"kl_p90", "kl_p95", "kl_p99", "kl_p999"}
# Metrics that are not split by position: the retrieval probes' flip rate is one number per run.
UNBUCKETED_METRICS = {"flip_rate"}
# The quality rules that therefore take one number, never { overall = ..., "BUCKET" = ... }.
UNBUCKETED_RULES = {name for name, (metric, _) in THRESHOLD_METRICS.items() if metric in UNBUCKETED_METRICS}

# Speed rules on the paired speed experiment (evalsuite.speed_stats): the variant against the base on the
# [bench] workload. name -> (label, metric in speed_stats, invert: the rule reads base / variant, so a time
# becomes a speedup). "speedup" rules: higher is better; "ratio" rules: variant / base, lower is better.
SPEED_MEASURES = {
    "min_tpot_speedup": ("TPOT speedup", "mean_tpot_ms", True),
    "min_throughput_speedup": ("output throughput speedup", "output_throughput", False),
    "min_total_throughput_speedup": ("total throughput speedup", "total_token_throughput", False),
    "max_ttft_ratio": ("mean TTFT ratio", "mean_ttft_ms", False),
    "max_ttft_p50_ratio": ("median TTFT ratio", "median_ttft_ms", False),
    "max_ttft_p95_ratio": ("p95 TTFT ratio", "p95_ttft_ms", False),
    "max_itl_p95_ratio": ("p95 ITL ratio", "p95_itl_ms", False),
    "max_itl_p99_ratio": ("p99 ITL ratio", "p99_itl_ms", False),
    "max_e2el_ratio": ("mean E2E latency ratio", "mean_e2el_ms", False),
}
# Memory rules: exact byte counts, variant / base. name -> (label, the byte counts summed on each side).
MEMORY_MEASURES = {
    "max_memory_ratio": ("memory ratio (weights + KV)", ("weights_bytes", "kv_cache_bytes")),
    "max_weights_ratio": ("weights ratio", ("weights_bytes",)),
    "max_kv_ratio": ("KV cache ratio", ("kv_cache_bytes",)),
}


def _direction(name: str) -> str:
    """A speed rule's direction is its name's prefix: min_tpot_speedup -> "min"."""
    prefix = name.partition("_")[0]
    if prefix not in ("min", "max"):  # a new rule named otherwise would silently get the wrong direction
        raise ValueError(f"speed rule {name!r} must be named min_... or max_...")
    return prefix


# rule -> "max" or "min", as tokq.toml's [gate.quality] / [compare.thresholds] and [gate.speed] take them
QUALITY_RULES = {name: direction for name, (_, direction) in THRESHOLD_METRICS.items()}
SPEED_RULES = {name: _direction(name) for name in (*SPEED_MEASURES, *MEMORY_MEASURES)}

# Position buckets are powers of two from 512: quality loss from quantization or KV compression
# typically grows with distance into the context, and doubling widths keep every bucket populated
# with comparable numbers of tokens per octave of context length.
POSITION_BUCKETS: list[tuple[int, int, str]] = [
    (0, 512, "0-511"),
    (512, 1024, "512-1K"),
    (1024, 2048, "1K-2K"),
    (2048, 4096, "2K-4K"),
    (4096, 8192, "4K-8K"),
    (8192, 16384, "8K-16K"),
    (16384, 32768, "16K-32K"),
    (32768, 65536, "32K-64K"),
    (65536, 131072, "64K-128K"),
]
