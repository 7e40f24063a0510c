"""Calibration shift: calibrate on one domain of the default set, judge on the others, tokq beside llm-compressor.

    python benchmarks/calibration_shift.py --model smollm2-135m [--builds rtn,gptq,gptq-minmax,awq,peer-gptq,peer-awq]
        [--calib code,manuals,prose] [--eval NAME=DIR ...] [--threads 1] [--peer-python /work/peer-venv/bin/python]

Domains, of tokq's two built-in sets (`tokq data build-default [--set code]`):

- code: `cpython-stdlib` (Python source; default set);
- manuals: `python-doc` + `linux-doc` (reference manuals; default set);
- prose: `debian-policy` + `gnu-standards` (policy and standards texts; default set);
- code-set: the code set's PyTorch Python and C++ and transformers sources (what the code models are
  calibrated on: `--calib code-set` judges them on other code (the stdlib) and on manuals and prose).

For each calibration domain every calibrated build is quantized on the same calibration token ids
(`calibration_samples` over that domain's documents: 32 x 512 tokens by default, seed 0, drawn as a mix of
the domain's sources), and judged on every *other* domain plus each `--eval NAME=DIR` folder (held-out
documents of the user's choosing), `--eval-windows` windows of `--eval-window` tokens spread evenly over
each, against the fp32 base: per-token KL(base‖quant) over the full vocabulary. RTN needs no calibration
and is quantized once.

Builds: tokq's `rtn`, `gptq` (the default: MSE-searched group scales), `gptq-minmax` (min/max group
scales, tokq's GPTQ before issue 20), `gptq-no-actorder` (dynamic groups), `awq`; at 8 bits `w8a8-rtn` (int8
W8A8 without smoothing), `smoothquant` (SmoothQuant's migration, then int8 W8A8) and `fp8` (FP8 e4m3 W8A8);
builds that need no calibration (RTN, W8A8 RTN, FP8) are quantized once; llm-compressor's
`peer-gptq` and `peer-awq` (its default recipes at the model's int4 setting from quant_protocol.MODELS,
run in the optional peer venv by peer_quant.run_peer on the same token ids, loaded back with tokq's
reader).

Statistics (all over the documents of the evaluation set: a document is the resampling unit):
- each build's mean KL with a 95% document-clustered bootstrap interval;
- each build's KL reduction against RTN on the same tokens, 1 - KL_build / KL_rtn, with a 95% percentile
  bootstrap interval over documents (both sums resampled together);
- tokq against llm-compressor: the ratio KL_tokq / KL_peer per method, same bootstrap.
Targets (issue 20), per (calibration, evaluation) pair: tokq GPTQ >= 25% below RTN and no worse than
llm-compressor's GPTQ; tokq AWQ >= 25% below RTN (point estimates; intervals beside them).

Also the token distance between each calibration set and each evaluation set, in-domain included
(tokq.evalsuite.calibration_distance: the excess of the unigram Jensen-Shannon divergence over that of
same-distribution samples of the same sizes), so the warning threshold that `tokq compare` applies can be
read against measured gains.

Resumable: cells already in the result file for the same settings are kept; `--builds ""` quantizes
nothing and refreshes the distances, the summary and the table.

Writes benchmarks/results/calibration-shift-<model>.json and .md after every build.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from peer_quant import run_peer  # noqa: E402
from quant_protocol import MODELS, RESULTS, base_and_default_set  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tokq import __version__  # noqa: E402
from tokq.engine.checkpoint import load_model  # noqa: E402
from tokq.evalsuite.calibration_distance import token_distance, token_histogram  # noqa: E402
from tokq.evalsuite.divergence import divergence, final_hidden  # noqa: E402
from tokq.evalsuite.stats.bootstrap import mean_interval  # noqa: E402
from tokq.longctx.documents import load_documents  # noqa: E402
from tokq.longctx.text_encoding import as_text_encoder  # noqa: E402
from tokq.longctx.windows import build_windows  # noqa: E402
from tokq.paths import data_dir  # noqa: E402
from tokq.quantization.calibration import calibration_samples  # noqa: E402
from tokq.quantization.methods.options import MethodOptions  # noqa: E402
from tokq.quantization.pipeline import quantize_model, resolve_scheme  # noqa: E402
from tokq.reports.json_io import write_json  # noqa: E402

DOMAINS = {
    "code": ("cpython-stdlib",),
    "manuals": ("python-doc", "linux-doc"),
    "prose": ("debian-policy", "gnu-standards"),
    "code-set": ("torch-python", "torch-cpp", "transformers-python"),
}
DOMAIN_SET = {"code-set": "code"}  # the built-in set a domain's documents come from (else "default")
# build name -> (who, method, MethodOptions overrides[, scheme: a preset name; default the model's W4 setting])
BUILDS = {
    "rtn": ("tokq", "rtn", {}),
    "gptq": ("tokq", "gptq", {}),
    "gptq-minmax": ("tokq", "gptq", {"gptq_scale_search": "minmax"}),
    "gptq-no-actorder": ("tokq", "gptq", {"act_order": False}),  # dynamic groups, MSE scales
    "awq": ("tokq", "awq", {}),
    "w8a8-rtn": ("tokq", "rtn", {}, "w8a8-int8"),
    "smoothquant": ("tokq", "smoothquant", {}, "w8a8-int8"),
    "fp8": ("tokq", "fp8", {}, "w8a8-fp8"),
    "peer-gptq": ("llm-compressor", "gptq", {}),
    "peer-awq": ("llm-compressor", "awq", {}),
}
UNCALIBRATED = {b for b, spec in BUILDS.items() if spec[0] == "tokq" and spec[1] in ("rtn", "fp8")}
DEFAULT_PEER_PYTHON = os.environ.get("TOKQ_PEER_PYTHON", "/work/peer-venv/bin/python")
RESAMPLES = 2000


def domain_documents(root_docs, domain: str):
    """The documents of `domain`'s sources; `root_docs` maps a built-in set's name to its DocumentSet (doc ids
    under a set are `<source>/<path>`)."""
    sources = DOMAINS[domain]
    set_docs = root_docs[DOMAIN_SET.get(domain, "default")]
    docs = [d for d in set_docs.documents if d.doc_id.split("/", 1)[0] in sources]
    if not docs:
        raise SystemExit(f"the {DOMAIN_SET.get(domain, 'default')} set has no documents of {', '.join(sources)}: "
                         "rebuild it with `tokq data build-default` (scripts/install_docs.sh installs the Debian doc "
                         "packages)")
    return replace(set_docs, documents=docs)


def builtin_sets() -> dict:
    """Both built-in sets, read (each built here at its first use)."""
    from tokq.longctx.builtin_sets import ensure_builtin_set

    return {name: load_documents(ensure_builtin_set(name)) for name in ("default", "code")}


def eval_sets(root_docs, extra: list[str], tokenizer, add_bos: bool, count: int, window: int) -> dict:
    """name -> (windows, documents) for every domain and every --eval NAME=DIR folder."""
    encode = as_text_encoder(tokenizer, add_bos)
    out = {}
    named = [(d, domain_documents(root_docs, d)) for d in DOMAINS]
    for spec in extra:
        name, _, folder = spec.partition("=")
        if not folder:
            raise SystemExit(f"--eval {spec!r}: write NAME=DIR")
        named.append((name, load_documents(Path(folder))))
    for name, docs in named:
        windows = build_windows(docs.documents, encode, window, add_bos=add_bos).sample(count)
        out[name] = (windows, docs)
    return out


def doc_sums(kl: torch.Tensor, windows) -> tuple[list[str], list[float], list[int]]:
    """Per-document KL sums and scored-token counts (a window scores len(tokens) - max(score_from, 1) tokens)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    at = 0
    for w in windows.windows:
        n = len(w.tokens) - max(int(w.score_from), 1)
        sums[w.doc_id] = sums.get(w.doc_id, 0.0) + float(kl[at : at + n].double().sum())
        counts[w.doc_id] = counts.get(w.doc_id, 0) + n
        at += n
    if at != kl.shape[0]:
        raise RuntimeError(f"scored {kl.shape[0]} tokens, windows account for {at}")
    docs = sorted(sums)
    return docs, [sums[d] for d in docs], [counts[d] for d in docs]


