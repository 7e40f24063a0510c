"""What AWQ's coarse-to-fine scale search and a smaller search sample cost in quality, and what they save in time.

    python benchmarks/awq_search.py [--model smollm2-135m] [--threads 2] [--builds full,coarse,coarse-8]

Builds, all from the same calibration token ids (32 x 512 tokens of the default long-document set, seed 0) at the
model's int4 setting (quant_protocol.MODELS):
- `full`: the paper's exhaustive grid of 20 scale exponents (awq_grid_stride 1), 16 search sequences;
- `coarse`: tokq's default, coarse-to-fine (every 2nd point, then the two neighbours of the best: 12 evaluations);
- `coarse-8`: coarse-to-fine on 8 search sequences (half the tokens).

Two measurements:
1. Same inputs, counterfactual: `full` records every grid point's loss for each (block, mapping); what the
   coarse-to-fine walk (awq.grid_points) at strides 2, 3 and 4 would pick from those very losses is compared with
   the exhaustive pick: how often it is the same point, and the excess loss when it is not (the curves are kept).
2. End to end: each build's KL(base || build) on held-out windows (`--eval-windows` x `--eval-window` tokens
   of the default set, documents as the resampling unit: 95% bootstrap intervals) and each coarse build's KL
   ratio against `full` on the same tokens (paired bootstrap), beside each build's quantization seconds.

Writes benchmarks/results/awq-search-<model>-<cpu>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from calibration_shift import doc_sums, kl_estimate, ratio_estimate  # noqa: E402
from quant_protocol import MODELS, RESULTS, base_and_default_set, base_hiddens  # noqa: E402
from vs_llamacpp import cpu_facts, cpu_tag  # noqa: E402 (the same CPU naming as the other results)

from tokq import __version__  # noqa: E402
from tokq.engine.checkpoint import load_model  # noqa: E402
from tokq.evalsuite.divergence import divergence  # noqa: E402
from tokq.longctx.text_encoding import as_text_encoder  # noqa: E402
from tokq.longctx.windows import build_windows  # noqa: E402
from tokq.paths import data_dir  # noqa: E402
from tokq.quantization.calibration import calibration_samples  # noqa: E402
from tokq.quantization.methods.awq import grid_points  # noqa: E402
from tokq.quantization.methods.options import MethodOptions  # noqa: E402
from tokq.quantization.pipeline import quantize_model, resolve_scheme  # noqa: E402
from tokq.reports.json_io import write_json  # noqa: E402

BUILDS = {
    "full": {"awq_grid_stride": 1},
    "coarse": {"awq_grid_stride": 2},
    "coarse-8": {"awq_grid_stride": 2, "awq_search_samples": 8},
}


def counterfactual(stats: list[dict], grid: int, stride: int) -> dict:
    """From the exhaustive run's per-mapping loss curves: how often the coarse-to-fine walk picks the same point."""
    excess, evaluations = [], []
    for block in stats:
        for info in block.values():
            if not isinstance(info, dict) or not info.get("losses"):
                continue
            curve = info["losses"]
            full_pick = grid_points(grid, 1, curve.__getitem__)[0]
            pick, seen = grid_points(grid, stride, curve.__getitem__)
            excess.append(curve[pick] / curve[full_pick] - 1 if curve[full_pick] > 0 else 0.0)
            evaluations.append(len(seen))
    return {"mappings": len(excess), "same_point": sum(e == 0 for e in excess),
            "same_fraction": sum(e == 0 for e in excess) / max(1, len(excess)),
            "max_relative_loss_excess": max(excess, default=0.0),
            "mean_relative_loss_excess": sum(excess) / max(1, len(excess)),
            "evaluations_per_mapping": max(evaluations, default=0), "stride": stride, "grid": grid}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--builds", default=",".join(BUILDS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--eval-window", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0,
                    help="calibration draw; another than 0 adds a repeat under other_seeds of the existing file")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    builds = [b for b in args.builds.split(",") if b]
    if "full" not in builds or any(b not in BUILDS for b in builds):
        ap.error(f"--builds takes full and any of {', '.join(BUILDS)}")
    torch.set_num_threads(args.threads)
    out = args.out or RESULTS / f"awq-search-{args.model}-{cpu_tag(cpu_facts())}.json"
    checkpoint, tokenizer, add_bos, docs = base_and_default_set(args.model)
    calib = calibration_samples(data_dir() / "default", tokenizer, add_bos, 32, 512, args.seed, documents=docs)
    # Held out from calibration as far as windows go: evaluation windows spread over every document.
    windows = build_windows(docs.documents, as_text_encoder(tokenizer, add_bos), args.eval_window,
                            add_bos=add_bos).sample(args.eval_windows)
    base = load_model(checkpoint, dtype="fp32")
    hiddens = base_hiddens(base, windows)
    setting = MODELS[args.model]
    record: dict = {"benchmark": "awq_search", "tokq_version": __version__, "model": args.model,
                    "setting": {"scheme": setting.scheme, "group_size": setting.group_size},
                    "calibration": {"num_samples": 32, "seq_len": 512, "seed": 0, "data_hash": docs.content_hash()},
                    "eval": {"windows": len(windows.windows), "window": args.eval_window, "tokens": windows.n_tokens,
                             "documents": windows.n_documents},
                    "hardware": {"cpu": cpu_tag(cpu_facts()), "processor": platform.processor(), "cpus": os.cpu_count(),
                                 "torch_threads": torch.get_num_threads(), "load_average_start": os.getloadavg()},
                    "builds": {}}
    cells = {}
    for build in builds:
        options = MethodOptions(**BUILDS[build])
        quant = load_model(checkpoint, dtype="fp32")
        scheme, _ = resolve_scheme("awq", quant.config, setting.scheme, group_size=setting.group_size, symmetric=True)
        started = time.perf_counter()
        result = quantize_model(quant, "awq", scheme, calib, options)
        seconds = time.perf_counter() - started
        d = divergence(base, quant, windows.windows, base_hidden=hiddens)
        names, sums, counts = doc_sums(d.kl, windows)
        cells[build] = {"docs": names, "doc_kl_sums": sums, "doc_tokens": counts}
        entry = {"options": BUILDS[build], "seconds": round(seconds, 1), "kl": kl_estimate(cells[build]),
                 "top1_agreement": d.summary()["top1_agreement"]}
        if build == "full":
            record["counterfactual"] = {f"stride {k}": counterfactual(result.blocks, options.awq_grid, k) for k in (2, 3, 4)}
            record["loss_curves"] = [{"block": b["block"], "mapping": name, "losses": info["losses"]}
                                     for b in result.blocks for name, info in b.items()
                                     if isinstance(info, dict) and info.get("losses")]
        else:
            entry["kl_ratio_to_full"] = ratio_estimate(cells[build], cells["full"])
            entry["speedup_vs_full"] = round(record["builds"]["full"]["seconds"] / seconds, 2)
        record["builds"][build] = entry
        print(build, entry, flush=True)
        record["hardware"]["load_average_end"] = os.getloadavg()
        if args.seed == 0:
            write_json(out, record)
    if args.seed != 0:  # a repeat on another calibration draw: quality only (the seed-0 run has the quiet timings)
        kept = json.loads(out.read_text())
        kept.setdefault("other_seeds", {})[str(args.seed)] = {
            b: {k: v for k, v in e.items() if k in ("kl", "kl_ratio_to_full", "top1_agreement")}
            for b, e in record["builds"].items()}
        ratios = {b: [kept["builds"][b]["kl_ratio_to_full"]["value"]]
                  + [r[b]["kl_ratio_to_full"]["value"] for r in kept["other_seeds"].values() if b in r]
                  for b in kept["builds"] if b != "full"}
        kept["kl_ratio_to_full_by_seed"] = ratios  # seed 0 first, then other_seeds in order
        write_json(out, kept)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
