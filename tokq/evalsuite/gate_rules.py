"""The gate's verdict: quality rules on a compare result, speed rules on a paired speed experiment.

Quality rules use `evalsuite.stats.thresholds.check_threshold` through compare's own threshold evaluation
(evalsuite.quality_rules: the same pass / fail / inconclusive policy as the speed rules below). Speed rules read `evalsuite.speed_stats`: the
variant's ratio to the base on one metric, with a 95% bootstrap interval over paired blocks of steps
(base and variant interleaved in one process, see `tokq.engine.paired_bench`):
- min_tpot_speedup: mean TPOT base / variant;
- min_throughput_speedup, min_total_throughput_speedup: output (total) tokens/s variant / base;
- max_ttft_ratio, max_ttft_p50_ratio, max_ttft_p95_ratio: TTFT (mean, median, p95) variant / base;
- max_itl_p95_ratio, max_itl_p99_ratio: inter-token latency percentiles variant / base;
- max_e2el_ratio: mean end-to-end request latency variant / base;
- max_memory_ratio: (weights + KV cache) variant / base; max_weights_ratio: weights alone;
  max_kv_ratio: the KV pool alone (exact byte counts: no interval).
(The rule names and what each measures: `evalsuite.rule_defs`, which tokq.toml's checks read too.)
Result: pass when the whole interval meets the threshold, fail when the whole interval misses it,
inconclusive otherwise (the run could not tell; the rule line says roughly how much longer a run would
need). A stall-free, quiet machine decides most rules in a minute; a noisy one yields "inconclusive"
rather than a verdict that flips between reruns.
"""

from __future__ import annotations

from tokq.evalsuite.rule_defs import MEMORY_MEASURES, SPEED_MEASURES
from tokq.evalsuite.speed_stats import SpeedAnalysis, decide


def speed_verdicts(rules, analysis: SpeedAnalysis, memory: dict[str, dict]) -> list[dict]:
    """One verdict per speed rule (config.Rule: name, direction, threshold).

    `memory`: per side ("base", "variant") {"weights_bytes", "kv_cache_bytes"}."""
    out = []
    for rule in rules:
        if rule.name in MEMORY_MEASURES:
            label, counts = MEMORY_MEASURES[rule.name]
            value = sum(memory["variant"][c] for c in counts) / sum(memory["base"][c] for c in counts)
            ok = value <= rule.threshold if rule.direction == "max" else value >= rule.threshold
            result = "pass" if ok else "fail"
            sign = ("<=" if ok else ">") if rule.direction == "max" else (">=" if ok else "<")
            out.append(_row(rule, label, value, None, None, result,
                            f"{label} {value:.3f} (exact byte counts) {sign} {rule.direction} {rule.threshold}"))
            continue
        label, metric, invert = SPEED_MEASURES[rule.name]
        est = analysis.ratios.get(metric)
        if est is None:
            out.append(_row(rule, label, None, None, None, "inconclusive",
                            f"{label}: the workload produced no {metric} measurement"))
            continue
        value, low, high = (1 / est.ratio, 1 / est.high, 1 / est.low) if invert else (est.ratio, est.low, est.high)
        verdict = decide(value, low, high, rule.threshold, rule.direction)
        text = (f"{label} {value:.3f} [{low:.3f}, {high:.3f}] vs {rule.direction} {rule.threshold}: "
                f"{verdict.text} ({analysis.passes} passes, {est.units} block segments)")
        row = _row(rule, label, value, low, high, verdict.result, text)
        row["metric_name"] = metric
        row["more_time_factor"] = verdict.more_time_factor
        out.append(row)
    return out


def _row(rule, label: str, value, low, high, result: str, text: str) -> dict:
    return {"kind": "speed", "name": rule.name, "metric": label, "bucket": None, "threshold": rule.threshold,
            "direction": rule.direction, "value": value, "low": low, "high": high, "result": result,
            "passed": result == "pass", "rule": text}


def quality_thresholds(rules) -> dict[str, dict[str | None, float]]:
    """config.Rule list -> compare's thresholds mapping."""
    out: dict[str, dict[str | None, float]] = {}
    for rule in rules:
        out.setdefault(rule.name, {})[rule.bucket] = rule.threshold
    return out


def overall_result(results: list[str]) -> str:
    """fail if any rule failed; else inconclusive if any could not be decided; else pass."""
    if "fail" in results:
        return "fail"
    return "inconclusive" if "inconclusive" in results else "pass"
