"""KV-cache quantization against the 16-bit cache on long windows: unit-scale fp8, calibrated fp8, calibrated int8.

    python benchmarks/kv_cache_quant.py --model gemma3-270m [--window 8192] [--windows 16] [--decode-windows 8]
        [--decode-tokens 64] [--threads 2] [--out-dir benchmarks/results]

Builds. KV-cache-only checkpoints (`tokq quantize --method none --kv-cache fp8|int8`): the weights stay the base's,
so every difference measured is the cache's. Their per-layer, per-KV-head scales are calibrated on the *choice*
documents; the *evaluation* documents are used for nothing but scoring. The split (--split): "long" (default)
evaluates on every document of at least --window tokens, so each window is full length and the decode path sits at
the end of a long context, and calibrates on the shorter rest; "half" splits by tokq.mixed.splits.split_documents
as mixed_precision.py does.

Variants, each compared with the base (16-bit cache) by tokq's own compare (api.compare.run_compare_settings,
probes off) on the same evaluation windows, so the base's scores come from the baseline cache after the first:
  fp8-unit         the fp8 build's cache with scale 1 per head (--b-kv-scales unit: vLLM's default without scales)
  fp8-calibrated   the fp8 build with its calibrated scales
  int8-calibrated  the int8 build with its calibrated scales
The decode path scores the last --decode-tokens positions of --decode-windows windows one token at a time, as a
served model produces them, so at --window 8192 every decode position is >= 8192 - decode_tokens. KL and top-1
come per position bucket for the prefill path and overall for both, each with its 95% document-bootstrap interval,
beside compare's noise floor.

Target (issue 18): calibrated fp8's decode-path KL at most half of unit-scale fp8's on the same windows. The JSON
states the point ratio and the conservative one (calibrated's upper bound over unit's lower bound).

Writes <out-dir>/kv-cache-quant-<model>.json, .md and .png (KL by position bucket, log scale, interval bars).
Builds and the per-variant compare JSONs go to $TOKQ_HOME/bench-kv/<model>/ (a build is reused when its
calibration is the same).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixed_precision import HELD_OUT_FRACTION, git_commit, home_relative, write_split  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = (("fp8-unit", "fp8", "unit"), ("fp8-calibrated", "fp8", "auto"), ("int8-calibrated", "int8", "auto"))
DECODE_RATIO_TARGET = 0.5


# ---------------------------------------------------------------- pure: checks, table, plot (tested without torch)

def _est(e: dict | None, digits: int = 4, pct: bool = False) -> str:
    if not e:
        return "-"
    if e.get("low") is None or e.get("high") is None:  # no interval (one document)
        return f"{e['value']:.2%}" if pct else f"{e['value']:.{digits}g}"
    if pct:
        return f"{e['value']:.2%} [{e['low']:.2%}, {e['high']:.2%}]"
    return f"{e['value']:.{digits}g} [{e['low']:.{digits}g}, {e['high']:.{digits}g}]"


def _ratio(u: dict, c: dict, what: str) -> dict:
    ratio = c["value"] / u["value"] if u["value"] > 0 else float("inf")
    conservative = c["high"] / u["low"] if u["low"] > 0 else float("inf")
    return {"what": what, "target": DECODE_RATIO_TARGET, "ratio": ratio, "conservative_ratio": conservative,
            "met": ratio <= DECODE_RATIO_TARGET, "met_by_bounds": conservative <= DECODE_RATIO_TARGET}


def decode_ratio_check(variants: dict) -> dict | None:
    """Calibrated fp8's decode-path KL over unit-scale fp8's: the point ratio and the conservative one."""
    unit, cal = variants.get("fp8-unit"), variants.get("fp8-calibrated")
    if not unit or not cal or not unit.get("decode") or not cal.get("decode"):
        return None
    return _ratio(unit["decode"]["kl"], cal["decode"]["kl"],
                  "fp8-calibrated decode-path mean KL / fp8-unit decode-path mean KL (same windows)")


def late_prefill_ratio_check(variants: dict) -> dict | None:
    """The same ratio on the prefill path's last position bucket (tokq's prefill reads K/V back from the
    quantized cache too, so a query there sees the cache's error over the whole long context)."""
    unit, cal = variants.get("fp8-unit"), variants.get("fp8-calibrated")
    if not unit or not cal:
        return None
    last = max(unit["prefill_buckets"], key=bucket_start)
    if last not in cal["prefill_buckets"]:
        return None
    return {**_ratio(unit["prefill_buckets"][last]["kl"], cal["prefill_buckets"][last]["kl"],
                     f"fp8-calibrated / fp8-unit prefill-path mean KL at positions {last}"), "bucket": last}


