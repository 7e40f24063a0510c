"""Quality and cost of tokq's quantization methods on a real model, against its fp32 base.

    python benchmarks/quant_quality.py --model smollm2-135m [--methods rtn,awq,gptq,...] [--threads 2]

For each method: load the base checkpoint in fp32, quantize it in memory (calibrated on the
protocol's calibration source, see quant_protocol.py), and compare it with the base on the
protocol's *different* evaluation source: mean / p50 / p99 per-token KL(base‖quant) over the full
vocabulary, top-1 agreement, perplexity ratio. Also quantization wall time and peak RSS (sampled
from /proc while the method runs, so each method gets its own peak in one process).

Targets the issue states, checked and written into the JSON (`targets`):
- AWQ and GPTQ each reach >= 25% lower mean KL than RTN at the same W4 scheme;
- SmoothQuant W8A8 reaches lower mean KL than W8A8 without smoothing (RTN at w8a8-int8);
- GPTQ and AWQ on SmolLM2-135M finish within 10 minutes each on this CPU.
Writes benchmarks/results/quant-quality-<model>-<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quant_protocol import MODELS, RESULTS, Protocol, base_checkpoint, base_hiddens, evaluate  # noqa: E402

from tokq import __version__  # noqa: E402
from tokq.engine.checkpoint import load_model  # noqa: E402
from tokq.quantization.methods.options import MethodOptions  # noqa: E402
from tokq.quantization.pipeline import quantize_model  # noqa: E402
from tokq.quantization.scheme import preset  # noqa: E402
from tokq.reports.json_io import write_json  # noqa: E402


@dataclass(frozen=True)
class Run:
    """One row of the benchmark: a method, its scheme and options."""

    name: str
    method: str
    scheme: str  # "w4" = the model's W4 setting from quant_protocol.MODELS, else a preset name
    options: dict = field(default_factory=dict)


RUNS = {
    r.name: r
    for r in (
        Run("rtn", "rtn", "w4"),
        Run("awq", "awq", "w4"),
        Run("gptq", "gptq", "w4"),  # tokq's default: static-group act-order
        Run("gptq-no-actorder", "gptq", "w4", {"act_order": False}),
        Run("w8a8-int8-rtn", "rtn", "w8a8-int8"),
        Run("smoothquant", "smoothquant", "w8a8-int8"),
        Run("smoothquant-search", "smoothquant", "w8a8-int8", {"alpha": None}),
        Run("fp8", "fp8", "w8a8-fp8"),
        Run("fp8-smoothquant", "smoothquant", "w8a8-fp8"),  # SmoothQuant's migration, then FP8 W8A8
        Run("fp8-weight-only", "fp8", "fp8-weight-only"),
    )
}
DEFAULT_RUNS = "rtn,awq,gptq,w8a8-int8-rtn,smoothquant,fp8,fp8-weight-only"


class PeakRSS:
    """Samples this process's resident set size from /proc every few ms while open; keeps the max."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self.start = self._rss()
        self.peak = self.start
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def scheme_for(run: Run, model: str):
    if run.scheme != "w4":
        return preset(run.scheme)
    setting = MODELS[model]
    scheme = preset(setting.scheme).with_weights(group_size=setting.group_size)
    return replace(scheme, name=f"{scheme.name}-g{setting.group_size}")