def kl_estimate(cell: dict) -> dict:
    point, low, high = mean_interval(torch.tensor(cell["doc_kl_sums"])[:, None], torch.tensor(cell["doc_tokens"]),
                                     resamples=RESAMPLES)
    return {"value": float(point[0]), "low": float(low[0]), "high": float(high[0]),
            "n_docs": len(cell["docs"]), "n_tokens": int(sum(cell["doc_tokens"]))}


def ratio_estimate(a: dict, b: dict, seed: int = 0) -> dict:
    """KL_a / KL_b on the same tokens, with a 95% percentile bootstrap over documents (paired)."""
    if a["docs"] != b["docs"] or a["doc_tokens"] != b["doc_tokens"]:
        raise RuntimeError("ratio of cells scored on different tokens")
    sa, sb = torch.tensor(a["doc_kl_sums"], dtype=torch.float64), torch.tensor(b["doc_kl_sums"], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, len(sa), (RESAMPLES, len(sa)), generator=gen)
    boot = sa[draws].sum(1) / sb[draws].sum(1)
    return {"value": float(sa.sum() / sb.sum()), "low": float(torch.quantile(boot, 0.025)),
            "high": float(torch.quantile(boot, 0.975)), "n_docs": len(sa)}


def quantize_tokq(build: str, model: str, checkpoint: Path, calib) -> tuple:
    _who, method, overrides, *preset_name = BUILDS[build]
    setting = MODELS[model]
    quant = load_model(checkpoint, dtype="fp32")
    if preset_name:  # an 8-bit scheme, per channel as its preset says
        scheme, _notes = resolve_scheme(method, quant.config, preset_name[0])
    else:
        scheme, _notes = resolve_scheme(method, quant.config, setting.scheme, group_size=setting.group_size,
                                        symmetric=True)
    result = quantize_model(quant, method, scheme, calib if method != "rtn" else None, MethodOptions(**overrides))
    return quant, result.seconds