def kv_markdown(record: dict) -> str:
    ev = record["evaluation"]
    lines = [f"## KV-cache quantization: {record['model']} ({record['device']}, {record['threads']} threads, "
             f"commit {record['tokq_commit']})", "",
             f"{ev['windows_scored']} held-out windows of {ev['window']} tokens from {ev['documents_scored']} documents "
             f"(scored only; scales calibrated on {record['split']['choice_documents']} other documents: "
             f"{record['calibration']['num_samples']} x "
             f"{record['calibration']['seq_len']} tokens). "
             + (f"Decode path: last {ev['decode_tokens']} positions (from position {ev.get('decode_from', '?')}) of "
                f"{ev['decode_windows']} windows, one token at a time. " if ev["decode_windows"] else
                "Decode path off: tokq's prefill reads K and V back from the quantized cache, so the prefill path "
                "shows the cache's error at every position. ")
             + "95% intervals from a document bootstrap.", "",
             "| variant | KV cache | prefill KL | prefill top-1 | decode KL | decode top-1 |", "|---|---|---|---|---|---|"]
    for name, v in record["variants"].items():
        d = v.get("decode") or {}
        lines.append(f"| {name} | {v['kv_cache']} | {_est(v['prefill']['kl'])} | {_est(v['prefill']['top1'], pct=True)} "
                     f"| {_est(d.get('kl'))} | {_est(d.get('top1'), pct=True)} |")
    floor = record.get("noise_floor")
    if floor:
        lines += ["", f"Noise floor ({floor['what']}): mean KL {floor['kl_mean']:.2e} over {floor['tokens']} tokens."]
    buckets = sorted({b for v in record["variants"].values() for b in v["prefill_buckets"]}, key=bucket_start)
    lines += ["", "Prefill-path KL by position bucket:", "",
              "| bucket | " + " | ".join(record["variants"]) + " |", "|---" * (len(record["variants"]) + 1) + "|"]
    for b in buckets:
        cells = [_est(v["prefill_buckets"].get(b, {}).get("kl"), 3) for v in record["variants"].values()]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    for key in ("target", "target_late_prefill"):
        check = record.get(key)
        if check:
            verdict = "met" if check["met"] else "not met"
            lines += ["", f"Target: {check['what']} <= {check['target']}: ratio {check['ratio']:.3f} ({verdict}); "
                          f"conservative {check['conservative_ratio']:.3f} (calibrated's upper bound over unit's "
                          f"lower bound: {'met' if check['met_by_bounds'] else 'not met'})."]
    return "\n".join(lines) + "\n"


def bucket_start(label: str) -> int:
    """'0-511' -> 0, '8K-16K' -> 8192: a bucket's first position, for plotting."""
    first = label.split("-")[0]
    return int(first[:-1]) * 1024 if first.endswith("K") else int(first)


def error_bars(estimates: list[dict]) -> list[list[float]]:
    """matplotlib's [[below], [above]] from estimates; an estimate without an interval (one document) gets none."""
    def arm(e: dict, side: str) -> float:
        bound = e.get(side)
        return 0.0 if bound is None else abs(e["value"] - bound)
    return [[arm(e, "low") for e in estimates], [arm(e, "high") for e in estimates]]