def targets(rows: dict[str, dict], model: str) -> dict:
    kl = {name: row["quality"]["kl_mean"] for name, row in rows.items()}
    out: dict = {}
    for method in ("awq", "gptq"):
        if method in kl and "rtn" in kl:
            reduction = 1 - kl[method] / kl["rtn"]
            out[f"{method}_kl_reduction_vs_rtn"] = {"value": reduction, "target": ">= 0.25", "met": reduction >= 0.25}
        if method in rows and model == "smollm2-135m":
            secs = rows[method]["quantize_seconds"]
            out[f"{method}_minutes"] = {"value": secs / 60, "target": "<= 10", "met": secs <= 600}
    peer_file = RESULTS / f"peer-quant-{model}.json"
    if peer_file.is_file():  # llm-compressor's FP8_DYNAMIC on the same model, judged by the same evaluator
        peer = json.loads(peer_file.read_text()).get("methods", {}).get("fp8", {}).get("peer", {}).get("summary")
        for name in ("fp8", "fp8-smoothquant"):
            if peer and name in kl:
                out[f"{name}_vs_llmcompressor_fp8_dynamic"] = {
                    "value": kl[name] / peer["kl_mean"], "peer_kl_mean": peer["kl_mean"], "target": "<= 1",
                    "met": kl[name] <= peer["kl_mean"]}
    if "smoothquant" in kl and "w8a8-int8-rtn" in kl:
        out["smoothquant_vs_plain_w8a8"] = {"value": kl["smoothquant"] / kl["w8a8-int8-rtn"], "target": "< 1",
                                            "met": kl["smoothquant"] < kl["w8a8-int8-rtn"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--methods", default=DEFAULT_RUNS, help=f"comma-separated, of: {', '.join(RUNS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-samples", type=int, default=Protocol.num_samples)
    ap.add_argument("--eval-windows", type=int, default=Protocol.eval_windows)
    ap.add_argument("--eval-window", type=int, default=Protocol.eval_window)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: results/quant-quality-<model>-cpu.json)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other methods' rows of an existing JSON made with the same protocol and calibration")
    args = ap.parse_args()
    unknown = [m for m in args.methods.split(",") if m not in RUNS]
    if unknown:
        ap.error(f"unknown methods {unknown}: choose from {', '.join(RUNS)}")
    torch.set_num_threads(args.threads)
    protocol = Protocol(num_samples=args.num_samples, eval_windows=args.eval_windows, eval_window=args.eval_window)
    checkpoint = base_checkpoint(args.model)
    out_path = args.out or RESULTS / f"quant-quality-{args.model}-cpu.json"

    calibration = protocol.calibration(checkpoint)
    windows, eval_hash = protocol.eval_windows_for(checkpoint)
    base = load_model(checkpoint, dtype="fp32")
    started = time.perf_counter()
    hiddens = base_hiddens(base, windows)
    print(f"{args.model}: base forward over {windows.n_tokens} eval tokens in {time.perf_counter() - started:.0f}s; "
          f"calibration {calibration.num_samples}x{calibration.seq_len}", flush=True)

    rows: dict[str, dict] = {}
    if args.merge and out_path.is_file():
        old = json.loads(out_path.read_text())
        if old.get("protocol") == protocol.to_json() and old.get("calibration") == calibration.to_json():
            rows.update({k: v for k, v in old["runs"].items() if k not in args.methods.split(",")})
        else:
            print(f"--merge: {out_path} was made with another protocol or calibration; starting afresh")
    record = {
        "benchmark": "quant_quality", "tokq_version": __version__, "model": args.model,
        "device": "cpu", "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "protocol": protocol.to_json(), "calibration": calibration.to_json(),
        "evaluation": {"source": protocol.eval_source, "data_hash": eval_hash, "windows": len(windows.windows),
                       "tokens": windows.n_tokens},
        "loadavg_start": os.getloadavg(), "runs": rows,
    }
    for name in args.methods.split(","):
        run = RUNS[name]
        scheme = scheme_for(run, args.model)
        options = MethodOptions(**run.options)
        model = load_model(checkpoint, dtype="fp32")
        gc.collect()
        with PeakRSS() as rss:
            result = quantize_model(model, run.method, scheme, calibration if run.method != "rtn" and run.method != "fp8"
                                    else None, options)
        quality = evaluate(base, model, windows, hiddens)
        rows[name] = {
            "method": run.method, "scheme": scheme.name, "weights": scheme.weights.__dict__,
            "activations": scheme.activations.name if scheme.activations else None, "options": run.options,
            "quantize_seconds": result.seconds, "peak_rss_mib": rss.peak / 2**20,
            "rss_before_mib": rss.start / 2**20, "quality": quality, "loadavg_after": os.getloadavg(),
        }
        print(f"{name:20s} {scheme.name:14s} KL mean {quality['kl_mean']:.4f} p99 {quality['kl_p99']:.3f} "
              f"top1 {quality['top1_agreement']:.3f} ppl x{quality['ppl_ratio']:.4f} "
              f"quantize {result.seconds:.0f}s peak RSS {rss.peak / 2**20:.0f} MiB", flush=True)
        del model
        record["targets"] = targets(rows, args.model)
        write_json(out_path, record)  # after every method, so a long run leaves partial results
    for key, t in record["targets"].items():
        print(f"target {key}: {t['value']:.3f} ({t['target']}) {'met' if t['met'] else 'NOT MET'}")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
