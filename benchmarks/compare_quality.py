"""`tokq compare` on a real zoo model: the 16-bit base against RTN / AWQ / GPTQ int4 g64, W8A8 SmoothQuant and
FP8 on windows of the default documents, plus compare's own throughput and the baseline cache's effect.

    python benchmarks/compare_quality.py [--model smollm2-135m] [--window 2048] [--sample-windows 16]
        [--variants rtn awq gptq smoothquant fp8] [--probe-max-context 2048] [--threads 1]

Variants are quantized once with `tokq quantize` into $TOKQ_HOME/bench-variants/ (calibrated methods on
--num-samples x --seq-len tokens of the default set's Python manual; reused when present). Each variant is
compared with the base by `tokq compare` (bf16, KL over the base's top-64 + rest, paired bootstrap over
documents, decode path on 2 windows, passkey probes): the first compare scores the base (cache miss), the
others read its cached scores; the first variant is then compared again to time a cache hit.
Writes benchmarks/results/compare-<model>-cpu.json (every compare's full JSON, the KL ordering check, the
timings).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tokq import __version__
from tokq.cli import main as tokq
from tokq.paths import data_dir, tokq_home
from tokq.zoo import resolve_model

RESULTS = Path(__file__).resolve().parent / "results"
RECIPES = {
    "rtn": ["--method", "rtn", "--group-size", "64"],
    "awq": ["--method", "awq", "--group-size", "64"],
    "gptq": ["--method", "gptq", "--group-size", "64"],
    "smoothquant": ["--method", "smoothquant", "--scheme", "w8a8-int8"],
    "fp8": ["--method", "fp8", "--scheme", "w8a8-fp8"],
}
CALIBRATED = {"awq", "gptq", "smoothquant"}


def variant_dir(model: str, name: str, args) -> Path:
    out = tokq_home() / "bench-variants" / f"{model}-{name}-s{args.num_samples}x{args.seq_len}"
    if not out.is_dir():
        extra = ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
                 "--calib", str(data_dir() / "default" / "python-doc")] if name in CALIBRATED else []
        start = time.perf_counter()
        code = tokq(["quantize", "--model", model, "--out", str(out), "--threads", str(args.threads),
                     *RECIPES[name], *extra])
        if code != 0:
            raise SystemExit(f"quantizing {name} failed (exit {code})")
        print(f"quantized {name} in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def run_compare(base: Path, variant: Path, out: Path, args) -> tuple[dict, float]:
    start = time.perf_counter()
    code = tokq(["compare", str(base), str(variant), "--data", str(data_dir() / "default"), "--window",
                 str(args.window), "--sample-windows", str(args.sample_windows), "--threads", str(args.threads),
                 "--probe-max-context", str(args.probe_max_context), "--json", str(out)])
    if code not in (0, 1):
        raise SystemExit(f"compare {variant} failed (exit {code})")
    return json.loads(out.read_text()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--sample-windows", type=int, default=16)
    parser.add_argument("--variants", nargs="+", default=list(RECIPES))
    parser.add_argument("--probe-max-context", type=int, default=2048)
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = resolve_model(args.model)
    work = tokq_home() / "bench-compare" / args.model
    work.mkdir(parents=True, exist_ok=True)
    results, seconds = {}, {}
    for name in args.variants:
        variant = variant_dir(args.model, name, args)
        results[name], seconds[name] = run_compare(base, variant, work / f"{name}.json", args)
        r = results[name]["prefill"]["overall"]
        print(f"{name:12s} KL {r['kl']['value']:.4f} [{r['kl']['low']:.4f}, {r['kl']['high']:.4f}]  top-1 "
              f"{r['top1']['value']:.2%}  PPL ratio {r['ppl_ratio']['value']:.4f}  ({seconds[name]:.0f} s, cache "
              f"{'hit' if results[name]['cache']['hit'] else 'miss'})", flush=True)
    first = args.variants[0]
    rerun, rerun_seconds = run_compare(base, variant_dir(args.model, first, args), work / f"{first}-rerun.json", args)
    kl = {n: r["prefill"]["overall"]["kl"]["value"] for n, r in results.items()}
    int4 = [n for n in ("rtn", "awq", "gptq") if n in kl]
    report = {
        "tokq_version": __version__, "benchmark": "compare-quality", "model": args.model, "device": "cpu",
        "threads": args.threads, "torch": torch.__version__, "settings": vars(args) | {"out": None},
        "kl_mean": kl, "kl_order": sorted(kl, key=kl.get),
        "rtn_worst_int4": bool(int4) and max(int4, key=kl.get) == "rtn",
        "seconds": seconds,
        "cache_effect": {"variant": first, "first_seconds": seconds[first], "rerun_seconds": rerun_seconds,
                         "rerun_cache_hit": rerun["cache"]["hit"], "cache_bytes": rerun["cache"].get("bytes")},
        "throughput": {n: r["throughput"] for n, r in results.items()},
        "compares": results,
    }
    out = args.out or RESULTS / f"compare-{args.model}-cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"KL order (best first): {report['kl_order']}; RTN worst among int4: {report['rtn_worst_int4']}")
    print(f"cache: first compare {seconds[first]:.0f} s, rerun {rerun_seconds:.0f} s (hit: {rerun['cache']['hit']})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
