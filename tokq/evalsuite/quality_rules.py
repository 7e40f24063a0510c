"""Quality rules on a compare result: each threshold against its estimate and 95% interval (pass, fail or
inconclusive, never a pass on missing evidence), and the finite_scores rule that fails a model with NaN or inf
scores. One policy with the speed rules: pass when the whole interval meets the threshold, fail when the whole
interval misses it, inconclusive when it holds the threshold (with about how much more data would decide)."""

from __future__ import annotations

import math

from tokq.errors import DataError
from tokq.evalsuite.full_kl import lower_bound_verdict
from tokq.evalsuite.rule_defs import KL_TAIL_METRICS, THRESHOLD_METRICS
from tokq.evalsuite.stats.thresholds import check_threshold, more_data_note, straddles


def finite_rules(result: dict) -> list[dict]:
    """A failing rule for each model whose scores are NaN or inf on any token: a broken build (a bad checkpoint,
    an overflowing dtype). Every figure is NaN there and NaN fails no threshold, so without this rule such a run
    would read as a pass, or as inconclusive under thresholds; a gate must block it."""
    counts = result.get("non_finite") or {}
    rows = []
    for side in ("a", "b"):
        n = counts.get(f"{side}_tokens", 0)
        if n:
            rows.append({"name": "finite_scores", "metric": "non_finite_tokens", "bucket": None, "threshold": 0,
                         "value": n, "low": None, "high": None, "passed": False,
                         "rule": f"model {side.upper()} ({result[side]['name']}) produced non-finite logits (NaN or "
                                 f"inf) on {n} of {counts['scored_tokens']} scored tokens: a broken build"})
    return rows


def evaluate_thresholds(result: dict, thresholds: dict[str, dict[str | None, float]], on: str = "bound") -> list[dict]:
    """Each threshold against the prefill path's estimate (overall or per bucket): it passes when the 95% CI's
    unfavourable bound is within it, fails when the whole CI is beyond it, and is inconclusive when the CI holds
    it (on="point": the estimate alone decides pass or fail). The flip rate's CI is the
    exact Clopper-Pearson interval over the probes. A rule the data cannot decide is inconclusive, never a
    pass: no probes ran, too few probes to pass even with no flip (`power.probes_to_pass`), one document (no
    interval), or a KL figure that is only a lower bound (full_kl.lower_bound_verdict)."""
    from tokq.evalsuite.power import probes_to_pass
    from tokq.evalsuite.stats.estimate import Estimate

    kl_kind = ((result.get("kl_estimator") or {}).get("prefill") or {}).get("kind")
    broken = any((result.get("non_finite") or {}).get(key) for key in ("a_tokens", "b_tokens"))
    out = []
    for name, per_bucket in thresholds.items():
        metric, direction = THRESHOLD_METRICS[name]
        for bucket, value in per_bucket.items():
            row = {"name": name, "metric": metric, "bucket": bucket, "threshold": value}
            if metric == "flip_rate":
                probes = result.get("probes")
                if not probes:
                    out.append({**row, "bucket": None, "passed": False, "inconclusive": True,
                                "rule": "no retrieval probes ran (no documents for them, or --no-probes): the flip "
                                        "rate is not shown (inconclusive)"})
                    continue
                ci = (probes.get("intervals") or {}).get("flip_rate")
                est = Estimate(**{k: ci[k] for k in ("value", "low", "high", "n_tokens", "n_docs")}) if ci else \
                    Estimate(probes["flip_rate"], probes["flip_rate"], probes["flip_rate"], probes["n"], probes["n"])
                needed = probes_to_pass(value)
                check = check_threshold(est, value, direction, metric, None, on)
                too_few = needed is None or probes["n"] < needed
                if on == "bound" and not check.passed and est.low <= value and too_few:
                    out.append({**row, "bucket": None, "passed": False, "inconclusive": True, **_interval(est),
                                "rule": f"{check.rule} over {probes['n']} probes; even no flip could not pass: it "
                                        f"needs at least {needed} probes (inconclusive)"})
                    continue
                if on == "bound" and not check.passed and straddles(est, value, direction):
                    out.append({**row, "bucket": None, **_straddling(est, value, check.rule, "probes")})
                    continue
                out.append({**row, "bucket": None, "passed": check.passed, **_interval(est),
                            "rule": f"{check.rule} (exact, {probes['n']} probes)"})
                continue
            source = result["prefill"]["overall"] if bucket is None else result["prefill"]["buckets"].get(bucket)
            if source is None or metric not in source:
                known = ", ".join(result["prefill"]["buckets"])
                raise DataError(f"--{name.replace('_', '-')} names bucket {bucket!r}, which these windows do not "
                                f"reach (buckets: {known})")
            entry = source[metric]
            # JSON writes an infinite bound (one document: no interval) as null
            low = -math.inf if entry["low"] is None else entry["low"]
            high = math.inf if entry["high"] is None else entry["high"]
            est = Estimate(math.nan if entry["value"] is None else entry["value"], low, high, entry["n_tokens"],
                           entry["n_docs"])
            if broken and not math.isfinite(est.value):  # not "no interval": finite_scores says why
                out.append({**row, "passed": False, "inconclusive": True, **_interval(est),
                            "rule": f"{metric} is not a number: the scores hold NaN or inf (see finite_scores)"})
                continue
            lower_bound = (metric == "kl" and kl_kind == "lower_bound") or (metric in KL_TAIL_METRICS and kl_kind
                                                                              not in (None, "exact"))
            if lower_bound:
                out.append({**row, **_interval(est), **lower_bound_verdict(est, value, on)})
                continue  # a lower bound can show a regression, never its absence
            check = check_threshold(est, value, direction, metric, bucket, on)
            if not check.passed and math.isinf(check.bound_used):
                out.append({**row, "passed": False, "inconclusive": True, **_interval(est),
                            "rule": f"{est.n_docs} document gives no interval for {metric}; {direction} {value:.4g} "
                                    "not shown (inconclusive)"})
                continue
            if on == "bound" and not check.passed and straddles(est, value, direction):
                out.append({**row, **_straddling(est, value, check.rule, "documents")})
                continue
            out.append({**row, "passed": check.passed, **_interval(est), "rule": check.rule})
    return out


def _straddling(est, threshold: float, rule: str, unit: str) -> dict:
    """An inconclusive row for an interval that holds the threshold: neither a pass nor a regression shown (the
    speed rules' policy too, evalsuite.speed_stats.decide)."""
    note, factor = more_data_note(est, threshold, unit)
    return {"passed": False, "inconclusive": True, "more_data_factor": factor, **_interval(est),
            "rule": f"{rule}, but the 95% interval [{est.low:.4g}, {est.high:.4g}] holds the threshold: "
                    f"inconclusive ({note})"}


def _interval(est) -> dict:
    """value / low / high of a threshold row, an infinite or missing bound as None (strict JSON)."""
    return {key: (float(x) if x is not None and math.isfinite(x) else None)
            for key, x in (("value", est.value), ("low", est.low), ("high", est.high))}
