"""Long context through the decode path: KL and top-1 by position bucket up to 32K tokens, and multi-key passkey
probe grids at 4K-32K contexts, for int4 weights and quantized KV caches against the 16-bit base (issue 18).

    python benchmarks/long_context.py --model gemma3-270m [--window 32768] [--windows 4] [--decode-tokens 64]
        [--probe-contexts 4096,8192,16384,32768] [--probe-needles 8] [--probe-fillers 2] [--threads 2]
        [--out-dir benchmarks/results]

Documents: the default set (or --data). Evaluation: --windows of the documents that hold at least --window tokens
(spread evenly over them in path order), each scored on its first window. Calibration (GPTQ's and the KV scales'):
the documents shorter than --window only, so nothing scored or probed was seen in calibration.

Variants, each against the base (its own weights, 16-bit cache) on the same windows:
  int4-gptq        GPTQ w4a16 (group 128) weights, 16-bit cache
  fp8-unit         the base's weights, fp8 cache with scale 1 per head (vLLM's default without scales)
  fp8-calibrated   the base's weights, fp8 cache with calibrated per-layer, per-KV-head scales
  int8-calibrated  the base's weights, int8 cache with calibrated scales

Scoring is one engine pass per model and window, as a server runs it: chunked prefill (2048 tokens a step) of
positions 0 .. T-d into the paged cache, then the last d = --decode-tokens positions one token per step through
the decode kernels, each reading the (quantized) cache. One pass gives both paths: the prefill path's metrics by
position bucket up to T and the decode path's at the very end of the window (positions T-d+1 .. T-1, all beyond
32K - 64 at T = 32768). The decode sample is thus drawn where a long context is longest, at no extra prefill.
KL(base || variant) is compare's estimator (evalsuite.ab): the base's top-256 plus one bucket at every position,
plus the exact tail on rows both models score over the whole vocabulary: every decode-path row (π = 1) and a
systematic sample of --full-kl-rows prefill rows (π = rows / prefill rows, weighted 1/π). Intervals: 95%
document bootstrap (evalsuite.stats), one window per document. Noise floor: the base's decode path against its
own prefill path on the first --floor-windows windows (kernel noise, not damage).

Probes (multi-key passkey, RULER's MK-NIAH shape): one context of exactly C tokens holds --probe-needles needles,
"The pass key of <label> is <5 digits>. ...", at evenly spaced depths 0 .. 1 of the filler (the evaluation
documents, concatenated in a seeded order, each needle snapped to a line break); C is each --probe-contexts entry
(capped at the model's context minus the question and answer). Each needle is asked for in its own request,
context + "What is the pass key of <label>? ..." + 8 greedy tokens. The first request prefills the context;
the rest hit the prefix cache, so one C-token prefill yields --probe-needles probes. Correct = the first 5-digit
number of the answer is the key. Per variant: accuracy by context and depth, and the flip rate (base right,
variant wrong) with its exact interval and McNemar's p (evalsuite.compare's probe comparison).

Writes <out-dir>/long-context-<model>.json, .md and .png (KL by position bucket with the decode-path points;
probe accuracy by context). Builds go to $TOKQ_HOME/bench-long/<model>/ (reused when their calibration is the same).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_cache_quant import (  # noqa: E402
    bench_setup,
    bucket_start,
    documents_hash,
    error_bars,
    long_split,
    without_machine_paths,
)
from kv_cache_quant import build as build_kv  # noqa: E402
from mixed_precision import git_commit, home_relative, write_split  # noqa: E402

from tokq.longctx.multi_key_probes import (  # noqa: E402
    MAX_NEW_TOKENS,
    accuracy_grid,
    build_contexts,
    by_context,
    run_multi_key_probes,
)

RESULTS = Path(__file__).resolve().parent / "results"
# (variant, build, cache scales): build "int4" is GPTQ w4a16, "kv-fp8"/"kv-int8" KV-only builds
VARIANTS = (("int4-gptq", "int4", "auto"), ("fp8-unit", "kv-fp8", "unit"), ("fp8-calibrated", "kv-fp8", "auto"),
            ("int8-calibrated", "kv-int8", "auto"))
PREFILL_CHUNK = 2048


# ---------------------------------------------------------------- pure: row split, probes, table, plot

def split_rows(metrics, decode_from: int):
    """(prefill, decode) parts of a TokenMetrics scored with `decode_from` = d: a predicted token at position
    p <= d came from a prefill step (hidden row p - 1 < d), one at p > d from a decode step."""
    decode = metrics.position > decode_from

    def pick(mask):
        return replace(metrics, **{f.name: getattr(metrics, f.name)[mask] for f in fields(metrics)
                                   if getattr(metrics, f.name) is not None})
    return pick(~decode), pick(decode)


def reweight_tail(metrics, prob: float):
    """The KL with the sampled tail gap weighted 1/π (the scoring ran with π = 1 for every kept row)."""
    if prob >= 1.0:
        return metrics
    return replace(metrics, kl=metrics.kl_topk + metrics.kl_gap / prob)




def probe_markdown(probes: dict) -> list[str]:
    lines = []
    for name, p in probes["variants"].items():
        cmp_ = p.get("comparison")
        if not cmp_:
            continue
        iv = cmp_["intervals"]["flip_rate"]
        lines.append(f"| {name} | {cmp_['b_accuracy']:.1%} | {cmp_['a_right_b_wrong']} / {cmp_['n']} | "
                     f"{cmp_['flip_rate']:.1%} [{iv['low']:.1%}, {iv['high']:.1%}] | {cmp_['a_wrong_b_right']} | "
                     f"{cmp_['mcnemar_p']:.3g} |")
    return lines


def _est(e: dict | None, digits: int = 3, pct: bool = False) -> str:
    if not e:
        return "-"
    if e.get("low") is None or e.get("high") is None:  # no interval (one document)
        return f"{e['value']:.1%}" if pct else f"{e['value']:.{digits}g}"
    if pct:
        return f"{e['value']:.1%} [{e['low']:.1%}, {e['high']:.1%}]"
    return f"{e['value']:.{digits}g} [{e['low']:.{digits}g}, {e['high']:.{digits}g}]"




def long_markdown(record: dict) -> str:
    ev = record["evaluation"]
    lines = [f"## Long context: {record['model']} ({record['device']}, {record['threads']} threads, "
             f"commit {record['tokq_commit']})", "",
             f"{ev['windows']} windows of {ev['window']} tokens, one from each of {ev['documents']} documents "
             f"({', '.join(ev['doc_ids'])}). One pass per model and window: chunked prefill to position "
             f"{ev['decode_from']}, then the last {ev['decode_tokens']} positions one token per step (the decode "
             f"path, positions {ev['decode_from'] + 1}..{ev['window'] - 1}). 95% document-bootstrap intervals "
             f"({ev['documents']} documents: wide, and may undercover).", "",
             "| variant | prefill KL | prefill top-1 | decode KL (>= "
             f"{ev['decode_from'] + 1}) | decode top-1 |", "|---|---|---|---|---|"]
    for name, v in record["variants"].items():
        lines.append(f"| {name} | {_est(v['prefill']['kl'])} | {_est(v['prefill']['top1'], pct=True)} | "
                     f"{_est(v['decode']['kl'])} | {_est(v['decode']['top1'], pct=True)} |")
    floor = record.get("noise_floor")
    if floor:
        lines += ["", f"Noise floor ({floor['what']}, {floor['tokens']} decode tokens): mean KL "
                      f"{floor['decode_kl_mean']:.2e} (max {floor['decode_kl_max']:.2e}), top-1 "
                      f"{floor['decode_top1']:.1%}; on the {floor['prefill_tokens']} prefill tokens of the same "
                      f"windows: mean KL {floor['prefill_kl_mean']:.2e}."]
    buckets = sorted({b for v in record["variants"].values() for b in v["prefill_buckets"]}, key=bucket_start)
    names = list(record["variants"])
    lines += ["", "Prefill-path KL by position bucket (mean [95% CI]):", "",
              "| bucket | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for b in buckets:
        lines.append(f"| {b} | " + " | ".join(_est(record["variants"][n]["prefill_buckets"].get(b, {}).get("kl"))
                                                 for n in names) + " |")
    lines += ["", "Prefill-path top-1 agreement by position bucket:", "",
              "| bucket | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for b in buckets:
        lines.append(f"| {b} | " + " | ".join(
            _est(record["variants"][n]["prefill_buckets"].get(b, {}).get("top1"), pct=True) for n in names) + " |")
    for check in record.get("targets", []):
        lines += ["", f"Target: {check['what']} <= {check['target']}: ratio {check['ratio']:.3f} "
                      f"({'met' if check['met'] else 'not met'}); conservative {check['conservative_ratio']:.3f}."]
    probes = record.get("probes")
    if probes:
        lines += ["", f"Multi-key passkey probes: {probes['needles']} needles per context, "
                      f"{probes['fillers']} filler orders per context, contexts {probes['contexts']}: "
                      f"{probes['n']} probes per model; prefix-cache hits {probes['prefix_hit_rate']:.1%} of the "
                      "base's prompt tokens.", "",
                  "Base accuracy by context (rows) and needle depth (columns):", ""]
        grid = probes["base_grid"]
        depths = sorted({d for row in grid.values() for d in row})
        lines += ["| context | " + " | ".join(depths) + " | all |", "|---" * (len(depths) + 2) + "|"]
        for c, row in grid.items():
            acc = probes["base_by_context"][c]
            lines.append(f"| {c} | " + " | ".join(f"{row.get(d, float('nan')):.0%}" for d in depths)
                         + f" | {acc:.0%} |")
        lines += ["", "| variant | accuracy | base right, variant wrong | flip rate [95% exact] | recovered | "
                      "McNemar p |", "|---|---|---|---|---|---|"]
        lines += probe_markdown(probes)
        by_ctx = {n: p["by_context"] for n, p in probes["variants"].items()}
        lines += ["", "Accuracy by context:", "",
                  "| context | base | " + " | ".join(by_ctx) + " |", "|---" * (len(by_ctx) + 2) + "|"]
        for c, acc in probes["base_by_context"].items():
            lines.append(f"| {c} | {acc:.0%} | " + " | ".join(f"{by_ctx[n].get(c, float('nan')):.0%}"
                                                            for n in by_ctx) + " |")
    return "\n".join(lines) + "\n"


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes = record.get("probes")
    fig, axes = plt.subplots(1, 2 if probes else 1, figsize=(13 if probes else 8, 4.8), squeeze=False)
    ax = axes[0][0]
    decode_x = record["evaluation"]["decode_from"] + 1
    for i, (name, v) in enumerate(record["variants"].items()):
        items = sorted(v["prefill_buckets"].items(), key=lambda kv: bucket_start(kv[0]))
        xs = [bucket_start(b) + 1 for b, _ in items]
        ys = [e["kl"]["value"] for _, e in items]
        err = error_bars([e["kl"] for _, e in items])
        line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{name} (prefill)")
        k = v["decode"]["kl"]
        ax.errorbar([decode_x * (1.03 + 0.03 * i)], [k["value"]], yerr=error_bars([k]),
                    marker="D", color=line[0].get_color(), capsize=3, linestyle="none", label=f"{name} (decode)")
    floor = record.get("noise_floor")
    if floor and floor["decode_kl_mean"] > 0:
        ax.axhline(floor["decode_kl_mean"], color="grey", linestyle=":", label="noise floor (decode vs prefill)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("position in window (bucket start + 1; diamonds: decode path at the window's end)")
    ax.set_ylabel("mean KL(base ‖ variant), nats")
    ax.set_title(f"{record['model']}: KL by position, {record['evaluation']['window']}-token windows")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    if probes:
        ax2 = axes[0][1]
        ctxs = list(probes["base_by_context"])
        xs = [int(c) for c in ctxs]
        ax2.plot(xs, [probes["base_by_context"][c] for c in ctxs], marker="s", color="black", label="base")
        for name, p in probes["variants"].items():
            ax2.plot(xs, [p["by_context"].get(c, float("nan")) for c in ctxs], marker="o", label=name)
        ax2.set_xscale("log", base=2)
        ax2.set_ylim(-0.03, 1.03)
        ax2.set_xlabel("probe context (tokens)")
        ax2.set_ylabel("multi-key passkey accuracy")
        ax2.set_title(f"{probes['needles']} needles per context, {probes['n']} probes per model")
        ax2.legend(fontsize=7)
        ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- the run

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--data", default=None, help="documents (default: the default long-document set)")
    p.add_argument("--window", type=int, default=32768)
    p.add_argument("--windows", type=int, default=4, help="evaluation windows, one per long document")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--full-kl-rows", type=int, default=256, help="prefill rows scored over the whole vocabulary")
    p.add_argument("--floor-windows", type=int, default=1)
    p.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    p.add_argument("--probe-contexts", default="4096,8192,16384,32768", help="'' for no probes")
    p.add_argument("--probe-needles", type=int, default=8)
    p.add_argument("--probe-fillers", type=int, default=2, help="filler orders (contexts) per probe context")
    p.add_argument("--num-samples", type=int, default=16, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=2048, help="calibration window tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    return p.parse_args(argv)


def build_int4(args, checkpoint: Path, choice_dir: Path, choice_hash: str, work: Path) -> tuple[Path, dict]:
    """GPTQ w4a16 g128 on the calibration documents, reused when its calibration is the same."""
    from tokq.api.quantize import run_quantize
    from tokq.settings import QuantizeSettings

    out = work / "builds" / "int4-gptq"
    key = {"method": "gptq", "scheme": "w4a16", "group_size": 128, "num_samples": args.num_samples,
           "seq_len": args.seq_len, "seed": args.seed, "choice_documents_sha256": choice_hash,
           "model": str(checkpoint)}
    record = out / "tokq_quantization.json"
    if record.is_file() and json.loads(record.read_text()).get("bench_key") == key:
        print(f"int4-gptq: reusing {home_relative(out)}", flush=True)
        return out, {"reused": True}
    started = time.perf_counter()
    s = QuantizeSettings(method="gptq", scheme="w4a16", group_size=128, calib=choice_dir,
                         num_samples=args.num_samples, seq_len=args.seq_len, seed=args.seed)
    run_quantize(str(checkpoint), out, s, force=out.exists(), extra_provenance={"bench_key": key},
                 threads=args.threads, device=args.device)
    return out, {"seconds": round(time.perf_counter() - started, 1)}


def make_engine(checkpoint: Path, tokenizer, runtime, max_model_len: int, kv_scales: str = "auto"):
    from tokq.engine.checkpoint import load_model
    from tokq.engine.llm_engine import EngineConfig, LLMEngine

    model = load_model(checkpoint, dtype="bf16", device=runtime.device)
    # kv_dtype None: the checkpoint's calibrated cache dtype where it has one (the KV builds), else the model's
    return LLMEngine(model, EngineConfig(max_model_len=max_model_len, max_num_seqs=16,
                                         max_num_batched_tokens=PREFILL_CHUNK, kv_scales=kv_scales), tokenizer)


def full_sample(windows, decode_from: int, budget: int, seed: int):
    """Rows both models keep whole: a systematic sample of the prefill rows and every decode row; π = 1 for the
    run (the prefill rows' own π is returned and applied afterwards by reweight_tail)."""
    import torch

    from tokq.evalsuite.full_kl import FullSample, systematic_sample

    pre = systematic_sample([decode_from] * len(windows), budget, seed)  # prefill rows 0 .. d-1 per window
    rows = [torch.cat([r, torch.arange(decode_from, len(w.tokens) - 1)]) for r, w in zip(pre.rows, windows,
                                                                                       strict=True)]
    return FullSample(rows, 1.0), pre.prob


def summarize(metrics, doc_ids: list[str], window: int, seed: int) -> dict:
    from tokq.evalsuite.compare import _kl_tails_from
    from tokq.evalsuite.stats.aggregation import aggregate

    agg = aggregate(metrics.as_dict(), metrics.doc_index, metrics.position, doc_ids, window, resamples=1000,
                    seed=seed, kl_tails_from=_kl_tails_from(metrics))
    keep = ("value", "low", "high", "n_tokens", "n_docs")

    def est(o: dict) -> dict:
        return {m: {k: o[m].get(k) for k in keep} for m in ("kl", "kl_topk", "top1", "delta_nll") if m in o}
    return {"overall": est(agg["overall"]), "buckets": {b: est(e) for b, e in agg["buckets"].items()}}


def main(argv=None) -> None:  # noqa: C901 - one linear script
    args = parse_args(argv)
    loadavg_before = os.getloadavg()
    started = time.perf_counter()
    import torch

    from tokq.engine.tokenizer import load_tokenizer, model_adds_bos
    from tokq.evalsuite.ab import score_baseline, score_candidate
    from tokq.evalsuite.compare import _probe_comparison
    from tokq.longctx.text_encoding import as_text_encoder
    from tokq.longctx.windows import build_windows
    from tokq.reports.json_io import write_json

    runtime, checkpoint, name, work, data, docs = bench_setup(args, "bench-long")
    tokenizer = load_tokenizer(checkpoint)
    add_bos = model_adds_bos(tokenizer)
    capacity = args.window - int(add_bos)
    long_docs, choice = long_split(docs.documents, tokenizer, capacity)
    if len(long_docs) < args.windows or not choice:
        raise SystemExit(f"{len(long_docs)} documents hold {capacity}+ tokens (need {args.windows}) and "
                         f"{len(choice)} are shorter (calibration): grow the document set")
    step = len(long_docs) / args.windows
    held = [long_docs[int(i * step)] for i in range(args.windows)]
    choice_dir = work / "split" / "choice"
    write_split(choice, choice_dir)
    choice_hash = documents_hash(choice)
    wanted = [v for v in VARIANTS if v[0] in args.variants.split(",")]
    builds: dict[str, tuple[Path, dict]] = {}
    for _, build_name, _ in wanted:
        if build_name in builds:
            continue
        if build_name == "int4":
            builds[build_name] = build_int4(args, checkpoint, choice_dir, choice_hash, work)
        else:
            kv = build_name.removeprefix("kv-")
            path, rec = build_kv(args, build_name, kv, checkpoint, choice_dir, choice_hash, work)
            builds[build_name] = (path, without_machine_paths({k: v for k, v in rec.items() if k != "calibration"}))

    windows = build_windows(held, as_text_encoder(tokenizer, add_bos), args.window, add_bos=add_bos,
                            max_windows=None).windows
    windows = [next(w for w in windows if w.doc_id == d.doc_id) for d in held]  # each document's first window
    assert all(len(w.tokens) == args.window for w in windows)
    doc_ids = [w.doc_id for w in windows]
    doc_index = list(range(len(windows)))
    decode_from = args.window - args.decode_tokens
    sample, prefill_prob = full_sample(windows, decode_from, args.full_kl_rows, args.seed)
    contexts_wanted = [int(c) for c in args.probe_contexts.split(",") if c.strip()]
    question_room = 24 + MAX_NEW_TOKENS
    max_len = max(args.window, *(contexts_wanted or [0])) + question_room
    config_len = json.loads((checkpoint / "config.json").read_text()).get("max_position_embeddings", max_len)
    max_len = min(max_len, config_len)
    probe_contexts = build_contexts(held, tokenizer, [min(c, max_len - question_room) for c in contexts_wanted],
                                    args.probe_needles, args.probe_fillers, args.seed, add_bos)

    record: dict = {
        "benchmark": "long_context", "model": name, "tokq_commit": git_commit(), "device": str(runtime.device),
        "threads": runtime.threads, "cpu_count": os.cpu_count(), "hardware": runtime.hardware,
        "torch": torch.__version__, "settings": {**{k: v for k, v in vars(args).items() if k not in ("out_dir", "data")},
                                                 "data": home_relative(data)},
        "split": {"evaluation": f"{args.windows} of the {len(long_docs)} documents of {capacity}+ tokens, the first "
                                "window of each; calibration: the documents shorter than a window",
                  "calibration_documents": len(choice), "long_documents": len(long_docs)},
        "builds": {k: {"path": home_relative(v[0]), **v[1]} for k, v in builds.items()},
        "evaluation": {"window": args.window, "windows": len(windows), "documents": len(set(doc_ids)),
                       "doc_ids": doc_ids, "decode_from": decode_from, "decode_tokens": args.decode_tokens,
                       "prefill_chunk": PREFILL_CHUNK, "kl_full_rows": {"prefill": args.full_kl_rows,
                                                                        "prefill_prob": prefill_prob,
                                                                        "decode": "every row"}},
        "loadavg_before": loadavg_before, "variants": {}, "seconds": {}, "targets": [],
    }
    stem = args.out_dir / f"long-context-{name}"
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        record["loadavg_after"] = os.getloadavg()
        record["seconds"]["total"] = round(time.perf_counter() - started, 1)
        write_json(stem.with_suffix(".json"), record)

    # the base: its scores on every window (both paths), the noise floor, its probes
    t0 = time.perf_counter()
    engine = make_engine(checkpoint, tokenizer, runtime, max_len)
    base = score_baseline(engine, windows, 256, decode_from, sample=sample,
                          progress=lambda n: print(f"  base: window scored ({time.perf_counter() - t0:.0f}s)",
                                                   flush=True))
    record["seconds"]["base_scoring"] = round(time.perf_counter() - t0, 1)
    print(f"base scored {len(windows)} windows in {record['seconds']['base_scoring']:.0f}s", flush=True)
    if args.floor_windows:
        t1 = time.perf_counter()
        k = min(args.floor_windows, len(windows))
        floor = score_candidate(engine, windows[:k], base[:k], doc_index[:k], None)  # the prefill path, as B
        pre, dec = split_rows(floor, decode_from)
        record["noise_floor"] = {
            "what": "the base's decode path (as A) against its own prefill path (as B), run alone: other prefill "
                    "chunk boundaries too, so the prefill tokens show the chunking's own noise", "windows": k,
            "tokens": dec.tokens, "decode_kl_mean": float(dec.kl.mean()), "decode_kl_max": float(dec.kl.max()),
            "decode_top1": float(dec.top1.mean()), "prefill_tokens": pre.tokens,
            "prefill_kl_mean": float(pre.kl_topk.mean()), "seconds": round(time.perf_counter() - t1, 1)}
        print(f"noise floor: decode KL {record['noise_floor']['decode_kl_mean']:.2e}", flush=True)
    base_probes: list[dict] = []
    if probe_contexts:
        t1 = time.perf_counter()
        base_probes, hit_rate = run_multi_key_probes(engine, probe_contexts, tokenizer)
        record["probes"] = {"needles": args.probe_needles, "fillers": args.probe_fillers,
                            "contexts": sorted({c.context for c in probe_contexts}), "n": len(base_probes),
                            "prefix_hit_rate": hit_rate, "base_by_context": by_context(base_probes),
                            "base_grid": accuracy_grid(base_probes), "base": base_probes, "variants": {},
                            "seconds": {"base": round(time.perf_counter() - t1, 1)}}
        print(f"base probes: {by_context(base_probes)} (prefix hits {hit_rate:.0%}, "
              f"{time.perf_counter() - t1:.0f}s)", flush=True)
    del engine
    save()

    for variant, build_name, scales in wanted:
        t0 = time.perf_counter()
        engine = make_engine(builds[build_name][0], tokenizer, runtime, max_len, kv_scales=scales)
        metrics = score_candidate(engine, windows, base, doc_index, decode_from)
        pre, dec = split_rows(metrics, decode_from)
        pre = reweight_tail(pre, prefill_prob)
        p, d = summarize(pre, doc_ids, args.window, args.seed), summarize(dec, doc_ids, args.window, args.seed)
        record["variants"][variant] = {
            "build": build_name, "kv_cache": f"{engine.kv_plan.dtype} ({engine.kv_plan.scales_note})",
            "prefill": p["overall"], "prefill_buckets": p["buckets"], "decode": d["overall"],
            "tokens": {"prefill": pre.tokens, "decode": dec.tokens}}
        record["seconds"][variant] = round(time.perf_counter() - t0, 1)
        if base_probes:
            t1 = time.perf_counter()
            results, _ = run_multi_key_probes(engine, probe_contexts, tokenizer)
            cmp_ = _probe_comparison(base_probes, results)
            cmp_.pop("a_grid", None)
            record["probes"]["variants"][variant] = {"by_context": by_context(results),
                                                     "grid": accuracy_grid(results), "comparison": cmp_}
            record["probes"]["seconds"][variant] = round(time.perf_counter() - t1, 1)
        del engine
        v = record["variants"][variant]
        print(f"{variant:16s} prefill KL {_est(v['prefill']['kl'])}  decode KL {_est(v['decode']['kl'])}  "
              f"[{record['seconds'][variant]:.0f}s]", flush=True)
        unit, cal = record["variants"].get("fp8-unit"), record["variants"].get("fp8-calibrated")
        if unit and cal:
            u, c = unit["decode"]["kl"], cal["decode"]["kl"]
            record["targets"] = [{
                "what": f"fp8-calibrated / fp8-unit decode-path mean KL (positions > {decode_from})", "target": 0.5,
                "ratio": c["value"] / u["value"] if u["value"] > 0 else float("inf"),
                "conservative_ratio": c["high"] / u["low"] if u["low"] > 0 else float("inf"),
                "met": u["value"] > 0 and c["value"] / u["value"] <= 0.5}]
        save()
    stem.with_suffix(".md").write_text(long_markdown(record), encoding="utf-8")
    plot(record, stem.with_suffix(".png"))
    print(long_markdown(record))


if __name__ == "__main__":
    main()
