"""The size/quality frontier of mixed precision against uniform schemes (issue 17's targets), on a real model.

    python benchmarks/mixed_precision.py --model smollm2-135m [--quick] [--windows 32] [--window 512]
        [--threads 2] [--out-dir benchmarks/results]

Data. The documents (default: the default long-document set) are split by tokq.mixed.splits.split_documents
(a stable hash of each document's name) into a *choice* part and an *evaluation* part. The choice part feeds
everything that picks a build: the AWQ/GPTQ calibration samples, the per-Linear sensitivities
(tokq.mixed.sensitivity.measure_sensitivity, RTN fake-quantization, alone costs) and so the knapsack. The
evaluation part is used for nothing but scoring the finished builds: every point is compared with the 16-bit
base by tokq's own compare (api.compare.run_compare_settings; probes and the decode path off) on the same
`--windows` x `--window` windows, so the base's scores come from the baseline cache after the first point.

Points (bytes on disk = the checkpoint folder's *.safetensors; also the candidate Linears' bytes):
  uniform  RTN / AWQ / GPTQ at w4a16 (resolve_scheme: group 64 on SmolLM2, whose 576 hidden does not divide
           by 128; group 32 never, its weights sit on a Q4_1 grid), RTN at w8a16 (AWQ w8a16 with --int8-awq);
  mixed    {w4a16, w8a16, bf16} per decoder Linear, chosen by the knapsack (tokq.mixed.knapsack.solve) on the
           sensitivity costs, built with --mix-method (default AWQ; quantization.layer_schemes.LayerSchemes -> quantize_model ->
           save_quantized):
           (a) "equal-size": the least predicted KL whose checkpoint stays within +2% of uniform AWQ int4's;
           (b) "target-kl": the fewest bytes whose predicted KL (alone costs scaled so the all-w4a16 end matches
               the measured all-w4a16 KL: tokq.mixed.search.calibrate) is <= T, for T = fractions of the best
               uniform int4 KL (below it, so uniform int4 misses every T).
--method-costs (with --mix-method gptq): the costs come from uniform GPTQ builds at each format instead, one
dequantized Linear at a time in the 16-bit model (tokq.mixed.method_weights), so the knapsack sees what GPTQ
leaves of each Linear's error rather than RTN's; those uniform builds are frontier points too.
The mixed builds are chosen open loop (prediction only, no build is scored before it is chosen), so the
evaluation windows never steer a choice.

Target checks written to the JSON and Markdown (`targets`):
  (1) equal size (+-2% safetensors bytes) to uniform AWQ int4: mixed mean KL >= 25% lower;
  (2) for a target KL that every uniform int4 misses, the mixed build meets it with >= 15% fewer bytes than the
      smallest uniform scheme that meets it. "Meets" = the 95% interval's upper bound <= T (the gate's bound
      reading); "misses" = it does not meet it.

Writes <out-dir>/mixed-precision-<model>[-gptq-costs].json, .md and .png (bytes vs KL, log KL, interval bars). Builds, the
split documents and the per-point compare JSONs go to $TOKQ_HOME/bench-mixed/<model>/ (a build is reused when
its method, scheme and calibration are the same). --quick: few windows, small calibration, one target; a smoke
test of the whole path in minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
# w3a16 in the mix: the bytes the least sensitive Linears free at 3 bits pay for the sensitive ones at 8 or 16 (at
# AWQ int4's size, {w4a16, w8a16, bf16} alone has only the +2% tolerance to spend: 17.5% lower KL on SmolLM2 in
# the quick run); --mix w4a16,w8a16,bf16 for the issue's example mix
MIX = "w3a16,w4a16,w8a16,bf16"
HELD_OUT_FRACTION = 0.5
EQUAL_SIZE_TOL = 0.02  # the issue's "equal size (+-2%)"
KL_REDUCTION_TARGET = 0.25
BYTES_SAVING_TARGET = 0.15
INT4 = "w4a16"
INT8 = "w8a16"


# ---------------------------------------------------------------- pure: checks, table, plot (tested without torch)

def kl(point: dict, which: str = "value") -> float:
    v = point["quality"]["kl"][which]
    return math.inf if v is None else float(v)


def meets(point: dict, target: float) -> bool:
    """A build meets a target KL when its 95% interval's upper bound is <= the target."""
    return kl(point, "high") <= target


