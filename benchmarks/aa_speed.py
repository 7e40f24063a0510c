"""A/A benchmark of the gate's paired speed experiment: base against a byte-identical copy of itself.

    python benchmarks/aa_speed.py [--model smollm2-135m] [--runs 20] [--seconds 15] [--prompt-len 256]
        [--gen-len 64] [--concurrency 8] [--out PATH]

Two models loaded from the same checkpoint (separate tensors, as a copied folder gives) play a [bench] workload
(default 256-token prompts, 64 tokens, 8 at once: the gate's own 512/256/16 takes over a minute a run on 2 cores)
through engine.paired_bench with the gate's block size, `--runs` times, each analysed as the gate analyses it
(evalsuite.speed_stats). With no real difference every ratio is 1, so a 95%
interval that is honest contains 1.0 in about 95% of runs; a method biased towards one side (the side run first,
the model compiled first, memory placement) shows as intervals that miss 1 far more often than 1 in 20, all on one
side. Writes benchmarks/results/aa-speed-<model>-cpu.json: each run's ratio and interval per metric, the coverage
per metric with its exact (Clopper-Pearson) 95% interval, the load average before and after, the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from scipy.stats import beta

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
METRICS = ("mean_tpot_ms", "output_throughput", "mean_ttft_ms")


def clopper_pearson(hits: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    a = (1 - confidence) / 2
    low = 0.0 if hits == 0 else float(beta.ppf(a, hits, n - hits + 1))
    high = 1.0 if hits == n else float(beta.ppf(1 - a, hits + 1, n - hits))
    return low, high


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=15.0, help="budget of each paired experiment")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reuse-engines", action="store_true",
                    help="one engine pair for every run (a diagnostic: effects of an engine's own allocations then "
                         "repeat from run to run instead of varying)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    from tokq.config import BenchWorkload
    from tokq.engine.checkpoint import load_model
    from tokq.engine.paired_bench import paired_engines, run_paired
    from tokq.engine.workload import Workload
    from tokq.evalsuite.speed_stats import analyze
    from tokq.zoo import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    path = resolve_model(args.model)
    w = BenchWorkload(prompt_len=args.prompt_len, gen_len=args.gen_len, concurrency=args.concurrency)
    models = {"base": load_model(path, dtype="bf16"), "variant": load_model(path, dtype="bf16")}
    runs = []
    engines = None
    for run in range(args.runs):
        workload = Workload(w.prompt_len, w.gen_len, w.num_prompts or w.concurrency, w.gen_len_range, float("inf"),
                            seed=run)
        if engines is None or not args.reuse_engines:
            engines = paired_engines(models, workload, w.concurrency)
        started = time.perf_counter()
        trace = run_paired(engines, workload, models["base"].config.vocab_size, budget_s=args.seconds,
                           block_steps=w.block_steps)
        analysis = analyze(trace, seed=run)
        row = {"run": run, "seconds": time.perf_counter() - started, "passes": len(trace.passes),
               "blocks": analysis.blocks, "load_average": os.getloadavg()[0]}
        for metric in METRICS:
            est = analysis.ratios[metric]
            row[metric] = {"ratio": est.ratio, "low": est.low, "high": est.high, "covers_1": est.low <= 1 <= est.high}
        runs.append(row)
        shown = ", ".join(f"{m} {row[m]['ratio']:.4f} [{row[m]['low']:.4f}, {row[m]['high']:.4f}]" for m in METRICS)
        print(f"run {run + 1}/{args.runs}: {shown}", file=sys.stderr, flush=True)
        if not args.reuse_engines:
            engines = None
    coverage = {}
    for metric in METRICS:
        hits = sum(r[metric]["covers_1"] for r in runs)
        low, high = clopper_pearson(hits, len(runs))
        above = sum(r[metric]["low"] > 1 for r in runs)
        coverage[metric] = {"covers_1": hits, "runs": len(runs), "rate": hits / len(runs),
                            "rate_95ci": [low, high], "misses_above_1": above,
                            "misses_below_1": len(runs) - hits - above,
                            "consistent_with_95": low <= 0.95 <= high}
    result = {"benchmark": "aa_speed", "model": args.model, "reuse_engines": args.reuse_engines,
              "workload": {"prompt_len": w.prompt_len,
              "gen_len": w.gen_len, "concurrency": w.concurrency, "block_steps": w.block_steps,
              "seconds": args.seconds}, "threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine(), "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "coverage": coverage, "runs": runs,
              "notes": "ratios are variant / base (TPOT ms, throughput, TTFT ms) of two copies of the same weights; "
                       "an honest 95% interval covers 1 in ~95% of runs"}
    out = args.out or RESULTS / f"aa-speed-{args.model}-cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(coverage, indent=2))


if __name__ == "__main__":
    main()
