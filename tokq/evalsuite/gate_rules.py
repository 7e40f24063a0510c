"""The gate's verdict: quality rules on a compare result, speed rules on bench rows of the base and a variant.

Quality rules use `evalsuite.stats.check_threshold` through compare's own threshold evaluation (a rule
fails when the 95% CI's unfavourable bound crosses it). Speed rules compare the variant with the base
on the same workload, measured in the same run (ratios on a shared, noisy machine):
- min_tpot_speedup: TPOT(base) / TPOT(variant) >= threshold;
- min_throughput_speedup: output tokens/s (variant) / (base) >= threshold;
- max_memory_ratio: (weights + KV cache)(variant) / (base) <= threshold.
Speed has no CI here (one run each); the measured ratio is the value.
"""

from __future__ import annotations

SPEED_MEASURES = {
    "min_tpot_speedup": ("TPOT speedup", lambda base, var: base["metrics"]["tpot_mean_s"] / var["metrics"]["tpot_mean_s"]),
    "min_throughput_speedup": ("throughput speedup",
                               lambda base, var: var["metrics"]["output_tokens_per_s"] / base["metrics"]["output_tokens_per_s"]),
    "max_memory_ratio": ("memory ratio", lambda base, var: (var["model_bytes"] + var["kv_cache_bytes"])
                         / (base["model_bytes"] + base["kv_cache_bytes"])),
}


def speed_verdicts(rules, base_row: dict, variant_row: dict) -> list[dict]:
    """One verdict per speed rule (config.Rule: name, direction, threshold)."""
    out = []
    for rule in rules:
        label, measure = SPEED_MEASURES[rule.name]
        value = measure(base_row, variant_row)
        passed = value >= rule.threshold if rule.direction == "min" else value <= rule.threshold
        sign = (">=" if passed else "<") if rule.direction == "min" else ("<=" if passed else ">")
        out.append({"kind": "speed", "name": rule.name, "metric": label, "bucket": None, "threshold": rule.threshold,
                    "value": value, "low": None, "high": None, "passed": passed,
                    "rule": f"{label} {value:.3f} {sign} {rule.direction} {rule.threshold}"})
    return out


def quality_thresholds(rules) -> dict[str, dict[str | None, float]]:
    """config.Rule list -> compare's thresholds mapping."""
    out: dict[str, dict[str | None, float]] = {}
    for rule in rules:
        out.setdefault(rule.name, {})[rule.bucket] = rule.threshold
    return out
