"""Do the gate's speed verdicts survive a busy runner? Quiet and busy reruns of the speed experiment, side by side.

    python benchmarks/gate_noise.py [--config tokq_out/tokq.toml] [--runs 10] [--threads N] [--full-gate-runs 1]

Each run is what `tokq gate` does for speed, per variant of the config: load base and variant, play the
[bench] workload as one paired, interleaved experiment within [bench] max_seconds, and decide every speed
rule (pass / fail / inconclusive). Runs alternate quiet and busy; a busy run has a busy-loop process
(`while True: pass`, one core) running beside it for its whole duration. Quality rules are not re-run per
speed run (they are seeded and bit-identical across reruns); `--full-gate-runs K` runs the whole
`tokq gate` K times quiet and K times busy to show that, and that the exit codes agree.

The target (issue 13): for every rule, no run passes while another fails ("inconclusive" is allowed), and
the busy runs' ratio estimates stay within 5% of the quiet runs' (medians over runs compared). Writes
benchmarks/results/gate-noise-<base>-<device>.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def busy_loop() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def speed_run(project, names: list[str], runtime, seed: int) -> dict:
    """One rerun of the gate's speed part for every variant: {variant: {rules, passes, load, stalls}}."""
    from tokq.api.gate import base_checkpoint, variant_target
    from tokq.api.gate_bench import paired_bench
    from tokq.evalsuite.gate_rules import speed_verdicts

    base = base_checkpoint(project)
    out = {}
    for name in names:
        bench = paired_bench(project, variant_target(project, name), base, runtime, seed)
        analysis = bench.pop("_analysis")
        rules = speed_verdicts(project.speed, analysis, bench["memory"])
        out[name] = {"rules": [{k: r.get(k) for k in ("name", "value", "low", "high", "result")} for r in rules],
                     "passes": bench["passes"], "seconds": bench["seconds"], "load": bench["machine_load"],
                     "stalls": {s: bench[s]["stalls"] for s in ("base", "variant")}}
    return out


