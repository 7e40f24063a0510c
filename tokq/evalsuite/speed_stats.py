"""Speed ratios with intervals from a paired experiment (`tokq.engine.paired_bench`), and their verdicts.

Input: each side's step times on the same step sequence, passes of the workload, blocks of steps run
back to back on the two sides. Output: the serving metrics of each side, named as vLLM's `bench serve`
names them (mean_ttft_ms, p99_itl_ms, output_throughput, ...), and for every metric the variant's ratio to
the base with a 95% interval.

Stalls. A step is a *stall* when it took more than STALL_FACTOR times the median of that side's steps of
the same shape (phase, sequences, tokens) AND more than STALL_FACTOR times what its pair predicts (the
other side's time for the same step, scaled by the median variant/base ratio of that shape). The second
condition keeps a slowdown that hit both sides (a sustained load: the pairing already cancels it) from
counting as a stall on one side only. A stall (a descheduled process, a page-cache flush, another job's
burst) says nothing about the model; its time is replaced by its pair's prediction before any metric is
computed, and every stall is counted (and listed) in the report, per side. A variant that stalls much more
often than the base gets a warning instead of a silent pass.

Timelines. Each side's metrics come from its own clock (the sum of its cleaned step times in a pass), as if
it had run alone: TTFT from a request's admission to the end of the step that produced its first token,
ITL every gap between two tokens of a request, TPOT (last - first token) / (tokens - 1), E2EL admission to
last token, throughput tokens over busy time. Mean metrics, summed over passes.

Intervals: a bootstrap over block pairs. The resampling unit is one block of steps (split by phase:
prefill and decode segments are resampled separately), drawn with replacement, on both sides at once (the
pair travels together, which is what makes the ratio paired). Mean metrics (mean TTFT/TPOT/ITL/E2EL,
throughput) are weighted means of step times with known coefficients, so each resample reweights the
blocks' step times (the exact block bootstrap of a linear statistic). Percentiles (p50/p95/p99 of TTFT,
ITL, E2EL) are weighted quantiles of the observations, each observation drawn with the block of the step
that ended it. The interval is log ratio ± t(m - 1) · se · sqrt(m / (m - 1)): se the bootstrap standard
error of the log ratio, m the number of units in the smallest stratum the metric draws on (TTFT often rests
on one prefill block per pass: few units, so the t quantile and the small-sample factor widen it where a
percentile interval would not cover). Measured on simulated traces with a known ratio and a drifting load
(tests/test_speed_stats.py; 200 runs each, 8 passes): coverage of the 95% interval 0.93-0.94 for mean TPOT,
0.91-0.92 for mean TTFT, 0.97-0.99 for throughput and E2EL (conservative: they mix both strata), 0.94 for
p99 ITL; with only 3 passes p99 ITL falls to 0.84 (a tail quantile from few blocks), where the percentile
interval gave 0.79-0.86 for TTFT.

Verdict of a rule "ratio >= t" (or <= t): pass when the whole interval is on the right side of t, fail
when the whole interval is on the wrong side, otherwise *inconclusive*: the run could not tell, and the
verdict says roughly how much longer a run would need (interval half-widths shrink as 1/sqrt(time)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tokq.engine.paired_bench import SIDES, PairedTrace

STALL_FACTOR = 4.0
CONFIDENCE = 0.95
RESAMPLES = 2000
VARIANT_STALL_WARNING = 3  # warn when the variant has this many more stalls than the base and twice as many

# metric -> (kind, what): kind "mean" (linear in step times) or a percentile (50, 95, 99)
LATENCY_METRICS = {
    "mean_ttft_ms": ("ttft", "mean"), "median_ttft_ms": ("ttft", 50), "p95_ttft_ms": ("ttft", 95),
    "p99_ttft_ms": ("ttft", 99),
    "mean_tpot_ms": ("tpot", "mean"), "median_tpot_ms": ("tpot", 50), "p95_tpot_ms": ("tpot", 95),
    "mean_itl_ms": ("itl", "mean"), "median_itl_ms": ("itl", 50), "p95_itl_ms": ("itl", 95),
    "p99_itl_ms": ("itl", 99),
    "mean_e2el_ms": ("e2el", "mean"), "median_e2el_ms": ("e2el", 50), "p95_e2el_ms": ("e2el", 95),
}
THROUGHPUT_METRICS = ("output_throughput", "total_token_throughput", "request_throughput")


@dataclass
class RatioEstimate:
    """variant / base of one metric (throughputs and times alike), with its bootstrap interval."""

    metric: str
    base: float
    variant: float
    ratio: float
    low: float
    high: float
    units: int  # block segments the interval resampled
    confidence: float = CONFIDENCE

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in self.__dict__.items()}


@dataclass
class SpeedAnalysis:
    metrics: dict[str, dict[str, float]]  # side -> vLLM-named metric -> value
    ratios: dict[str, RatioEstimate]  # metric -> variant/base ratio
    stalls: dict[str, list[dict]]  # side -> [{pass, step, seconds, typical_s}]
    steps: int
    passes: int
    blocks: int
    warnings: list[str] = field(default_factory=list)
    decode_step_ms: dict[str, list[float]] = field(default_factory=dict)  # cleaned, for the report's histogram
    method: str = ("paired, interleaved blocks of steps; stalls (> {f:g}x the median step of the same shape) "
                   "replaced by its pair's prediction; {r} bootstrap resamples of block segments (prefill and "
                   "decode strata), t interval of the log ratio with the bootstrap standard error")

    def to_json(self) -> dict:
        return {"metrics": self.metrics, "ratios": {k: v.to_json() for k, v in self.ratios.items()},
                "stalls": {s: {"count": len(v), "steps": v[:50]} for s, v in self.stalls.items()},
                "steps": self.steps, "passes": self.passes, "blocks": self.blocks, "warnings": self.warnings,
                "decode_step_ms": self.decode_step_ms,
                "method": self.method.format(f=STALL_FACTOR, r=RESAMPLES)}


@dataclass
class _Flat:
    """Both sides' steps over all passes, flattened (the same step index on both sides)."""

    seconds: dict[str, np.ndarray]  # cleaned step times
    tokens: np.ndarray
    seqs: np.ndarray
    pass_of: np.ndarray
    unit_of: np.ndarray  # resampling unit (block x phase) of each step
    unit_phase: np.ndarray  # per unit: 0 decode, 1 prefill
    first: np.ndarray  # per pass: index of its first step


