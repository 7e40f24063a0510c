"""Can a quality rule be decided by the sample it will get? Checked when tokq.toml loads, before any work.

A rule that cannot pass whatever the candidate does, or cannot fail, is a ConfigError naming its line:
- range: every quality metric lives in a known range (a flip rate, top-1 agreement and RMS Δp in [0, 1],
  KL and its quantiles >= 0 and below twice float32's largest value, a perplexity ratio > 0; speed and memory
  ratios > 0); a limit beyond the range's far end can never fail (max_flip_rate = 1, min_top1 = 0,
  max_kl = 1e308, min_tpot_speedup = 0), one beyond its near end can never pass (max_kl = -1, min_top1 = 1.5);
- probes (threshold_on = "bound" only): `max_flip_rate` decides on the exact (Clopper-Pearson) upper 95% bound of the
  flip rate over n probes. Its best case, no flip at all, has upper bound 1 - (alpha/2)^(1/n): 0.52 for
  5 probes, so a 0.25 limit cannot pass below 13 probes. n is the grid `tokq compare` will run
  (longctx.probes.probe_grid: contexts x depths x repeats), computed by the same function;
- documents (threshold_on = "bound" only): a mean's interval needs two documents; sample_windows = 1 scores one.

With threshold_on = "point" a rule decides on the estimate, which any sample can put on either side of a limit
inside the range, so only the range check applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokq.evalsuite.stats.estimate import DEFAULT_CONFIDENCE

# rule name -> (lowest, highest) value its metric can take, and whether those ends are attained
# (a perplexity ratio exp(mean ΔNLL) is never 0).
# A token's KL is a sum of p (log p - log q) over float32 log-probabilities, so it is at most twice float32's
# largest value: a max_kl at or above that (1e308 was accepted) passes any pair of models, however broken.
KL_CEILING = 2 * 3.4028234663852886e38
RULE_RANGES: dict[str, tuple[float, float, bool]] = {
    "max_kl": (0.0, KL_CEILING, True), "max_kl_p90": (0.0, KL_CEILING, True), "max_kl_p95": (0.0, KL_CEILING, True),
    "max_kl_p99": (0.0, KL_CEILING, True), "max_kl_p999": (0.0, KL_CEILING, True),
    "min_top1": (0.0, 1.0, True), "max_ppl_ratio": (0.0, math.inf, False), "max_flip_rate": (0.0, 1.0, True),
    "max_rms_delta_p": (0.0, 1.0, True),
}
# Speed and memory rules read ratios of positive measurements (times, token rates, byte counts): above 0, never 0.
SPEED_RULE_RANGE = (0.0, math.inf, False)
# rules decided on a token-weighted mean's interval (a quantile's resampling needs two documents too)
DOCUMENT_RULES = {"max_kl", "max_kl_p90", "max_kl_p95", "max_kl_p99", "max_kl_p999", "min_top1", "max_ppl_ratio",
                  "max_rms_delta_p"}


@dataclass(frozen=True)
class Sample:
    """What one data set (or one `tokq compare` run) gives a rule to decide on, and how to get more."""

    name: str  # "[data.default]", "this run"
    probes: int  # retrieval probes compare will run (0: none)
    documents: int | None  # the documents scored, or an upper bound the config sets (sample_windows); None: unknown
    more_probes: str = "raise probe_repeats / probe_depths (or probe_max_context)"
    more_documents: str = "raise sample_windows"


def probes_to_pass(threshold: float, confidence: float = DEFAULT_CONFIDENCE) -> int | None:
    """The fewest probes whose best case (no flip) has an exact upper bound <= threshold; None: no number does."""
    if threshold <= 0.0:
        return None
    if threshold >= 1.0:
        return 1
    alpha = 1.0 - confidence
    n = math.ceil(math.log(alpha / 2) / math.log(1.0 - threshold))
    # guard the float rounding of the closed form with the bound itself: 1 - (alpha/2)^(1/n) <= threshold
    while n > 1 and 1.0 - (alpha / 2) ** (1.0 / (n - 1)) <= threshold:
        n -= 1
    while 1.0 - (alpha / 2) ** (1.0 / n) > threshold:
        n += 1
    return n


def undecidable(name: str, direction: str, threshold: float, on: str, sample: Sample | None,
                confidence: float = DEFAULT_CONFIDENCE, ranges: dict | None = None) -> str | None:
    """Why the rule `name` (direction "max"/"min") cannot be decided on `sample`, or None when it can.
    `ranges`: the metrics' ranges (default RULE_RANGES, the quality rules')."""
    lowest, highest, attained = (ranges or RULE_RANGES).get(name, (-math.inf, math.inf, True))
    if direction == "max":
        if threshold >= highest:
            return f"= {threshold:g} cannot fail: the metric is at most {highest:g}; lower the limit, or drop the rule"
        if threshold < lowest or (threshold == lowest and not attained):
            return f"= {threshold:g} cannot pass: the metric is {'at least' if attained else 'above'} {lowest:g}; " \
                   "raise the limit"
    else:
        if threshold <= lowest:
            return (f"= {threshold:g} cannot fail: the metric is {'at least' if attained else 'above'} {lowest:g}; "
                    "raise the limit, or drop the rule")
        if threshold > highest:
            return f"= {threshold:g} cannot pass: the metric is at most {highest:g}; lower the limit"
    if on != "bound" or sample is None:
        return None
    pct = f"{confidence * 100:g}%"
    if name == "max_flip_rate":
        needed = probes_to_pass(threshold, confidence)
        if needed is None or sample.probes < needed:
            best = 1.0 - ((1.0 - confidence) / 2) ** (1.0 / sample.probes) if sample.probes else 1.0
            return (f"= {threshold:g} cannot pass with the {sample.probes} retrieval probes of {sample.name}: even "
                    f"with no flip the exact upper {pct} bound is {best:.2f}; it needs at least {needed} probes "
                    f"(has {sample.probes}): {sample.more_probes}, or raise the threshold")
    if name in DOCUMENT_RULES and sample.documents is not None and sample.documents < 2:
        return (f"= {threshold:g} cannot pass with the {sample.documents} document of {sample.name}: one document "
                f"gives no {pct} interval; it needs at least 2 documents (has 1): {sample.more_documents}")
    return None


def check_thresholds(thresholds: dict[str, dict[str | None, float]], directions: dict[str, str], on: str,
                     sample: Sample) -> None:
    """`tokq compare`'s thresholds (name -> {bucket: value}) against the run's sample: a ConfigError naming the
    option for the first one the run could not decide."""
    from tokq.errors import ConfigError

    for name, per_bucket in thresholds.items():
        for bucket, value in per_bucket.items():
            reason = undecidable(name, directions[name], value, on, sample)
            if reason is not None:  # "--max-flip-rate 0.25 cannot pass ...", "--max-kl 4K-8K=-1 cannot pass ..."
                where = "" if bucket is None else f"{bucket}="
                raise ConfigError(f"--{name.replace('_', '-')} {where}{reason.removeprefix('= ')}")


def check_project(project) -> None:
    """Raise a ConfigError (file:line of the rule) for the first rule of a loaded tokq.toml that no run could
    decide: a quality rule on any of its data sets (see the module docstring), or a speed rule outside its
    ratio's range (min_tpot_speedup = 0 cannot fail)."""
    from tokq.longctx.probes import probe_grid

    samples = [Sample(f"[data.{d.name}]", probe_grid(d.window, d.probe_max_context, d.probe_depths,
                                                     d.probe_repeats).size, d.sample_windows)
               for d in project.data.values()]
    for rule in project.speed:
        reason = undecidable(rule.name, rule.direction, rule.threshold, "point", None,
                             ranges={rule.name: SPEED_RULE_RANGE})
        if reason is not None:
            raise project.error("gate.speed", rule.name, reason)
    for rule in project.quality:
        for sample in samples or [None]:
            reason = undecidable(rule.name, rule.direction, rule.threshold, project.threshold_on, sample)
            if reason is not None:
                raise project.error("gate.quality", rule.name, reason if rule.bucket is None else
                                    f"({rule.bucket}) {reason}")