def equal_size_check(points: list[dict], tol: float = EQUAL_SIZE_TOL) -> dict:
    """Check (1): the mixed build made for AWQ int4's size vs uniform AWQ int4."""
    ref = next((p for p in points if p["kind"] == "uniform" and p["method"] == "awq" and p["format"] == INT4), None)
    mix = next((p for p in points if p.get("role") == "equal-size"), None)
    if ref is None or mix is None:
        return {"met": None, "why": "needs the uniform awq-w4a16 point and the equal-size mixed point"}
    ratio = mix["bytes"]["safetensors"] / ref["bytes"]["safetensors"]
    linear_ratio = mix["bytes"]["candidate_linears"] / ref["bytes"]["candidate_linears"]
    reduction = 1 - kl(mix) / kl(ref)
    same_size = abs(ratio - 1) <= tol
    return {"reference": ref["name"], "mixed": mix["name"], "size_ratio": ratio, "size_tolerance": tol,
            "linear_bytes_ratio": linear_ratio,
            "same_size": same_size, "kl_reference": kl(ref), "kl_mixed": kl(mix),
            "kl_reduction": reduction, "target": f">= {KL_REDUCTION_TARGET}",
            # the reduction's sign is only firm when the two intervals do not overlap
            "intervals_overlap": kl(mix, "high") >= kl(ref, "low"),
            "met": bool(same_size and reduction >= KL_REDUCTION_TARGET)}


def target_kl_checks(points: list[dict]) -> dict:
    """Check (2), per target KL T of a "target-kl" mixed build: every uniform int4 point misses T, the mixed
    build meets T, and its bytes vs the smallest uniform point that meets T. Met when some T passes."""
    uniform = [p for p in points if p["kind"] == "uniform"]
    int4 = [p for p in uniform if p["format"] == INT4]
    rows = []
    for mix in (p for p in points if p.get("role") == "target-kl"):
        t = float(mix["target_kl"])
        meeting = sorted((p for p in uniform if meets(p, t)), key=lambda p: p["bytes"]["safetensors"])
        smallest = meeting[0] if meeting else None
        row = {"target_kl": t, "mixed": mix["name"], "mixed_kl": kl(mix), "mixed_kl_high": kl(mix, "high"),
               "mixed_meets": meets(mix, t), "mixed_bytes": mix["bytes"]["safetensors"],
               "int4_all_miss": bool(int4) and not any(meets(p, t) for p in int4),
               "smallest_uniform_meeting": smallest["name"] if smallest else None,
               "uniform_bytes": smallest["bytes"]["safetensors"] if smallest else None}
        row["bytes_saving"] = 1 - row["mixed_bytes"] / row["uniform_bytes"] if smallest else None
        # the same saving counted on the candidate Linears alone (embeddings and lm_head stay 16-bit in every
        # build, and on a large-vocabulary model they are most of the file)
        row["linear_bytes_saving"] = (1 - mix["bytes"]["candidate_linears"] / smallest["bytes"]["candidate_linears"]
                                      if smallest else None)
        ok = row["int4_all_miss"] and row["mixed_meets"] and smallest is not None
        row["met"] = bool(ok and row["bytes_saving"] >= BYTES_SAVING_TARGET)
        row["met_on_linear_bytes"] = bool(ok and row["linear_bytes_saving"] >= BYTES_SAVING_TARGET)
        rows.append(row)
    counted = [r for r in rows if r["int4_all_miss"]]
    return {"target": f">= {BYTES_SAVING_TARGET} fewer bytes (safetensors)", "meets_means": "95% upper bound <= target KL",
            "rows": rows, "met": any(r["met"] for r in counted) if counted else None,
            "met_on_linear_bytes": any(r["met_on_linear_bytes"] for r in counted) if counted else None}


def _fmt_est(e: dict, pct: bool = False, digits: int = 4) -> str:
    if e is None or e.get("value") is None:
        return "-"
    f = (lambda x: f"{100 * x:.2f}%") if pct else (lambda x: f"{x:.{digits}f}")
    lo, hi = e.get("low"), e.get("high")
    return f"{f(e['value'])} [{f(lo) if lo is not None else '-inf'}, {f(hi) if hi is not None else 'inf'}]"