def analyze(trace: PairedTrace, seed: int = 0, resamples: int = RESAMPLES) -> SpeedAnalysis:
    """Metrics per side, variant/base ratios with intervals, stalls (see the module docstring)."""
    flat, stalls = _flatten(trace)
    obs = _observations(trace, flat)
    metrics = {s: _point_metrics(trace, flat, obs, s) for s in SIDES}
    weights = _unit_weights(flat, seed, resamples)  # [R, units]
    step_w = weights[:, flat.unit_of]  # [R, S]
    ratios: dict[str, RatioEstimate] = {}
    for name, (kind, what) in LATENCY_METRICS.items():
        if not obs[kind]["count"]:
            continue
        if what == "mean":
            coef = obs[kind]["coef"]
            boot = {s: (step_w @ (coef * flat.seconds[s])) / (step_w @ coef) for s in SIDES}
            used = np.unique(flat.unit_of[coef > 0])
        else:
            draws = step_w[:, obs[kind]["anchor"]] * obs[kind]["multiplicity"]
            boot = {s: _weighted_quantile(obs[kind]["values"][s], draws, what / 100) for s in SIDES}
            used = np.unique(flat.unit_of[obs[kind]["anchor"]])
        ratios[name] = _ratio(name, metrics, boot["variant"] / boot["base"], _units(flat, used))
    # throughputs: the same tokens on both sides, so every throughput ratio is busy time base / variant
    busy = {s: step_w @ flat.seconds[s] for s in SIDES}
    for name in THROUGHPUT_METRICS:
        ratios[name] = _ratio(name, metrics, busy["base"] / busy["variant"],
                              _units(flat, np.arange(len(flat.unit_phase))))
    warnings = []
    n_base, n_var = len(stalls["base"]), len(stalls["variant"])
    if n_var >= n_base + VARIANT_STALL_WARNING and n_var >= 2 * max(n_base, 1):
        warnings.append(f"the variant stalled in {n_var} steps, the base in {n_base}: stalls are excluded from "
                        "the ratios, but a variant that stalls more often may have a real latency problem")
    decode = flat.tokens == flat.seqs
    step_ms = {s: [round(float(x) * 1e3, 3) for x in flat.seconds[s][decode][:5000]] for s in SIDES}
    return SpeedAnalysis(metrics, ratios, stalls, len(flat.tokens), len(trace.passes), trace.num_blocks, warnings,
                         step_ms)


