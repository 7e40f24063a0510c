"""How much of the full-vocabulary KL(A‖B) the top-k figure misses, and how well the sampled estimate recovers it.

    python benchmarks/kl_topk.py [--model smollm2-135m] [--variant /tmp/awq-int4] [--windows 2] [--window 512]
        [--ks 16 64 256 1024 0] [--rows 64 128 256] [--sims 200] [--threads 2] [--compare]

Both models score the same windows of the default documents (as `tokq compare --window W --sample-windows N`
picks them; bf16 compute, like compare on a CPU) keeping the whole vocabulary at every position, one window at a
time. From those rows, per k (0 = the vocabulary): A's mass covered by its top-k, the top-k + bucket KL (the
lower bound, `kl_topk`), the exact KL, and the estimate `tokq compare` reports (evalsuite.full_kl: kl_topk plus
the exact tail gap on a systematic sample of `rows` positions, weighted by 1/π) with its interval (the project's
paired document bootstrap) for seed 0, plus, over `sims` seeds of the sample, its mean signed and RMS error
relative to the exact KL and how often the interval covers it. The gap is computed through the same code as
compare (A's tail in fp16), so `pipeline_error` is the fp16 storage's own error against the fp32 exact KL.
With --compare, `tokq compare` itself also runs at its defaults (no probes) on the same windows, with its baseline
cache in a temporary $TOKQ_HOME to measure the entry's size. Writes benchmarks/results/kl-topk-<model>-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from tokq import __version__
from tokq.engine.checkpoint import load_model
from tokq.engine.llm_engine import EngineConfig, LLMEngine
from tokq.engine.tokenizer import load_tokenizer, model_adds_bos
from tokq.evalsuite.ab import BaselineWindow, scored_rows, token_metrics
from tokq.evalsuite.full_kl import a_tail, full_row_kl, systematic_sample, tail_gap
from tokq.evalsuite.stats.bootstrap import paired_bootstrap
from tokq.longctx.documents import load_documents
from tokq.longctx.text_encoding import as_text_encoder, tokenize_documents
from tokq.longctx.windows import build_windows
from tokq.paths import data_dir
from tokq.zoo import resolve_model

RESULTS = Path(__file__).resolve().parent / "results"


def windows_of(checkpoint: Path, window: int, count: int):
    tokenizer = load_tokenizer(checkpoint)
    add_bos = model_adds_bos(tokenizer)
    encoder = as_text_encoder(tokenizer, add_bos)
    docs = load_documents(data_dir() / "default")
    encoded = tokenize_documents(docs.documents, encoder)
    return build_windows(docs.documents, encoder, window, None, add_bos, None, encoded=encoded).sample(count).windows


def engine_of(checkpoint: Path, dtype: str, window: int) -> LLMEngine:
    return LLMEngine(load_model(checkpoint, dtype=dtype, device="cpu"),
                     EngineConfig(max_model_len=window, max_num_seqs=1, max_num_batched_tokens=window))


def per_token(engine_a: LLMEngine, engine_b: LLMEngine, windows, ks: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Per k: coverage, kl_topk, gap (through compare's code) and the exact KL per scored token, plus doc index."""
    out: dict[int, dict[str, list[torch.Tensor]]] = {k: {n: [] for n in ("coverage", "kl_topk", "gap", "exact", "doc")}
                                                    for k in ks}
    doc_ids = list(dict.fromkeys(w.doc_id for w in windows))
    for window in windows:
        rows = scored_rows(window)
        mask = torch.zeros(len(window.tokens) - 1, dtype=torch.bool)
        mask[rows] = True
        la = engine_a.score([window.tokens], full_rows=[mask])[0].full_logprobs
        lb = engine_b.score([window.tokens], full_rows=[mask])[0].full_logprobs
        exact = full_row_kl(la, lb)
        actual = torch.tensor(window.tokens[rows.start + 1: rows.stop + 1])[:, None]
        for k in ks:
            vals, ids = la.topk(k, -1)
            gathered = lb.gather(1, ids)
            base = BaselineWindow(la.gather(1, actual)[:, 0], ids, vals)
            m = token_metrics(base, lb.gather(1, actual)[:, 0], lb.max(-1).values, gathered, la.shape[-1])
            parts = out[k]
            parts["coverage"].append(m["coverage"].double())
            parts["kl_topk"].append(m["kl_topk"].double())
            parts["gap"].append(tail_gap(a_tail(la, ids), ids, vals, gathered, lb))
            parts["exact"].append(exact)
            parts["doc"].append(torch.full((len(exact),), doc_ids.index(window.doc_id)))
        del la, lb
    return {k: {n: torch.cat(v) for n, v in parts.items()} for k, parts in out.items()}


def estimate(kl_topk, gap, doc, counts: list[int], rows: int, seed: int, resamples: int):
    sample = systematic_sample(counts, rows, seed)
    offsets = torch.tensor([0, *counts]).cumsum(0)
    picked = torch.cat([r + int(offsets[i]) for i, r in enumerate(sample.rows)])
    kl = kl_topk.clone()
    kl[picked] += gap[picked] / sample.prob
    docs = int(doc.max()) + 1
    return paired_bootstrap({"kl": kl}, doc, docs, resamples=resamples, seed=seed)["kl"]