def _scored_docs(record: dict) -> str:
    docs = {p["quality"]["kl"].get("n_docs") for p in record["points"]}
    return "/".join(str(d) for d in sorted(d for d in docs if d is not None)) or "?"


def frontier_markdown(record: dict) -> str:
    pts = sorted(record["points"], key=lambda p: p["bytes"]["safetensors"])
    lines = [f"# Mixed precision frontier: {record['model']}", "",
             f"tokq {record['tokq_commit']}, {record['device']}, {record['threads']} threads; evaluation: "
             f"{record['evaluation']['windows']} x {record['evaluation']['window']}-token windows from "
             f"{_scored_docs(record)} of {record['evaluation']['documents']} held-out documents (choice part: "
             f"{record['split']['choice_documents']} documents, used for calibration and sensitivity only).", "",
             "| point | kind | Linears per format | safetensors MB | x 16-bit | candidate MB | mean KL [95%] | "
             "top-1 [95%] | ΔNLL [95%] | PPL ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in pts:
        c = p["counts"]
        q = p["quality"]
        formats = ", ".join(f"{n} {f}" for f, n in c.items() if n)
        lines.append(f"| {p['name']} | {p['kind']} | {formats} | "
                     f"{p['bytes']['safetensors'] / 1e6:.2f} | {p['bytes']['ratio_to_16bit']:.3f} | "
                     f"{p['bytes']['candidate_linears'] / 1e6:.2f} | {_fmt_est(q['kl'])} | "
                     f"{_fmt_est(q['top1'], pct=True)} | {_fmt_est(q['delta_nll'])} | "
                     f"{q['ppl_ratio']['value']:.4f} |")
    t = record.get("targets", {})
    eq = t.get("equal_size", {})
    lines += ["", "## Targets", ""]
    if eq.get("met") is not None or "kl_reduction" in eq:
        lines.append(f"1. Equal size to uniform AWQ int4 ({eq['mixed']} at {eq['size_ratio']:.4f}x its bytes, "
                     f"{eq['linear_bytes_ratio']:.3f}x on the candidate Linears, "
                     f"tolerance ±{eq['size_tolerance']:.0%}): mean KL {eq['kl_mixed']:.4f} vs {eq['kl_reference']:.4f}, "
                     f"reduction {eq['kl_reduction']:.1%} (target ≥ {KL_REDUCTION_TARGET:.0%}; intervals "
                     f"{'overlap' if eq['intervals_overlap'] else 'do not overlap'}): "
                     f"**{'met' if eq['met'] else 'not met'}**")
    else:
        lines.append(f"1. Equal size: not measured ({eq.get('why')})")
    tk = t.get("target_kl", {})
    lines.append(f"2. Target KL that uniform int4 misses (meets = 95% upper bound ≤ target): "
                 f"**{ {True: 'met', False: 'not met', None: 'not measured'}[tk.get('met')] }**")
    for r in tk.get("rows", []):
        vs = (f"smallest uniform meeting it: {r['smallest_uniform_meeting']} ({r['uniform_bytes'] / 1e6:.2f} MB), "
              f"mixed {r['mixed_bytes'] / 1e6:.2f} MB: {r['bytes_saving']:.1%} fewer bytes "
              f"({r['linear_bytes_saving']:.1%} fewer on the candidate Linears alone)"
              if r["smallest_uniform_meeting"] else "no uniform point meets it")
        lines.append(f"   - T = {r['target_kl']:.4f}: int4 all miss: {r['int4_all_miss']}; {r['mixed']} KL "
                     f"{r['mixed_kl']:.4f} (upper {r['mixed_kl_high']:.4f}) meets: {r['mixed_meets']}; {vs} "
                     f"(target ≥ {BYTES_SAVING_TARGET:.0%}): {'met' if r['met'] else 'not met'}")
    lines += ["", f"Durations (s): {json.dumps(record['durations'])}",
              f"Load average before {record['loadavg_before']}, after {record.get('loadavg_after')}", ""]
    return "\n".join(lines)


def plot_frontier(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    # a lower bound of 0 (few documents) has no place on a log axis: bars are cut at a tenth of the least KL
    floor = 0.1 * min((kl(p) for p in record["points"] if kl(p) > 0), default=1e-6)
    styles = {"uniform": ("o", "tab:blue"), "mixed": ("D", "tab:red")}
    for kind, (marker, color) in styles.items():
        pts = sorted((p for p in record["points"] if p["kind"] == kind), key=lambda p: p["bytes"]["safetensors"])
        if not pts:
            continue
        x = [p["bytes"]["safetensors"] / 1e6 for p in pts]
        y = [kl(p) for p in pts]
        lo = [max(kl(p) - max(kl(p, "low"), floor), 0) for p in pts]
        hi = [max(kl(p, "high") - kl(p), 0) if math.isfinite(kl(p, "high")) else 0 for p in pts]
        ax.errorbar(x, y, yerr=[lo, hi], fmt=marker, color=color, capsize=3, label=kind,
                    linestyle="-" if kind == "mixed" else "none", alpha=0.9)
        for p, xi, yi in zip(pts, x, y, strict=True):
            ax.annotate(p["name"], (xi, yi), textcoords="offset points", xytext=(5, 4), fontsize=7)
    for r in record.get("targets", {}).get("target_kl", {}).get("rows", []):
        ax.axhline(r["target_kl"], color="gray", linestyle=":", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("checkpoint size on disk (MB, safetensors)")
    ax.set_ylabel("mean KL(base ‖ build), held-out windows (95% interval)")
    ax.set_ylim(bottom=floor)
    method = str(record.get("settings", {}).get("mix_method", "awq")).upper()
    ax.set_title(f"{record['model']}: size vs quality, uniform and mixed ({method}) builds")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- the run

def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def home_relative(path: Path) -> str:
    """$TOKQ_HOME/... for paths under it, else the last component: no machine path in the results."""
    from tokq.paths import tokq_home

    try:
        return "$TOKQ_HOME/" + str(Path(path).resolve().relative_to(tokq_home().resolve()))
    except ValueError:
        return Path(path).name


def write_split(documents, folder: Path) -> None:
    """The documents as text files under `folder`, at their doc_id paths (load_documents gives the same ids)."""
    import shutil

    if folder.exists():
        shutil.rmtree(folder)
    for d in documents:
        target = folder / d.doc_id
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(d.text, encoding="utf-8")


def safetensors_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


class Bench:
    def __init__(self, args):
        import torch

        from tokq.engine.config import read_config
        from tokq.engine.tokenizer import load_tokenizer, model_adds_bos
        from tokq.paths import data_dir, tokq_home
        from tokq.runtime import setup_runtime
        from tokq.zoo import resolve_model

        self.args = args
        self.runtime = setup_runtime(args.threads, args.device, 0)
        self.torch = torch
        self.checkpoint = resolve_model(args.model)
        self.config = read_config(self.checkpoint)
        self.tokenizer = load_tokenizer(self.checkpoint)
        self.add_bos = model_adds_bos(self.tokenizer)
        self.data = Path(args.data) if args.data else data_dir() / "default"
        name = Path(args.model).name if "/" in args.model else args.model
        self.name = name
        self.work = tokq_home() / "bench-mixed" / (name + ("-quick" if args.quick else ""))
        self.work.mkdir(parents=True, exist_ok=True)
        self.durations: dict[str, float] = {}
        self.points: list[dict] = []

    def timed(self, label: str, fn, *a, **kw):
        started = time.perf_counter()
        out = fn(*a, **kw)
        self.durations[label] = round(time.perf_counter() - started, 1)
        return out

    # -- data
    def split(self) -> dict:
        from tokq.longctx.documents import load_documents
        from tokq.mixed.splits import split_documents

        docs = load_documents(self.data)
        choice, held = split_documents(docs.documents, HELD_OUT_FRACTION, self.args.seed)
        self.choice_dir, self.eval_dir = self.work / "split" / "choice", self.work / "split" / "eval"
        write_split(choice, self.choice_dir)
        write_split(held, self.eval_dir)
        return {"how": "tokq.mixed.splits.split_documents (sha256 of each document's name and the seed)",
                "held_out_fraction": HELD_OUT_FRACTION, "seed": self.args.seed, "data": home_relative(self.data),
                "data_hash": docs.content_hash(), "choice_documents": len(choice), "evaluation_documents": len(held),
                "evaluation_doc_ids": [d.doc_id for d in held],
                "choice_used_for": ["calibration (AWQ, GPTQ)", "sensitivity", "knapsack"],
                "evaluation_used_for": ["scoring the finished builds, nothing else"]}

    def calibration(self):
        from tokq.quantization.calibration import calibration_samples

        return calibration_samples(self.choice_dir, self.tokenizer, self.add_bos, self.args.num_samples,
                                   self.args.seq_len, self.args.seed)

    # -- sensitivity
    def sensitivity(self, formats: dict, weights: dict | None = None, tag: str = ""):
        """Alone KL of every candidate Linear at each quantized format, as `tokq quantize --mix` measures it
        (api.quantize_mix.mix_windows spread over the choice documents, mix_costs), reused from an earlier
        run on the same windows."""
        from tokq.api.quantize_mix import mix_costs, mix_windows
        from tokq.engine.checkpoint import load_model
        from tokq.longctx.documents import load_documents
        from tokq.mixed.sensitivity import SensitivityResult
        from tokq.reports.json_io import write_json

        docs = load_documents(self.choice_dir)
        window = min(self.args.sens_window, self.config.max_position_embeddings)
        windows = mix_windows(docs.documents, self.tokenizer, self.add_bos, window, self.args.sens_windows,
                              "choice", self.choice_dir)
        key = hashlib.sha256(json.dumps({"formats": {k: v.to_json() for k, v in formats.items()},
                                         "seed": self.args.seed, "windows": [[w.doc_id, w.tokens] for w in windows]}
                                        | ({"weights": tag} if tag else {}), sort_keys=True).encode()).hexdigest()
        path = self.work / f"sensitivity{'-' + tag if tag else ''}.json"
        if path.is_file():  # the same formats on the same windows: an interrupted run need not measure again
            old = json.loads(path.read_text())
            if old.get("bench_key") == key:
                print(f"sensitivity: reusing {home_relative(path)}", flush=True)
                return SensitivityResult.from_json(old)
        last = [0.0]

        def step(done: int, total: int, label: str) -> None:
            if time.perf_counter() - last[0] > 30 or done == total:
                last[0] = time.perf_counter()
                print(f"  sensitivity {done}/{total}: {label}", flush=True)

        base = load_model(self.checkpoint, dtype="fp32", device=self.runtime.device)
        result, _costs, _all = mix_costs(base, windows, formats, self.args.seed, step, weights=weights)
        write_json(path, result.to_json() | {"bench_key": key})
        return result

    # -- builds
    def build(self, name: str, method: str, scheme, calibration) -> tuple[Path, dict]:
        """Quantize and save (or reuse an identical earlier build); (folder, timings)."""
        from tokq.engine.checkpoint import load_model
        from tokq.quantization.formats.compressed_tensors import save_quantized
        from tokq.quantization.pipeline import NEEDS_CALIBRATION, quantize_model

        calib = calibration if method in NEEDS_CALIBRATION else None
        key = hashlib.sha256(json.dumps({"method": method, "scheme": scheme.to_json(), "checkpoint": self.name,
                                         "calibration": calib.to_json() if calib else None},
                                        sort_keys=True, default=str).encode()).hexdigest()
        out = self.work / "builds" / name
        record = out / "tokq_quantization.json"
        if record.is_file():
            old = json.loads(record.read_text())
            if old.get("bench_key") == key:
                print(f"{name}: reusing {home_relative(out)}", flush=True)
                return out, {"quantize": old["result"]["seconds"], "save": None, "reused": True}
        model = load_model(self.checkpoint, dtype="fp32", device=self.runtime.device)
        run = quantize_model(model, method, scheme, calib)
        started = time.perf_counter()
        save_quantized(model, scheme, out, source_dir=self.checkpoint, force=True,
                       provenance={"method": method, "source_model": self.args.model,
                                   "source_checkpoint": str(self.checkpoint), "result": run.to_json(),
                                   "bench_key": key})
        del model
        return out, {"quantize": round(run.seconds, 1), "save": round(time.perf_counter() - started, 1),
                     "reused": False}

    def evaluate(self, name: str, folder: Path) -> tuple[dict, float]:
        from tokq.api.compare import run_compare_settings
        from tokq.settings import CompareSettings

        s = CompareSettings(window=self.args.window, sample_windows=self.args.windows, probes=False,
                            decode_windows=0, seed=self.args.seed)
        started = time.perf_counter()
        result = run_compare_settings(str(self.checkpoint), str(folder), self.eval_dir, s, self.runtime).to_json()
        seconds = time.perf_counter() - started
        (self.work / "compares").mkdir(exist_ok=True)
        (self.work / "compares" / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
        o = result["prefill"]["overall"]
        keep = ("value", "low", "high", "n_tokens", "n_docs")
        quality = {m: {k: o[m].get(k) for k in keep} for m in ("kl", "top1", "delta_nll", "ppl_ratio")}
        quality["kl_method"] = result.get("kl_method")
        quality["base_cache_hit"] = result["cache"]["hit"]
        self.eval_windows = result.get("windows")
        return quality, seconds

    def point(self, name: str, kind: str, method: str, scheme, calibration, counts: dict, candidate_bytes: int,
              **extra) -> dict:
        folder, times = self.build(name, method, scheme, calibration)
        quality, compare_s = self.evaluate(name, folder)
        size = safetensors_bytes(folder)
        p = {"name": name, "kind": kind, "method": method, "counts": counts, **extra,
             "bytes": {"safetensors": size, "candidate_linears": int(candidate_bytes),
                       "ratio_to_16bit": size / self.dense_16bit},
             "quality": quality, "seconds": {**times, "compare": round(compare_s, 1)},
             "loadavg_after": os.getloadavg(), "checkpoint": home_relative(folder)}
        q = quality
        how = "reused" if times["reused"] else f"quantize {times['quantize']:.0f}s"
        print(f"{name:24s} {size / 1e6:8.2f} MB ({p['bytes']['ratio_to_16bit']:.3f}x)  KL {_fmt_est(q['kl'])}  "
              f"top-1 {_fmt_est(q['top1'], pct=True)}  PPL x{q['ppl_ratio']['value']:.4f}  [{how}, "
              f"compare {compare_s:.0f}s]", flush=True)
        self.points.append(p)
        return p


def uniform_runs(int8_awq: bool) -> list[tuple[str, str, str]]:
    runs = [("rtn-w4a16", "rtn", INT4), ("awq-w4a16", "awq", INT4), ("gptq-w4a16", "gptq", INT4),
            ("rtn-w8a16", "rtn", INT8)]
    return runs + ([("awq-w8a16", "awq", INT8)] if int8_awq else [])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="zoo name or checkpoint folder")
    ap.add_argument("--data", default=None, help="documents folder (default: the default set)")
    ap.add_argument("--quick", action="store_true", help="few windows, small calibration, one target KL")
    ap.add_argument("--windows", type=int, default=None, help="evaluation windows (default 32; quick 4)")
    ap.add_argument("--window", type=int, default=None, help="evaluation window tokens (default 512; quick 256)")
    ap.add_argument("--sens-windows", type=int, default=None,
                    help="sensitivity windows (default: quantize --mix's, 8; quick 2)")
    ap.add_argument("--sens-window", type=int, default=None,
                    help="sensitivity window tokens (default: quantize --mix's, 256; quick 64)")
    ap.add_argument("--num-samples", type=int, default=None, help="calibration samples (default 16; quick 4)")
    ap.add_argument("--seq-len", type=int, default=None, help="calibration sample tokens (default 512; quick 128)")
    ap.add_argument("--target-fractions", default=None,
                    help="target KLs as fractions of the best uniform int4 KL (default 0.5,0.25,0.1; quick 0.5)")
    ap.add_argument("--mix", default=MIX, help=f"formats the mixed builds choose from (default {MIX})")
    ap.add_argument("--mix-method", default="awq", choices=("awq", "gptq", "rtn"), help="method of the mixed builds")
    ap.add_argument("--int8-awq", action="store_true", help="also uniform AWQ w8a16")
    ap.add_argument("--method-costs", action="store_true",
                    help="per-Linear costs from uniform --mix-method builds at each format (gptq or rtn; "
                         "mixed.method_weights) instead of RTN rounding; the extra uniform builds are frontier points")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    from tokq.api.quantize_mix import MIX_WINDOW, SENSITIVITY_WINDOWS

    quick = args.quick
    defaults = {"windows": (32, 4), "window": (512, 256), "sens_windows": (SENSITIVITY_WINDOWS, 2), "sens_window": (MIX_WINDOW, 64),
                "num_samples": (16, 4), "seq_len": (512, 128), "target_fractions": ("0.5,0.25,0.1", "0.5")}
    for key, (full, small) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if quick else full)
    args.target_fractions = [float(x) for x in str(args.target_fractions).split(",") if x.strip()]
    if any(not 0 < f < 1 for f in args.target_fractions):
        ap.error("--target-fractions: each in (0, 1) (a target below the best uniform int4 KL)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    loadavg_before = os.getloadavg()
    started = time.perf_counter()
    bench = Bench(args)
    from tokq.mixed.knapsack import InfeasibleBudget, solve
    from tokq.mixed.search import calibrate
    from tokq.quantization.layer_schemes import DENSE, LayerSchemes, parse_mix
    from tokq.reports.json_io import write_json

    split = bench.timed("split", bench.split)
    mix = parse_mix(args.mix, args.mix_method, bench.config)
    formats = {k: v for k, v in mix.items() if v is not None}
    calibration = bench.timed("calibration", bench.calibration)
    weights, tag = (bench.timed("method_weights", method_weights, bench, formats, calibration), args.mix_method) \
        if args.method_costs else (None, "")
    sens = bench.timed("sensitivity", bench.sensitivity, formats, weights, tag)
    del weights
    costs, sizes = sens.linear_costs(), sens.bytes
    bench.dense_16bit = _dense_16bit_bytes(bench)
    print(f"{args.model}: split {split['choice_documents']} choice / {split['evaluation_documents']} evaluation "
          f"documents; sensitivity of {len(costs)} Linears in {bench.durations['sensitivity']:.0f}s", flush=True)
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    costs_tag = f"-{args.mix_method}-costs" if args.method_costs else ""
    stem = out_dir / f"mixed-precision-{bench.name}{costs_tag}{'-quick' if args.quick else ''}"
    record = {
        "benchmark": "mixed_precision", "model": bench.name, "tokq_commit": git_commit(),
        "device": bench.runtime.device, "threads": bench.runtime.threads, "cpu_count": os.cpu_count(),
        "hardware": bench.runtime.hardware, "torch": bench.torch.__version__, "quick": args.quick,
        "settings": {**{k: v for k, v in vars(args).items() if k not in ("out_dir", "data")},
                     "data": home_relative(bench.data), "model": bench.name},
        "mix": args.mix, "schemes": {k: s.to_json() for k, s in formats.items()}, "split": split,
        "calibration": calibration.to_json() | {"source": "choice part"},
        "sensitivity": {"windows": sens.windows, "seconds": sens.seconds, "notes": sens.notes,
                        "all_quantized_kl": {f: e["kl"].value for f, e in sens.all_quantized.items()},
                        "json": home_relative(bench.work / "sensitivity.json")},
        "evaluation": {"windows": args.windows, "window": args.window, "documents": split["evaluation_documents"],
                       "compare": "api.compare.run_compare_settings, probes off, decode_windows 0, topk 256, "
                                  "full-vocabulary KL on 256 sampled rows"},
        "dense_16bit_bytes": bench.dense_16bit, "loadavg_before": loadavg_before, "points": bench.points,
        "durations": bench.durations,
    }

    def save() -> None:
        record["targets"] = {"equal_size": equal_size_check(bench.points), "target_kl": target_kl_checks(bench.points)}
        record["loadavg_after"] = os.getloadavg()
        record["durations"]["total"] = round(time.perf_counter() - started, 1)
        write_json(stem.with_suffix(".json"), record)

    runs = uniform_runs(args.int8_awq)
    if args.method_costs:  # the method's uniform builds the costs came from are points on the frontier too
        runs += [(f"{args.mix_method}-{f}", args.mix_method, f) for f in formats
                 if (f"{args.mix_method}-{f}", args.mix_method, f) not in runs]
    for name, method, fmt in runs:
        started_point = time.perf_counter()
        bench.point(name, "uniform", method, formats[fmt], calibration, {fmt: len(sizes)},
                    sum(s[fmt] for s in sizes.values()), format=fmt)
        bench.durations[name] = round(time.perf_counter() - started_point, 1)
        save()

    all_kl = {f: e["kl"].value for f, e in sens.all_quantized.items()}
    scaled, low, calib_desc = calibrate(costs, sizes, all_kl)
    how = f"{args.mix_method}'s own uniform builds, one Linear at a time" if args.method_costs else "RTN fake-quantized"
    record["prediction"] = {"costs": f"alone KL per Linear ({how}, choice windows)", "lowest": low,
                            **calib_desc}
    done: dict[tuple, str] = {}

    def mixed(name: str, solution, **extra) -> None:
        key = tuple(sorted(solution.assignment.items()))
        if key in done:
            record.setdefault("notes", []).append(f"{name}: same assignment as {done[key]}; not built twice")
            return
        done[key] = name
        layer = LayerSchemes(formats, solution.assignment, name=name)
        counts = layer.counts()
        started_point = time.perf_counter()
        bench.point(name, "mixed", args.mix_method, layer, calibration, counts, solution.bytes, format="mixed",
                    predicted_kl=solution.cost, knapsack_exact=solution.exact, assignment=solution.assignment, **extra)
        bench.durations[name] = round(time.perf_counter() - started_point, 1)
        save()

    awq = next(p for p in bench.points if p["name"] == f"awq-{INT4}")
    fixed = awq["bytes"]["safetensors"] - awq["bytes"]["candidate_linears"]
    # 95% of the tolerance: headers and the config's extra groups must not push it over +2%
    budget = math.floor(awq["bytes"]["safetensors"] * (1 + 0.95 * EQUAL_SIZE_TOL)) - fixed
    mixed("mix-equal-size", solve(scaled, sizes, max_bytes=budget), role="equal-size", candidate_budget=budget)

    best_int4 = min(kl(p) for p in bench.points if p["kind"] == "uniform" and p["format"] == INT4)
    for fraction in args.target_fractions:
        target = fraction * best_int4
        try:
            solution = solve(scaled, sizes, target_cost=target)
        except InfeasibleBudget as exc:
            record.setdefault("notes", []).append(f"target KL {target:.4g}: {exc}")
            continue
        mixed(f"mix-kl-{target:.3g}", solution, role="target-kl", target_kl=target, target_fraction=fraction)
    record["dense"] = DENSE
    save()
    stem.with_suffix(".md").write_text(frontier_markdown(record), encoding="utf-8")
    plot_frontier(record, stem.with_suffix(".png"))
    eq, tk = record["targets"]["equal_size"], record["targets"]["target_kl"]
    print(f"target 1 (equal size): {eq.get('kl_reduction', float('nan')):.1%} lower KL at "
          f"{eq.get('size_ratio', float('nan')):.4f}x AWQ int4's bytes: met={eq.get('met')}")
    for r in tk["rows"]:
        saving = "-" if r["bytes_saving"] is None else f"{r['bytes_saving']:.1%}"
        print(f"target 2 (T={r['target_kl']:.4g}): int4 all miss {r['int4_all_miss']}, mixed meets {r['mixed_meets']}, "
              f"smallest uniform meeting {r['smallest_uniform_meeting']}, saving {saving}: met={r['met']}")
    print(f"durations: {json.dumps(bench.durations)}")
    print(f"wrote {stem.with_suffix('.json')}, .md, .png")


def method_weights(bench, formats: dict, calibration) -> dict:
    """Format -> Linear -> dense weight of the --mix-method's uniform build at that format (built or reused)."""
    from tokq.engine.checkpoint import load_model
    from tokq.mixed.method_weights import PER_LINEAR_METHODS, dequantized_linears

    method = bench.args.mix_method
    if method not in PER_LINEAR_METHODS:
        raise SystemExit(f"--method-costs: {method} folds scales across layers, its Linears cannot be measured one "
                         f"at a time; use --mix-method {' or '.join(PER_LINEAR_METHODS)}")
    out = {}
    for fmt, scheme in formats.items():
        folder, _ = bench.build(f"{method}-{fmt}", method, scheme, calibration)
        out[fmt] = dequantized_linears(load_model(folder, dtype="fp32", device=bench.runtime.device))
    return out


def _dense_16bit_bytes(bench) -> int:
    """2 bytes per parameter of the base checkpoint's tensors (tied weights stored once, counted once)."""
    from safetensors import safe_open

    total, seen = 0, set()
    for f in sorted(bench.checkpoint.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k not in seen:
                    seen.add(k)
                    shape = st.get_slice(k).get_shape()
                    total += 2 * math.prod(shape)
    return total


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