def plot_kl_by_position(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, v) in enumerate(record["variants"].items()):
        items = sorted(v["prefill_buckets"].items(), key=lambda kv: bucket_start(kv[0]))
        xs = [bucket_start(b) + 1 for b, _ in items]
        ys = [e["kl"]["value"] for _, e in items]
        err = error_bars([e["kl"] for _, e in items])
        line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{name} (prefill)")
        d = v.get("decode")
        if d:
            x = record["evaluation"].get("decode_from") or xs[-1]
            k = d["kl"]
            ax.errorbar([x * (1.02 + 0.02 * i)], [k["value"]], yerr=error_bars([k]),
                        marker="D", color=line[0].get_color(), capsize=3, linestyle="none",
                        label=f"{name} (decode path)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("position in window (bucket start + 1)")
    ax.set_ylabel("mean KL(base ‖ variant), nats")
    ax.set_title(f"{record['model']}: KV-cache quantization vs the 16-bit cache")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- the run

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--data", default=None, help="documents (default: the default long-document set)")
    p.add_argument("--window", type=int, default=8192)
    p.add_argument("--windows", type=int, default=16, help="evaluation windows (sample_windows)")
    p.add_argument("--decode-windows", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--num-samples", type=int, default=16, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=2048, help="calibration window tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", choices=("long", "half"), default="long")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    return p.parse_args(argv)


def build(args, name: str, kv_cache: str, checkpoint: Path, choice_dir: Path, choice_hash: str,
          work: Path) -> tuple[Path, dict]:
    """The KV-only build, reused when its calibration (documents' content, samples, seed) is the same."""
    from tokq.api.quantize import run_quantize
    from tokq.settings import QuantizeSettings

    out = work / "builds" / f"kv-{kv_cache}"
    s = QuantizeSettings(method="none", kv_cache=kv_cache, calib=choice_dir, num_samples=args.num_samples,
                         seq_len=args.seq_len, seed=args.seed)
    key = {"kv_cache": kv_cache, "num_samples": args.num_samples, "seq_len": args.seq_len, "seed": args.seed,
           "choice_documents_sha256": choice_hash, "model": str(checkpoint)}
    record = out / "tokq_quantization.json"
    if record.is_file():
        old = json.loads(record.read_text())
        if old.get("bench_key") == key:
            print(f"{name}: reusing {home_relative(out)}", flush=True)
            return out, old["kv_cache"]
    started = time.perf_counter()
    run_quantize(str(checkpoint), out, s, force=out.exists(), extra_provenance={"bench_key": key},
                 threads=args.threads, device=args.device)
    rec = json.loads(record.read_text())
    return out, {**rec["kv_cache"], "seconds": round(time.perf_counter() - started, 1)}


def without_machine_paths(kv: dict) -> dict:
    """A build's kv_cache record with $TOKQ_HOME for the machine's path (results name no machine path)."""
    from tokq.paths import tokq_home

    return {k: v.replace(str(tokq_home()), "$TOKQ_HOME") if isinstance(v, str) else v for k, v in kv.items()}


def summarize(result: dict) -> dict:
    keep = ("value", "low", "high", "n_tokens", "n_docs")

    def est(o: dict) -> dict:
        return {m: {k: o[m].get(k) for k in keep} for m in ("kl", "top1", "delta_nll") if m in o}
    decode = result.get("decode")
    return {"prefill": est(result["prefill"]["overall"]),
            "prefill_buckets": {b: est(e) for b, e in result["prefill"]["buckets"].items()},
            "decode": est(decode["overall"]) if decode else None,
            "decode_from": decode.get("decode_from") if decode else None,
            "kv_cache": (result.get("kv_cache") or {}).get("b", {}).get("scales"),
            "base_cache_hit": result["cache"]["hit"]}


def bench_setup(args, folder: str):
    """(runtime, checkpoint, model name, work folder $TOKQ_HOME/<folder>/<name>, data folder, documents) for a run
    with --threads, --device, --seed, --model and --data (default: the default long-document set)."""
    from tokq.longctx.documents import load_documents
    from tokq.paths import data_dir, tokq_home
    from tokq.runtime import setup_runtime
    from tokq.zoo import resolve_model

    runtime = setup_runtime(args.threads, args.device, args.seed)
    checkpoint = resolve_model(args.model)
    name = Path(args.model).name
    data = Path(args.data) if args.data else data_dir() / "default"
    return runtime, checkpoint, name, tokq_home() / folder / name, data, load_documents(data)


def long_split(documents, tokenizer, tokens: int) -> tuple[list, list]:
    """(documents of at least `tokens` tokens, the rest), each in the given order: the long ones are scored, the
    rest calibrate, so nothing scored was seen in calibration."""
    counts = {d.doc_id: len(tokenizer(d.text, add_special_tokens=False)["input_ids"]) for d in documents}
    return [d for d in documents if counts[d.doc_id] >= tokens], [d for d in documents if counts[d.doc_id] < tokens]


def documents_hash(documents) -> str:
    """What a build's calibration key holds of its documents: their ids and text."""
    return hashlib.sha256("\0".join(f"{d.doc_id}\0{d.text}" for d in documents).encode()).hexdigest()


def main(argv=None) -> None:
    args = parse_args(argv)
    loadavg_before = os.getloadavg()
    started = time.perf_counter()
    from tokq.api.compare import run_compare_settings
    from tokq.mixed.splits import split_documents
    from tokq.reports.json_io import write_json
    from tokq.settings import CompareSettings

    runtime, checkpoint, name, work, data, docs = bench_setup(args, "bench-kv")
    if args.split == "long":
        from tokq.engine.tokenizer import load_tokenizer

        held, choice = long_split(docs.documents, load_tokenizer(checkpoint), args.window)
    else:
        choice, held = split_documents(docs.documents, HELD_OUT_FRACTION, args.seed)
    if not held or not choice:
        raise SystemExit(f"split {args.split}: {len(choice)} calibration and {len(held)} evaluation documents; need both")
    choice_dir, eval_dir = work / "split" / "choice", work / "split" / "eval"
    write_split(choice, choice_dir)
    write_split(held, eval_dir)
    choice_hash = documents_hash(choice)
    builds = {kv: build(args, f"kv-{kv}", kv, checkpoint, choice_dir, choice_hash, work) for kv in ("fp8", "int8")}
    import torch

    record: dict = {
        "benchmark": "kv_cache_quant", "model": name, "tokq_commit": git_commit(), "device": str(runtime.device),
        "threads": runtime.threads, "cpu_count": os.cpu_count(), "hardware": runtime.hardware,
        "torch": torch.__version__, "settings": {**{k: v for k, v in vars(args).items() if k not in ("out_dir", "data")},
                                                 "data": home_relative(data)},
        "split": {"how": "evaluation: the documents of at least --window tokens; calibration: the rest"
                  if args.split == "long" else "tokq.mixed.splits.split_documents, half held out",
                  "choice_documents": len(choice), "evaluation_documents": len(held),
                  "evaluation_doc_ids": [d.doc_id for d in held]},
        "calibration": {"num_samples": args.num_samples, "seq_len": args.seq_len, "source": "choice half",
                        "builds": {kv: without_machine_paths({k: v for k, v in b[1].items() if k != "calibration"})
                                   for kv, b in builds.items()}},
        "loadavg_before": loadavg_before, "variants": {}, "seconds": {},
    }
    stem = args.out_dir / f"kv-cache-quant-{name}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (work / "compares").mkdir(parents=True, exist_ok=True)
    for variant, kv, scales in VARIANTS:
        s = CompareSettings(window=args.window, sample_windows=args.windows, probes=False,
                            decode_windows=args.decode_windows, decode_tokens=args.decode_tokens,
                            b_kv_scales=scales, seed=args.seed)
        t0 = time.perf_counter()
        result = run_compare_settings(str(checkpoint), str(builds[kv][0]), eval_dir, s, runtime).to_json()
        record["seconds"][variant] = round(time.perf_counter() - t0, 1)
        (work / "compares" / f"{variant}.json").write_text(json.dumps(result, indent=1, default=str))
        record["variants"][variant] = summarize(result)
        w = result["windows"]
        record["evaluation"] = {"window": args.window, "windows_scored": w["count"], "documents_scored": w["documents"],
                                "decode_windows": args.decode_windows, "decode_tokens": args.decode_tokens,
                                "decode_from": record["variants"][variant]["decode_from"],
                                "kl_method": result.get("kl_method")}
        if result.get("noise_floor"):
            record["noise_floor"] = result["noise_floor"]
        v = record["variants"][variant]
        print(f"{variant:16s} prefill KL {_est(v['prefill']['kl'])}  decode KL {_est((v['decode'] or {}).get('kl'))}  "
              f"[{record['seconds'][variant]:.0f}s]", flush=True)
        record["target"] = decode_ratio_check(record["variants"])
        record["target_late_prefill"] = late_prefill_ratio_check(record["variants"])
        record["loadavg_after"] = os.getloadavg()
        record["seconds"]["total"] = round(time.perf_counter() - started, 1)
        write_json(stem.with_suffix(".json"), record)
    stem.with_suffix(".md").write_text(kv_markdown(record), encoding="utf-8")
    plot_kl_by_position(record, stem.with_suffix(".png"))
    print(kv_markdown(record))


if __name__ == "__main__":
    main()