def table(data: dict[int, dict[str, torch.Tensor]], vocab: int, counts: list[int], rows_list: list[int], sims: int,
          resamples: int) -> list[dict]:
    out = []
    for k, d in data.items():
        exact = float(d["exact"].mean())
        kl_topk = float(d["kl_topk"].mean())
        docs = int(d["doc"].max()) + 1
        exact_ci = paired_bootstrap({"kl": d["exact"]}, d["doc"], docs, resamples=resamples, seed=0)["kl"]
        row = {"k": k if k < vocab else "vocab", "topk": k, "coverage": float(d["coverage"].mean()),
               "kl_topk": kl_topk, "kl_topk_share_missed": 1 - kl_topk / exact if exact else None,
               "exact": exact, "exact_ci": [exact_ci.low, exact_ci.high],
               "pipeline_error": float((d["kl_topk"] + d["gap"] - d["exact"]).mean()),
               "estimates": {}}
        for rows in rows_list:
            first = estimate(d["kl_topk"], d["gap"], d["doc"], counts, rows, 0, resamples)
            errors, covered = [], 0
            for seed in range(sims):
                est = estimate(d["kl_topk"], d["gap"], d["doc"], counts, rows, seed, resamples)
                errors.append((est.value - exact) / exact if exact else 0.0)
                covered += est.low <= exact <= est.high
            e = torch.tensor(errors, dtype=torch.float64)
            row["estimates"][str(rows)] = {
                "seed0": {"value": first.value, "low": first.low, "high": first.high},
                "bias": float(e.mean()), "rms_error": float(e.pow(2).mean().sqrt()),
                "p95_abs_error": float(e.abs().quantile(0.95)), "ci_covers_exact": covered / sims}
        out.append(row)
        est0 = row["estimates"][str(rows_list[-1])]
        print(f"k={row['k']!s:>6}  covered {row['coverage']:.1%}  top-k KL {kl_topk:.4f}  exact {exact:.4f}  "
              f"estimate ({rows_list[-1]} rows) {est0['seed0']['value']:.4f} [{est0['seed0']['low']:.4f}, "
              f"{est0['seed0']['high']:.4f}]  rms {est0['rms_error']:.2%}  covers {est0['ci_covers_exact']:.0%}",
              flush=True)
    return out


def run_compare(a: Path, b: Path, window: int, windows: int, threads: int) -> dict:
    """`tokq compare` at its defaults (no probes) on the same windows, its baseline cache in a temporary
    $TOKQ_HOME so the entry's size is measured."""
    from tokq.cli import main as tokq

    data = data_dir() / "default"
    saved = os.environ.get("TOKQ_HOME")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TOKQ_HOME"] = tmp
        try:
            path = Path(tmp) / "compare.json"
            start = time.perf_counter()
            code = tokq(["compare", str(a), str(b), "--data", str(data), "--window", str(window), "--sample-windows",
                         str(windows), "--threads", str(threads), "--no-probes", "--json", str(path)])
        finally:
            os.environ.pop("TOKQ_HOME") if saved is None else os.environ.update(TOKQ_HOME=saved)
        if code not in (0, 1, 3):
            raise SystemExit(f"compare failed (exit {code})")
        r = json.loads(path.read_text())
    out = {"seconds": time.perf_counter() - start, "kl_method": r["kl_method"], "kl_estimator": r["kl_estimator"],
           "coverage_mean": r["coverage_mean"], "cache_bytes": r["cache"].get("bytes"),
           "prefill": {m: r["prefill"]["overall"][m] for m in ("kl", "kl_topk")},
           "decode": {m: r["decode"]["overall"][m] for m in ("kl", "kl_topk")} if r["decode"] else None,
           "settings": {k: r["settings"][k] for k in ("topk", "full_kl_rows", "window")}}
    print(f"compare: KL {out['prefill']['kl']['value']:.4f}, kl_topk {out['prefill']['kl_topk']['value']:.4f}, "
          f"cache entry {out['cache_bytes'] / 1e6:.1f} MB", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variant", type=Path, default=Path("/tmp/awq-int4"))
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 64, 256, 1024, 0], help="0: the vocabulary")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--sims", type=int, default=200)
    parser.add_argument("--resamples", type=int, default=400)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare", action="store_true", help="also run tokq compare (defaults vs exact)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    base = resolve_model(args.model)
    windows = windows_of(base, args.window, args.windows)
    engine_a, engine_b = engine_of(base, args.dtype, args.window), engine_of(args.variant, args.dtype, args.window)
    vocab = engine_a.model.config.vocab_size
    ks = [k if k > 0 else vocab for k in args.ks]
    data = per_token(engine_a, engine_b, windows, ks)
    counts = [len(w.tokens) - max(w.score_from, 1) for w in windows]
    scored = time.perf_counter() - start
    rows = table(data, vocab, counts, args.rows, args.sims, args.resamples)
    del engine_a, engine_b
    report = {
        "tokq_version": __version__, "benchmark": "kl-topk", "model": args.model, "variant": str(args.variant),
        "device": "cpu", "torch": torch.__version__, "settings": {k: (str(v) if isinstance(v, Path) else v)
                                                                 for k, v in vars(args).items()} | {"out": None},
        "vocab": vocab, "windows": len(windows), "documents": len({w.doc_id for w in windows}),
        "scored_tokens": sum(counts),
        "cache_bytes": {"topk_per_1000_tokens": {str(k): 1000 * (8 * k + 4) for k in ks},
                        "full_rows_per_row": 2 * vocab + 20},
        "table": rows, "scoring_seconds": scored, "seconds": time.perf_counter() - start,
    }
    if args.compare:
        report["compare"] = run_compare(base, args.variant, args.window, args.windows, args.threads)
    out = args.out or RESULTS / f"kl-topk-{args.model}-cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
