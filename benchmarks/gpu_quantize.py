"""Quantize both zoo models with AWQ and GPTQ on a CUDA GPU; check the result against the CPU benchmark.

    python benchmarks/gpu_quantize.py [--models smollm2-135m,gemma3-270m] [--methods awq,gptq]

Same protocol as quant_quality.py (quant_protocol.py: calibration source, evaluation source, W4
settings), with every block quantized on the GPU and the evaluation run there too. The check:
each method's mean KL on the GPU must be within `--tolerance` (relative) of the CPU run recorded in
results/quant-quality-<model>-cpu.json (GPU and CPU differ in matmul rounding, so the methods'
searches may pick different grid points; the quality must not). Prints a table of times and KLs
and writes results/gpu-quantize.json. Exit status 1 if a check fails or no GPU is present.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quant_protocol import RESULTS, Protocol, base_checkpoint, base_hiddens, evaluate  # noqa: E402
from quant_quality import RUNS, scheme_for  # noqa: E402

from tokq import __version__  # noqa: E402
from tokq.engine.checkpoint import load_model  # noqa: E402
from tokq.quantization.methods.options import MethodOptions  # noqa: E402
from tokq.quantization.pipeline import quantize_model  # noqa: E402
from tokq.reports.json_io import write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--methods", default="awq,gptq")
    ap.add_argument("--tolerance", type=float, default=0.10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU here: this benchmark needs one")
        return 1
    device = torch.device("cuda")
    protocol = Protocol()
    rows = []
    failed = False
    for model_name in args.models.split(","):
        checkpoint = base_checkpoint(model_name)
        cpu_file = RESULTS / f"quant-quality-{model_name}-cpu.json"
        cpu = json.loads(cpu_file.read_text())["runs"] if cpu_file.is_file() else {}
        calibration = protocol.calibration(checkpoint)
        windows, _ = protocol.eval_windows_for(checkpoint)
        base = load_model(checkpoint, dtype="fp32", device=device)
        hiddens = base_hiddens(base, windows)
        for method in args.methods.split(","):
            run = RUNS[method]
            model = load_model(checkpoint, dtype="fp32", device=device)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            quantize_model(model, run.method, scheme_for(run, model_name), calibration, MethodOptions(**run.options))
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            quality = evaluate(base, model, windows, hiddens)
            cpu_kl = cpu.get(method, {}).get("quality", {}).get("kl_mean")
            rel = abs(quality["kl_mean"] - cpu_kl) / cpu_kl if cpu_kl else None
            ok = rel is not None and rel <= args.tolerance
            failed |= not ok
            rows.append({"model": model_name, "method": method, "quantize_seconds": seconds,
                         "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20, "quality": quality,
                         "cpu_kl_mean": cpu_kl, "cpu_seconds": cpu.get(method, {}).get("quantize_seconds"),
                         "kl_rel_diff_vs_cpu": rel, "ok": ok})
            del model
            torch.cuda.empty_cache()
        del base
    print(f"{'model':14s} {'method':6s} {'GPU s':>7s} {'CPU s':>7s} {'KL GPU':>8s} {'KL CPU':>8s} {'rel':>6s} ok")
    for r in rows:
        print(f"{r['model']:14s} {r['method']:6s} {r['quantize_seconds']:7.1f} {r['cpu_seconds'] or float('nan'):7.1f} "
              f"{r['quality']['kl_mean']:8.4f} {r['cpu_kl_mean'] or float('nan'):8.4f} "
              f"{r['kl_rel_diff_vs_cpu'] if r['kl_rel_diff_vs_cpu'] is not None else float('nan'):6.3f} {r['ok']}")
    write_json(RESULTS / "gpu-quantize.json", {
        "benchmark": "gpu_quantize", "tokq_version": __version__, "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "protocol": protocol.to_json(), "tolerance": args.tolerance, "runs": rows,
    })
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
