"""The paired speed experiment: ratios and intervals from synthetic traces with a known true ratio (coverage,
stall exclusion, a load that drifts during the run), the verdict rule, and the interleaved run on a tiny engine."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokq.config import Rule
from tokq.engine.paired_bench import PairedTrace, PassTrace, StepTrace
from tokq.evalsuite.gate_rules import speed_verdicts
from tokq.evalsuite.speed_stats import STALL_FACTOR, analyze, decide

PREFILL_S, DECODE_S = 0.1, 0.02


def synthetic(rng: np.random.Generator, ratio: float, passes: int = 5, requests: int = 4, gen: int = 30,
              block: int = 4, sigma: float = 0.15, drift: float = 0.4, stall: tuple[int, int, float] | None = None
              ) -> PairedTrace:
    """Passes of one prefill step (every request's first token) then gen - 1 decode steps. Each block has a
    machine-load factor shared by both sides (lognormal, `drift`); each step its own noise (`sigma`). The variant's
    expected step time is `ratio` times the base's, so every mean-time ratio is `ratio` in expectation."""
    out = []
    block_id = 0
    for p in range(passes):
        trace = PassTrace(admitted_at=[0] * requests, prompt_tokens=[64] * requests)
        for j in range(gen):
            if j % block == 0:
                load = math.exp(rng.normal(0, drift))
                trace.first_side.append("base" if block_id % 2 == 0 else "variant")
                block_id += 1
            nominal = PREFILL_S if j == 0 else DECODE_S
            shape = (64 * requests, requests) if j == 0 else (requests, requests)
            for side, scale in (("base", 1.0), ("variant", ratio)):
                seconds = nominal * scale * load * math.exp(rng.normal(0, sigma) - sigma ** 2 / 2)
                if stall and (p, j) == stall[:2] and side == "base":
                    seconds = stall[2]
                trace.steps[side].append(StepTrace(seconds, *shape, list(range(requests))))
            trace.block_of_step.append(block_id - 1)
        out.append(trace)
    return PairedTrace(out, block, 1.0, 1.0, [gen] * requests, "budget")


def test_intervals_cover_the_true_ratio():
    rng = np.random.default_rng(0)
    hits = {"mean_tpot_ms": 0, "output_throughput": 0, "mean_ttft_ms": 0, "mean_e2el_ms": 0}
    runs = 120
    for i in range(runs):
        analysis = analyze(synthetic(rng, 0.6), seed=i, resamples=400)
        for name in hits:
            est = analysis.ratios[name]
            truth = 0.6 if name != "output_throughput" else 1 / 0.6
            hits[name] += est.low <= truth <= est.high
    coverage = {k: v / runs for k, v in hits.items()}
    # prefill has 5 units (one block per pass), decode ~40: the t interval keeps even TTFT near 95%
    assert coverage["mean_tpot_ms"] >= 0.9 and coverage["output_throughput"] >= 0.9, coverage
    assert coverage["mean_e2el_ms"] >= 0.9 and coverage["mean_ttft_ms"] >= 0.88, coverage


def test_pairing_cancels_a_load_that_drifts():
    # a strong shared load drift (each block up to ~3x slower) barely widens the paired interval
    quiet = analyze(synthetic(np.random.default_rng(1), 0.6, drift=0.0), resamples=400).ratios["mean_tpot_ms"]
    busy = analyze(synthetic(np.random.default_rng(1), 0.6, drift=0.6), resamples=400).ratios["mean_tpot_ms"]
    assert busy.ratio == pytest.approx(0.6, rel=0.05) and quiet.ratio == pytest.approx(0.6, rel=0.05)
    assert math.log(busy.high / busy.low) < 2.5 * math.log(quiet.high / quiet.low)


def test_a_stall_is_excluded_and_counted():
    clean = analyze(synthetic(np.random.default_rng(2), 0.6), resamples=400)
    stalled = analyze(synthetic(np.random.default_rng(2), 0.6, stall=(2, 10, 10.0)), resamples=400)
    assert [(x["pass"], x["step"], x["seconds"]) for x in stalled.stalls["base"]] == [(2, 10, 10.0)]
    assert stalled.stalls["base"][0]["typical_s"] * STALL_FACTOR < 10.0 and stalled.stalls["variant"] == []
    assert clean.stalls == {"base": [], "variant": []}  # a load that slows both sides is no stall
    for name in ("mean_tpot_ms", "p99_itl_ms", "output_throughput"):
        assert stalled.ratios[name].ratio == pytest.approx(clean.ratios[name].ratio, rel=0.05), name
    # without the rule the 10 s step would have made the variant look ~2x faster on TPOT
    assert stalled.metrics["base"]["mean_tpot_ms"] < 2 * clean.metrics["base"]["mean_tpot_ms"]


def test_metrics_follow_the_timeline():
    analysis = analyze(synthetic(np.random.default_rng(3), 0.5, sigma=0.0, drift=0.0, passes=2), resamples=50)
    base = analysis.metrics["base"]
    assert base["mean_ttft_ms"] == pytest.approx(PREFILL_S * 1e3)
    assert base["mean_tpot_ms"] == pytest.approx(DECODE_S * 1e3) and base["p99_itl_ms"] == pytest.approx(20.0)
    assert base["mean_e2el_ms"] == pytest.approx((PREFILL_S + 29 * DECODE_S) * 1e3)
    assert base["output_throughput"] == pytest.approx(2 * 4 * 30 / (2 * (PREFILL_S + 29 * DECODE_S)))
    assert analysis.ratios["mean_tpot_ms"].ratio == pytest.approx(0.5)
    assert analysis.ratios["mean_tpot_ms"].low == pytest.approx(0.5) == analysis.ratios["mean_tpot_ms"].high


@pytest.mark.parametrize("value,low,high,direction,result", [
    (1.6, 1.5, 1.7, "min", "pass"), (1.1, 1.05, 1.15, "min", "fail"), (1.22, 1.1, 1.3, "min", "inconclusive"),
    (0.9, 0.8, 1.0, "max", "pass"), (1.5, 1.3, 1.7, "max", "fail"), (1.1, 0.9, 1.3, "max", "inconclusive"),
])
def test_decide(value, low, high, direction, result):
    verdict = decide(value, low, high, 1.2 if direction == "min" else 1.0 if value < 1.3 else 1.2, direction)
    assert verdict.result == result
    assert (verdict.more_time_factor is not None) == (result == "inconclusive")


def test_speed_verdicts_read_the_interval():
    analysis = analyze(synthetic(np.random.default_rng(4), 0.6), resamples=400)
    memory = {"base": {"weights_bytes": 100, "kv_cache_bytes": 60}, "variant": {"weights_bytes": 40,
                                                                                "kv_cache_bytes": 60}}
    rules = [Rule("min_tpot_speedup", "min", 1.2), Rule("min_tpot_speedup", "min", 3.0),
             Rule("max_ttft_ratio", "max", 2.0), Rule("max_weights_ratio", "max", 0.5),
             Rule("max_memory_ratio", "max", 0.5), Rule("max_kv_ratio", "max", 1.0)]
    tpot, impossible, ttft, weights, memory_rule, kv = speed_verdicts(rules, analysis, memory)
    assert tpot["result"] == "pass" and tpot["low"] > 1.2 and tpot["value"] == pytest.approx(1 / 0.6, rel=0.1)
    assert impossible["result"] == "fail" and impossible["high"] < 3.0
    assert ttft["result"] == "pass" and ttft["value"] < 1
    assert weights["result"] == "pass" and weights["value"] == 0.4  # the KV pool does not dilute it
    assert memory_rule["result"] == "fail" and memory_rule["value"] == 100 / 160 and kv["value"] == 1.0
    # a rule the run cannot decide says so, and how much longer a run would need
    close = speed_verdicts([Rule("min_tpot_speedup", "min", tpot["value"] * 1.01)], analysis, memory)[0]
    assert close["result"] == "inconclusive" and close["more_time_factor"] > 1 and not close["passed"]


def test_interleaved_run_on_a_tiny_engine(tmp_path):
    from tests.test_models_vs_hf import make_hf_checkpoint
    from tokq.engine.checkpoint import load_model
    from tokq.engine.paired_bench import paired_engines, run_paired
    from tokq.engine.workload import Workload

    make_hf_checkpoint("llama", tmp_path)
    models = {"base": load_model(tmp_path), "variant": load_model(tmp_path)}
    workload = Workload(prompt_len=40, gen_len=9, num_requests=3, gen_len_range=0.5, seed=0)
    trace = run_paired(paired_engines(models, workload, 2), workload, models["base"].config.vocab_size,
                       budget_s=0.0, block_steps=3)
    # a spent budget still runs min_passes (a timed budget would make the pass count depend on the machine)
    assert len(trace.passes) == 2 and trace.stopped_by == "budget"
    lengths = workload.output_lengths()
    for p in trace.passes:
        base, variant = p.steps["base"], p.steps["variant"]
        assert [(s.tokens, s.seqs, s.emitted) for s in base] == [(s.tokens, s.seqs, s.emitted) for s in variant]
        emitted = [r for s in base for r in s.emitted]
        assert sorted(emitted) == sorted(r for r, n in enumerate(lengths) for _ in range(n))
        assert len(p.block_of_step) == len(base) and sorted(set(p.first_side)) == ["base", "variant"]
    analysis = analyze(trace, resamples=100)
    assert analysis.metrics["base"]["completed"] == 6 and analysis.ratios["mean_tpot_ms"].units > 2
    # an unspent budget stops at max_passes instead
    capped = run_paired(paired_engines(models, workload, 2), workload, models["base"].config.vocab_size,
                        budget_s=1e9, block_steps=3, max_passes=3)
    assert len(capped.passes) == 3 and capped.stopped_by == "max_passes"