def full_gate(config: Path, threads: int | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="tokq-gate-noise-") as tmp:
        cmd = [sys.executable, "-m", "tokq", "gate", "--config", str(config), "--out", f"{tmp}/report"]
        if threads:
            cmd += ["--threads", str(threads)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        report_path = Path(tmp) / "report" / "report.json"
        report = json.loads(report_path.read_text()) if report_path.is_file() else None
    rules = [] if report is None else [
        {"variant": n, "kind": r["kind"], "name": r["name"], "bucket": r.get("bucket"), "value": r.get("value"),
         "low": r.get("low"), "high": r.get("high"), "result": r["result"]}
        for n, v in report["variants"].items() for r in v["rules"]]
    return {"exit_code": proc.returncode, "wall_s": time.perf_counter() - start, "rules": rules,
            "stderr_tail": proc.stderr[-1500:] if proc.returncode >= 2 else None}


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    keys = [(v, r["name"]) for v, res in runs[0]["variants"].items() for r in res["rules"]]
    for variant, rule in keys:
        per = {"quiet": [], "busy": []}
        for run in runs:
            r = next(x for x in run["variants"][variant]["rules"] if x["name"] == rule)
            per[run["mode"]].append(r)
        verdicts = {m: sorted({r["result"] for r in rs}) for m, rs in per.items()}
        every = set(verdicts["quiet"]) | set(verdicts["busy"])
        median = {m: statistics.median(r["value"] for r in rs) if rs else None for m, rs in per.items()}
        shift = (median["busy"] / median["quiet"] - 1) if median["quiet"] and median["busy"] else None
        rows.append({"variant": variant, "rule": rule, "verdicts": verdicts,
                     "counts": {m: {v: sum(r["result"] == v for r in rs) for v in ("pass", "fail", "inconclusive")}
                                for m, rs in per.items()},
                     "consistent": not {"pass", "fail"} <= every, "median_value": median,
                     "busy_vs_quiet": shift, "within_5pct": shift is not None and abs(shift) <= 0.05,
                     "intervals": {m: [[round(r["value"], 4), round(r["low"], 4) if r["low"] else None,
                                        round(r["high"], 4) if r["high"] else None] for r in rs]
                                   for m, rs in per.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("tokq_out/tokq.toml"))
    parser.add_argument("--runs", type=int, default=10, help="quiet runs, and as many busy runs")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--full-gate-runs", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="override [bench] max_seconds (a shorter budget is a harder test: wider intervals)")
    args = parser.parse_args()

    from tokq.config import load_project
    from tokq.runtime import setup_runtime

    runtime = setup_runtime(args.threads, "auto", args.seed)
    project = load_project(args.config)
    if args.max_seconds:
        project.bench.max_seconds = args.max_seconds
    names = list(project.variants)
    runs = []
    started = time.perf_counter()
    for i in range(2 * args.runs):
        mode = "quiet" if i % 2 == 0 else "busy"
        loop = busy_loop() if mode == "busy" else None
        try:
            time.sleep(1.0 if loop else 0.0)
            result = speed_run(project, names, runtime, args.seed)
        finally:
            if loop:
                loop.kill()
                loop.wait()
        runs.append({"mode": mode, "variants": result})
        print(f"run {i} ({mode}): " + "; ".join(
            f"{n}: " + ", ".join(f"{r['name']}={r['value']:.3f} [{r['low'] or 0:.3f}, {r['high'] or 0:.3f}] "
                                 f"{r['result']}" for r in res["rules"]) + f" ({res['passes']} passes)"
            for n, res in result.items()), flush=True)
    gates = []
    for i in range(2 * args.full_gate_runs):
        mode = "quiet" if i % 2 == 0 else "busy"
        loop = busy_loop() if mode == "busy" else None
        try:
            gates.append({"mode": mode, **full_gate(args.config, args.threads)})
        finally:
            if loop:
                loop.kill()
                loop.wait()
        print(f"full gate {i} ({mode}): exit {gates[-1]['exit_code']} in {gates[-1]['wall_s']:.0f} s", flush=True)
    rows = summarize(runs)
    import torch

    from tokq import __version__

    quality = None
    if gates:
        q = [[(r["variant"], r["name"], r["bucket"], r["value"], r["low"], r["high"], r["result"])
              for r in g["rules"] if r["kind"] == "quality"] for g in gates]
        quality = {"identical_across_full_gates": all(x == q[0] for x in q), "exit_codes": [g["exit_code"] for g in gates]}
    payload = {"tokq_version": __version__, "config": str(args.config), "runs_per_mode": args.runs,
               "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "runtime": runtime.to_json(),
               "bench": {k: getattr(project.bench, k) for k in ("prompt_len", "gen_len", "concurrency", "max_seconds",
                                                                "block_steps")},
               "busy": "one `while True: pass` process beside each busy run", "seconds": time.perf_counter() - started,
               "summary": rows, "runs": runs, "full_gates": gates, "quality": quality,
               "target_met": all(r["consistent"] for r in rows)
               and all(r["within_5pct"] for r in rows if r["busy_vs_quiet"] is not None)}
    RESULTS.mkdir(exist_ok=True)
    device = "cuda" if runtime.device.startswith("cuda") else "cpu"
    base = Path(project.base).name
    path = RESULTS / f"gate-noise-{base}-{device}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\n{'variant':<10} {'rule':<22} {'quiet p/f/i':<12} {'busy p/f/i':<12} {'quiet med':>9} {'busy med':>9} "
          f"{'shift':>7}  consistent")
    for r in rows:
        c = r["counts"]
        print(f"{r['variant']:<10} {r['rule']:<22} {'/'.join(str(c['quiet'][k]) for k in ('pass', 'fail', 'inconclusive')):<12} "
              f"{'/'.join(str(c['busy'][k]) for k in ('pass', 'fail', 'inconclusive')):<12} "
              f"{r['median_value']['quiet']:>9.3f} {r['median_value']['busy']:>9.3f} "
              f"{(r['busy_vs_quiet'] or 0):>+7.1%}  {r['consistent']}")
    print(f"target met: {payload['target_met']}; wrote {path}")


if __name__ == "__main__":
    main()