def quantize_peer(build: str, model: str, checkpoint: Path, calib, work: Path, peer_python: str, threads: int):
    method = BUILDS[build][1]
    tokens = work / "calibration.safetensors"
    save_file({"input_ids": calib.tokens.contiguous()}, str(tokens))
    record = run_peer(peer_python, checkpoint, tokens, method, MODELS[model].group_size, work, 60 * 60, threads, work)
    if record["status"] != "quantized":
        raise RuntimeError(f"llm-compressor {method} failed: {record.get('error')}\n{record.get('log_tail', '')}")
    quant = load_model(Path(record["checkpoint"]), dtype="fp32")
    return quant, record["peer"]["seconds"]["quantize"]


def score(base, quant, windows, hiddens) -> dict:
    d = divergence(base, quant, windows.windows, base_hidden=hiddens)
    docs, sums, counts = doc_sums(d.kl, windows)
    s = d.summary()
    return {"docs": docs, "doc_kl_sums": sums, "doc_tokens": counts, "kl_mean": s["kl_mean"],
            "top1_agreement": s["top1_agreement"], "ppl_ratio": s["ppl_ratio"]}


def summarize(record: dict) -> dict:
    """Per (calibration, evaluation) pair: every build's KL estimate, reduction vs RTN, tokq/peer ratios, targets."""
    rtn = record["cells"].get("rtn", {})
    out = {}
    for calib in record["settings"]["calib"]:
        for ev in record["eval_sets"]:
            if ev == calib or ev not in rtn:
                continue
            row: dict = {"builds": {}, "targets": {}}
            cells = {b: record["cells"].get(b if b in UNCALIBRATED else f"{b}@{calib}", {}).get(ev) for b in BUILDS}
            for b, cell in cells.items():
                if cell is None:
                    continue
                entry = {"kl": kl_estimate(cell), "top1_agreement": cell["top1_agreement"], "ppl_ratio": cell["ppl_ratio"]}
                if b != "rtn" and b not in ("w8a8-rtn", "smoothquant", "fp8"):
                    r = ratio_estimate(cell, cells["rtn"])
                    entry["reduction_vs_rtn"] = {"value": 1 - r["value"], "low": 1 - r["high"], "high": 1 - r["low"]}
                row["builds"][b] = entry
            for ours, peer in (("gptq", "peer-gptq"), ("awq", "peer-awq"), ("gptq-minmax", "peer-gptq")):
                if cells.get(ours) and cells.get(peer):
                    row["builds"][ours][f"over_{peer}"] = ratio_estimate(cells[ours], cells[peer])
            b = row["builds"]
            for method in ("gptq", "awq"):
                if method in b:
                    red = b[method]["reduction_vs_rtn"]["value"]
                    row["targets"][f"{method}_25pct_below_rtn"] = {"value": red, "met": red >= 0.25}
            if "gptq" in b and "peer-gptq" in b:
                ratio = b["gptq"]["over_peer-gptq"]["value"]
                row["targets"]["gptq_no_worse_than_llmcompressor"] = {"value": ratio, "met": ratio <= 1.0}
            if "awq" in b and "peer-awq" in b:
                ratio = b["awq"]["over_peer-awq"]["value"]
                row["targets"]["awq_no_worse_than_llmcompressor"] = {"value": ratio, "met": ratio <= 1.0}
            if cells.get("smoothquant") and cells.get("w8a8-rtn"):  # SmoothQuant against W8A8 without smoothing
                r = ratio_estimate(cells["smoothquant"], cells["w8a8-rtn"])
                b["smoothquant"]["over_w8a8-rtn"] = r
                row["targets"]["smoothquant_below_w8a8_rtn"] = {"value": r["value"], "met": r["value"] < 1.0}
            row["token_distance"] = (record["distances"].get(calib, {}).get(ev) or {}).get("excess_bits")
            out[f"{calib}->{ev}"] = row
    return out