def _units(flat: _Flat, used: np.ndarray) -> tuple[int, int]:
    """(units the metric draws on, units of its smallest stratum)."""
    per = [int((flat.unit_phase[used] == phase).sum()) for phase in (0, 1)]
    return len(used), min(m for m in per if m > 0) if any(per) else 0


def _ratio(name: str, metrics: dict, boot: np.ndarray, units: tuple[int, int]) -> RatioEstimate:
    base, var = metrics["base"][name], metrics["variant"][name]
    ratio = var / base if base else float("nan")
    logs = np.log(boot[np.isfinite(boot) & (boot > 0)])
    total, smallest = units
    if len(logs) < 10 or smallest < 2 or not ratio > 0:
        return RatioEstimate(name, base, var, ratio, float("nan"), float("nan"), total)
    from scipy.stats import t

    # bootstrap standard error of the log ratio, corrected for drawing from few units (sqrt(m / (m - 1))), and
    # a t quantile with m - 1 degrees of freedom, m the units of the smallest stratum the metric draws on
    alpha = (1 - CONFIDENCE) / 2
    m = smallest
    half = float(t.ppf(1 - alpha, m - 1)) * float(np.std(logs, ddof=1)) * math.sqrt(m / (m - 1))
    low, high = math.log(ratio) - half, math.log(ratio) + half
    return RatioEstimate(name, base, var, ratio, float(math.exp(low)), float(math.exp(high)), total)


def _flatten(trace: PairedTrace) -> tuple[_Flat, dict[str, list[dict]]]:
    raw = {s: np.array([t.seconds for p in trace.passes for t in p.steps[s]], dtype=np.float64) for s in SIDES}
    base_steps = [t for p in trace.passes for t in p.steps["base"]]
    tokens = np.array([t.tokens for t in base_steps], dtype=np.int64)
    seqs = np.array([t.seqs for t in base_steps], dtype=np.int64)
    pass_of = np.array([i for i, p in enumerate(trace.passes) for _ in p.steps["base"]], dtype=np.int64)
    block = np.array([b for p in trace.passes for b in p.block_of_step], dtype=np.int64)
    prefill = (tokens > seqs).astype(np.int64)
    keys = block * 2 + prefill
    _, unit_of = np.unique(keys, return_inverse=True)
    unit_phase = np.zeros(int(unit_of.max()) + 1 if len(unit_of) else 0, dtype=np.int64)
    unit_phase[unit_of] = prefill
    first = np.concatenate([[0], np.cumsum([len(p.steps["base"]) for p in trace.passes])[:-1]]).astype(np.int64)
    shape = prefill * 1_000_000_000 + seqs * 1_000_000 + np.ceil(np.log2(np.maximum(tokens, 1))).astype(np.int64)
    cleaned, stalls = _clean(raw, shape, pass_of, first)
    return _Flat(cleaned, tokens, seqs, pass_of, unit_of, unit_phase, first), stalls


