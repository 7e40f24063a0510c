"""The gate's verdict: quality rules on a compare result, speed rules on bench rounds of the base and a variant.

Quality rules use `evalsuite.stats.check_threshold` through compare's own threshold evaluation (a rule
fails when the 95% CI's unfavourable bound crosses it). Speed rules compare the variant with the base
on the same workload, measured in the same run (ratios on a shared, noisy machine), one ratio per round
(base and variant alternate, so slow drifts of the machine hit both):
- min_tpot_speedup: TPOT(base) / TPOT(variant) >= threshold;
- min_throughput_speedup: output tokens/s (variant) / (base) >= threshold;
- max_memory_ratio: (weights + KV cache)(variant) / (base) <= threshold;
- max_weights_ratio: weights(variant) / weights(base) <= threshold (the KV pool left out).
The value is the median ratio, [low, high] the range over rounds. Result: pass when every round meets the
threshold; warn when the median does but some round does not (too close to call on this machine: it does
not block, the table says so); fail when the median misses. So a verdict can only flip between reruns when
the median itself sits at the threshold.
"""

from __future__ import annotations

import statistics

SPEED_MEASURES = {
    "min_tpot_speedup": ("TPOT speedup", lambda base, var: base["metrics"]["tpot_mean_s"] / var["metrics"]["tpot_mean_s"]),
    "min_throughput_speedup": ("throughput speedup",
                               lambda base, var: var["metrics"]["output_tokens_per_s"] / base["metrics"]["output_tokens_per_s"]),
    "max_memory_ratio": ("memory ratio", lambda base, var: (var["model_bytes"] + var["kv_cache_bytes"])
                         / (base["model_bytes"] + base["kv_cache_bytes"])),
    "max_weights_ratio": ("weights ratio", lambda base, var: var["model_bytes"] / base["model_bytes"]),
}


def speed_verdicts(rules, base_rounds: list[dict], variant_rounds: list[dict]) -> list[dict]:
    """One verdict per speed rule (config.Rule: name, direction, threshold) over paired bench rounds."""
    if not base_rounds or len(base_rounds) != len(variant_rounds):
        raise ValueError("speed rules need the same number (>= 1) of base and variant rounds")
    out = []
    for rule in rules:
        label, measure = SPEED_MEASURES[rule.name]
        ratios = [measure(b, v) for b, v in zip(base_rounds, variant_rounds, strict=True)]
        value = statistics.median(ratios)

        def meets(x: float, rule=rule) -> bool:
            return x >= rule.threshold if rule.direction == "min" else x <= rule.threshold

        result = "pass" if all(meets(r) for r in ratios) else ("warn" if meets(value) else "fail")
        sign = (">=" if meets(value) else "<") if rule.direction == "min" else ("<=" if meets(value) else ">")
        note = {"pass": "", "warn": f" (but {sum(not meets(r) for r in ratios)} of {len(ratios)} rounds miss: "
                                    "too close to call here)", "fail": ""}[result]
        out.append({"kind": "speed", "name": rule.name, "metric": label, "bucket": None, "threshold": rule.threshold,
                    "value": value, "low": min(ratios), "high": max(ratios), "rounds": ratios,
                    "result": result, "passed": result != "fail",
                    "rule": f"{label} {value:.3f} (median of {len(ratios)}) {sign} {rule.direction} "
                            f"{rule.threshold}{note}"})
    return out


def quality_thresholds(rules) -> dict[str, dict[str | None, float]]:
    """config.Rule list -> compare's thresholds mapping."""
    out: dict[str, dict[str | None, float]] = {}
    for rule in rules:
        out.setdefault(rule.name, {})[rule.bucket] = rule.threshold
    return out