W4_COLUMNS = (("rtn", "RTN"), ("gptq", "tokq GPTQ"), ("gptq-minmax", "GPTQ min/max"),
              ("gptq-no-actorder", "GPTQ no act-order"), ("peer-gptq", "llm-c GPTQ"), ("awq", "tokq AWQ"),
              ("peer-awq", "llm-c AWQ"))
W8_COLUMNS = (("w8a8-rtn", "W8A8 int8 RTN"), ("smoothquant", "SmoothQuant W8A8"), ("fp8", "FP8 W8A8"))


def markdown(record: dict) -> str:
    lines = [f"# Calibration shift: {record['model']} ({record['setting']['scheme']} g{record['setting']['group_size']})",
             "",
             f"Calibration {record['settings']['num_samples']} x {record['settings']['seq_len']} tokens per domain "
             f"(seed {record['settings']['seed']}); evaluation {record['settings']['eval_windows']} windows of "
             f"{record['settings']['eval_window']} tokens per set; mean KL(base‖quant) over the full vocabulary, "
             "95% intervals over documents. `-x%` is the KL reduction against RTN on the same tokens."]
    rows = record["summary"]
    present = {b for row in rows.values() for b in row["builds"]}

    def cell(b: dict | None) -> str:
        if not b:
            return "-"
        k = b["kl"]
        red = b.get("reduction_vs_rtn")
        return f"{k['value']:.4f} [{k['low']:.3f}, {k['high']:.3f}]" + (f" {-100 * red['value']:+.0f}%" if red else "")

    for title, columns in (("4-bit weights", W4_COLUMNS), ("8-bit weights and activations", W8_COLUMNS)):
        columns = [(b, label) for b, label in columns if b in present]
        if not columns:
            continue
        lines += ["", f"## {title}", "", "| calib -> eval | distance | " + " | ".join(label for _b, label in columns)
                  + " | targets |", "|---" * (len(columns) + 3) + "|"]
        for pair, row in rows.items():
            b = row["builds"]
            names = {name for name, _label in columns}
            met = [f"{k}: {'met' if t['met'] else 'NOT MET'}" for k, t in row["targets"].items()
                   if any(k.startswith(n.replace("-", "_")) for n in names)]
            dist = row.get("token_distance")
            lines.append(f"| {pair} | {'-' if dist is None else f'{dist:.3f}'} | "
                         + " | ".join(cell(b.get(n)) for n, _label in columns) + f" | {'; '.join(met)} |")
    columns = [(b, label) for b, label in (*W4_COLUMNS, *W8_COLUMNS) if b in present]
    lines += ["", "## Top-1 agreement and perplexity ratio (quantized / base)", "",
              "| calib -> eval | " + " | ".join(label for _b, label in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for pair, row in rows.items():
        b = row["builds"]
        lines.append(f"| {pair} | " + " | ".join(
            f"{100 * b[n]['top1_agreement']:.1f}% / {b[n]['ppl_ratio']:.3f}" if n in b else "-" for n, _l in columns) + " |")
    lines += ["", "In-domain token distances (calibration against evaluation windows of its own domain, which may "
              "share documents): " + ", ".join(f"{c} {(record['distances'].get(c, {}).get(c) or {}).get('excess_bits', 0):.3f}"
                                               for c in record["settings"]["calib"]) + "."]
    lines += ["", "Quantization seconds (this machine, threads as recorded): " + ", ".join(
        f"{k} {v:.0f}" for k, v in sorted(record["seconds"].items()))]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--builds", default=",".join(BUILDS), help=f"comma-separated, of: {', '.join(BUILDS)}")
    ap.add_argument("--calib", default=",".join(DOMAINS), help="calibration domains, of: " + ", ".join(DOMAINS))
    ap.add_argument("--eval", action="append", default=[], metavar="NAME=DIR",
                    help="an extra held-out evaluation folder (repeatable)")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--eval-window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    builds = [b for b in args.builds.split(",") if b]
    calibs = [c for c in args.calib.split(",") if c]
    bad = [b for b in builds if b not in BUILDS] + [c for c in calibs if c not in DOMAINS]
    if bad:
        ap.error(f"unknown builds or domains: {bad}")
    if any(BUILDS[b][0] != "tokq" for b in builds) and not Path(args.peer_python).is_file():
        sys.exit(f"peer python {args.peer_python} not found: bash benchmarks/peer_venv.sh, or drop the peer-* builds")
    torch.set_num_threads(args.threads)
    out_json = args.out or RESULTS / f"calibration-shift-{args.model}.json"
    checkpoint, tokenizer, add_bos, _default = base_and_default_set(args.model)
    root_docs = builtin_sets()
    sets = eval_sets(root_docs, args.eval, tokenizer, add_bos, args.eval_windows, args.eval_window)
    settings = {"num_samples": args.num_samples, "seq_len": args.seq_len, "seed": args.seed,
                "eval_windows": args.eval_windows, "eval_window": args.eval_window, "calib": calibs,
                "data_hash": root_docs["default"].content_hash(),
                "eval_hashes": {n: d.content_hash() for n, (_w, d) in sets.items()}}
    record = {"benchmark": "calibration_shift", "tokq_version": __version__, "model": args.model,
              "setting": {"scheme": MODELS[args.model].scheme, "group_size": MODELS[args.model].group_size},
              "settings": settings, "domains": DOMAINS, "cells": {}, "seconds": {}, "calibration": {},
              "distances": {}, "eval_sets": {n: {"windows": len(w.windows), "tokens": w.n_tokens,
                                                 "documents": w.n_documents} for n, (w, _d) in sets.items()}}
    if out_json.is_file():
        old = json.loads(out_json.read_text())
        same = {k: v for k, v in old.get("settings", {}).items() if k != "calib"} == \
            {k: v for k, v in settings.items() if k != "calib"}
        if same:
            for key in ("cells", "seconds", "calibration", "distances"):
                record[key].update(old.get(key, {}))
            settings["calib"] = sorted(set(old["settings"]["calib"]) | set(calibs), key=list(DOMAINS).index)
            print(f"resuming {out_json}: {len(record['cells'])} builds kept", flush=True)
    record["hardware"] = {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
                          "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    base = load_model(checkpoint, dtype="fp32")
    todo = [(b, None) for b in builds if b in UNCALIBRATED]
    todo += [(b, c) for c in calibs for b in builds if b not in UNCALIBRATED]
    hiddens = {n: [final_hidden(base, torch.tensor(w.tokens)) for w in ws.windows] for n, (ws, _d) in sets.items()} \
        if todo else {}
    eval_hist = {n: token_histogram(torch.tensor([t for w in ws.windows for t in w.tokens]))
                 for n, (ws, _d) in sets.items()}

    def draw(domain: str):
        return calibration_samples(data_dir() / "default", tokenizer, add_bos, args.num_samples, args.seq_len,
                                   args.seed, documents=domain_documents(root_docs, domain))

    for domain in settings["calib"]:  # cheap (tokenizing), and refreshed on every run
        calib_hist = token_histogram(draw(domain).tokens)
        record["distances"][domain] = {n: token_distance(calib_hist, h) for n, h in eval_hist.items()}

    def save() -> None:
        record["summary"] = summarize(record)
        write_json(out_json, record)
        out_json.with_suffix(".md").write_text(markdown(record), encoding="utf-8")

    for build, calib_domain in todo:
        key = build if calib_domain is None else f"{build}@{calib_domain}"
        targets = [n for n in sets if n != calib_domain]
        if all(n in record["cells"].get(key, {}) for n in targets):
            continue
        calib = None
        if calib_domain is not None:
            calib = draw(calib_domain)
            # the domain, not this machine's path to the default set
            record["calibration"][calib_domain] = {**calib.to_json(), "source": f"{DOMAIN_SET.get(calib_domain, 'default')} set: {calib_domain}"}
        started = time.perf_counter()
        print(f"[{key}] quantizing ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="tokq-shift-") as tmp:
            if BUILDS[build][0] == "tokq":
                quant, seconds = quantize_tokq(build, args.model, checkpoint, calib)
            else:
                quant, seconds = quantize_peer(build, args.model, checkpoint, calib, Path(tmp), args.peer_python,
                                               args.threads)
        record["seconds"][key] = seconds
        cells = record["cells"].setdefault(key, {})
        for name in targets:
            windows, _docs = sets[name]
            cells[name] = score(base, quant, windows, hiddens[name])
            print(f"[{key}] on {name}: KL {cells[name]['kl_mean']:.4f}", flush=True)
        print(f"[{key}] done in {time.perf_counter() - started:.0f}s (quantize {seconds:.0f}s)", flush=True)
        del quant
        save()
    save()
    print(out_json.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