def _clean(raw: dict[str, np.ndarray], shape: np.ndarray, pass_of: np.ndarray, first: np.ndarray
           ) -> tuple[dict[str, np.ndarray], dict[str, list[dict]]]:
    """Stall steps replaced by what their pair predicts (see the module docstring)."""
    out = {s: raw[s].copy() for s in SIDES}
    stalls: dict[str, list[dict]] = {s: [] for s in SIDES}
    for key in np.unique(shape):
        idx = np.nonzero(shape == key)[0]
        typical = {s: float(np.median(raw[s][idx])) for s in SIDES}
        ratio = float(np.median(raw["variant"][idx] / raw["base"][idx]))  # variant / base on this shape
        predicted = {"base": raw["variant"][idx] / ratio, "variant": raw["base"][idx] * ratio}
        for s in SIDES:
            bad = (raw[s][idx] > STALL_FACTOR * typical[s]) & (raw[s][idx] > STALL_FACTOR * predicted[s])
            for i, guess in zip(idx[bad], predicted[s][bad], strict=True):
                out[s][i] = guess
                p = int(pass_of[i])
                stalls[s].append({"pass": p, "step": int(i - first[p]), "seconds": float(raw[s][i]),
                                  "typical_s": typical[s], "replaced_by_s": float(guess)})
    for s in SIDES:
        stalls[s].sort(key=lambda x: (x["pass"], x["step"]))
    return out, stalls


def _observations(trace: PairedTrace, flat: _Flat) -> dict[str, dict]:
    """Per latency kind: coefficients over steps (mean metrics) and observations with anchor steps (percentiles).

    An observation is a span of steps [lo, hi] (a request's TTFT, one ITL gap, ...); its value on each side is
    that side's cleaned time over the span. Identical spans are merged with a multiplicity (most ITL gaps are
    one decode step shared by every running request). The structure is the same on both sides."""
    n = len(flat.tokens)
    spans: dict[str, dict[tuple[int, int, float], int]] = {k: {} for k in ("ttft", "tpot", "itl", "e2el")}
    coef = {k: np.zeros(n) for k in spans}
    for p, trace_pass in enumerate(trace.passes):
        offset = int(flat.first[p])
        token_steps: dict[int, list[int]] = {}
        for j, step in enumerate(trace_pass.steps["base"]):
            for r in step.emitted:
                token_steps.setdefault(r, []).append(offset + j)

        def add(kind: str, lo: int, hi: int, scale: float = 1.0) -> None:
            coef[kind][lo:hi + 1] += scale
            key = (lo, hi, scale)
            spans[kind][key] = spans[kind].get(key, 0) + 1

        for r, steps in token_steps.items():
            admit = offset + trace_pass.admitted_at[r]
            add("ttft", admit, steps[0])
            add("e2el", admit, steps[-1])
            if len(steps) > 1:
                add("tpot", steps[0] + 1, steps[-1], 1.0 / (len(steps) - 1))
                for prev, cur in zip(steps[:-1], steps[1:], strict=True):
                    add("itl", prev + 1, cur)
    ends = {s: np.concatenate([[0.0], np.cumsum(flat.seconds[s])]) for s in SIDES}  # ends[i + 1]: end of step i
    out = {}
    for kind, found in spans.items():
        keys = list(found)
        lo = np.array([k[0] for k in keys], dtype=np.int64)
        hi = np.array([k[1] for k in keys], dtype=np.int64)
        scale = np.array([k[2] for k in keys], dtype=np.float64)
        out[kind] = {"coef": coef[kind], "anchor": hi, "count": int(sum(found.values())),
                     "multiplicity": np.array([found[k] for k in keys], dtype=np.float64),
                     "values": {s: (ends[s][hi + 1] - ends[s][lo]) * scale for s in SIDES}}
    return out


