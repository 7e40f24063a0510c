"""`tokq gate` rerun N times on one project: do the verdicts agree?

    python benchmarks/gate_reruns.py [--config tokq_out/tokq.toml] [--runs 5] [--threads N]

Runs the installed CLI (`python -m tokq gate`) as a user's CI would, once per run, each into its own
report folder under a temporary directory. Quality numbers come from seeded windows, bootstrap and probes
(the baseline cache is shared, as in CI); speed is re-measured each run. Writes
benchmarks/results/gate-reruns-<base>-<device>.json: every run's exit code, wall time and per-rule
(value, CI or range, result), and the summary: whether the exit codes, the rule results and the quality
numbers agree, and each speed rule's spread over runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tokq import __version__

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("tokq_out/tokq.toml"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="tokq-gate-reruns-") as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}"
            cmd = [sys.executable, "-m", "tokq", "gate", "--config", str(args.config), "--out", str(out)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - start
            if proc.returncode >= 2:
                sys.exit(f"run {i}: tokq gate exit {proc.returncode}\n{proc.stderr[-2000:]}")
            report = json.loads((out / "report.json").read_text())
            rules = [{"variant": name, **{k: r.get(k) for k in ("kind", "name", "bucket", "value", "low", "high",
                                                                 "result")}}
                     for name, v in report["variants"].items() for r in v["rules"]]
            runs.append({"exit_code": proc.returncode, "wall_s": wall, "rules": rules})
            print(f"run {i}: exit {proc.returncode} in {wall:.0f} s: " + ", ".join(
                f"{r['variant']}:{r['name']}={r['value']:.4g} {r['result']}" for r in rules), flush=True)
    key = [(r["variant"], r["name"], r["bucket"]) for r in runs[0]["rules"]]
    speed = {}
    for k in key:
        values = [next(r for r in run["rules"] if (r["variant"], r["name"], r["bucket"]) == k) for run in runs]
        if values[0]["kind"] == "speed":
            medians = [v["value"] for v in values]
            speed[" ".join(str(x) for x in k if x)] = {
                "median_of_runs": statistics.median(medians), "min": min(medians), "max": max(medians),
                "results": [v["result"] for v in values]}
    summary = {
        "exit_codes": [r["exit_code"] for r in runs],
        "exit_codes_agree": len({r["exit_code"] for r in runs}) == 1,
        "rule_results_agree": len({tuple(r["result"] for r in run["rules"]) for run in runs}) == 1,
        "quality_numbers_identical": len({json.dumps([r for r in run["rules"] if r["kind"] == "quality"])
                                          for run in runs}) == 1,
        "speed": speed,
    }
    print(json.dumps(summary, indent=2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = _base_name(args.config)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"gate-reruns-{name}-{device}.json"
    path.write_text(json.dumps({"tokq_version": __version__, "config": str(args.config),
                                "config_text": args.config.read_text(), "threads": args.threads or torch.get_num_threads(),
                                "device": device, "runs": runs, "summary": summary}, indent=2) + "\n")
    print(f"wrote {path}")


def _base_name(config: Path) -> str:
    from tokq.config import load_project

    return Path(load_project(config).base).name


if __name__ == "__main__":
    main()