def _point_metrics(trace: PairedTrace, flat: _Flat, obs: dict, side: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (kind, what) in LATENCY_METRICS.items():
        values, times = obs[kind]["values"][side], obs[kind]["multiplicity"]
        if not len(values):
            out[name] = float("nan")
        elif what == "mean":
            out[name] = float((values * times).sum() / times.sum()) * 1e3
        else:
            out[name] = float(_weighted_quantile(values, times[None, :], what / 100)[0]) * 1e3
    busy = float(flat.seconds[side].sum())
    emitted = int(sum(len(t.emitted) for p in trace.passes for t in p.steps[side]))
    prompt = int(sum(sum(p.prompt_tokens) for p in trace.passes))
    requests = int(sum(len(p.prompt_tokens) for p in trace.passes))
    out.update(output_throughput=emitted / busy, total_token_throughput=(emitted + prompt) / busy,
               request_throughput=requests / busy, busy_s=busy, completed=requests, total_output_tokens=emitted,
               total_input_tokens=prompt)
    return out


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> np.ndarray:
    """Per row of weights [R, M]: the smallest value whose cumulative weight reaches q of the row's total."""
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[:, order]
    cum = np.cumsum(w, axis=1)
    total = cum[:, -1:]
    idx = np.argmax(cum >= q * total - 1e-12, axis=1)
    out = v[idx]
    return np.where(total[:, 0] > 0, out, np.nan)


def _unit_weights(flat: _Flat, seed: int, resamples: int) -> np.ndarray:
    """[R, units]: how often each block segment is drawn in each resample, within its phase stratum."""
    return unit_weights(flat.unit_phase, seed, resamples)


# The HTTP paired bench (tokq.remote.paired_http_bench) resamples its block pairs with these same three pieces:
# one bootstrap for both experiments.
def unit_weights(unit_phase: np.ndarray, seed: int, resamples: int = RESAMPLES) -> np.ndarray:
    """[R, units]: how often each unit is drawn in each resample, within its stratum (unit_phase: 0 or 1)."""
    rng = np.random.default_rng(seed)
    units = len(unit_phase)
    weights = np.zeros((resamples, units), dtype=np.float64)
    for phase in (0, 1):
        members = np.nonzero(unit_phase == phase)[0]
        if not len(members):
            continue
        draws = rng.integers(0, len(members), size=(resamples, len(members)))
        counts = np.zeros((resamples, len(members)))
        np.add.at(counts, (np.arange(resamples)[:, None], draws), 1.0)
        weights[:, members] = counts
    return weights


def ratio_estimate(name: str, metrics: dict, boot: np.ndarray, units: tuple[int, int]) -> RatioEstimate:
    """variant / base of `name` (metrics[side][name]) with the t interval from the bootstrap ratios `boot`;
    `units`: (units drawn on, units of the smallest stratum)."""
    return _ratio(name, metrics, boot, units)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> np.ndarray:
    """Per row of weights [R, M]: the smallest value whose cumulative weight reaches q of the row's total."""
    return _weighted_quantile(values, weights, q)


# Verdicts -------------------------------------------------------------------------------------------


@dataclass
class SpeedVerdict:
    result: str  # pass, fail, inconclusive
    text: str
    more_time_factor: float | None  # inconclusive: roughly how many times longer a run would need


def decide(value: float, low: float, high: float, threshold: float, direction: str) -> SpeedVerdict:
    """pass / fail / inconclusive for `value` [low, high] against `direction` ("min" or "max") `threshold`."""
    if not all(math.isfinite(x) for x in (value, low, high)):
        return SpeedVerdict("inconclusive", "no interval (too few measurements)", None)
    all_meet, some_meet = (low >= threshold, high >= threshold) if direction == "min" else (
        high <= threshold, low <= threshold)
    if all_meet:
        return SpeedVerdict("pass", "the whole 95% interval meets it", None)
    if not some_meet:
        return SpeedVerdict("fail", "the whole 95% interval misses it", None)
    half = (math.log(high) - math.log(low)) / 2
    gap = abs(math.log(value) - math.log(threshold))
    if gap < 1e-9:
        return SpeedVerdict("inconclusive", "the estimate sits at the threshold: no run length decides it", None)
    factor = (half / gap) ** 2
    return SpeedVerdict("inconclusive", f"the 95% interval straddles it: a run about {factor:.1f}x as long "
                                        "would likely decide", factor)
