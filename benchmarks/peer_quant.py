"""Peer comparison: the same model, the same calibration tokens, quantized by llm-compressor, judged by tokq's evaluator.

    python benchmarks/peer_quant.py [--model smollm2-135m] [--methods gptq,awq,fp8[,gptq-no-actorder]]
                                    [--peer-python /work/peer-venv/bin/python] [--with-tokq]
    python benchmarks/peer_quant.py --model smollm2-135m --table-only   # re-read tokq's side, print

The peer lives in its own optional venv (benchmarks/peer_venv.sh makes it); it is never a dependency
of tokq and tokq never imports it. This script runs in tokq's venv and:

1. builds the calibration set exactly as tokq's own runs do (quant_protocol.Protocol().calibration:
   same source, seed, number of samples and length) and writes the token ids to a safetensors file;
2. runs benchmarks/peer_llmcompressor_job.py with the peer's python, once per method, which
   quantizes the base checkpoint (fp32) with those token ids and saves a compressed-tensors checkpoint
   into a temporary directory;
3. loads that checkpoint with tokq's own reader (tokq.engine.checkpoint.load_model, fp32), so the
   peer's integer codes and scales run on tokq's engine, and scores it against the fp32 base model
   with quant_protocol.evaluate on the protocol's evaluation windows (a different source than
   calibration). Reader parity first: the peer stack (transformers + compressed-tensors) loads its
   own checkpoint and writes logits on a probe (the first 128 tokens of the first evaluation
   window); `reader_parity` records how far tokq's logits for the same checkpoint are from those,
   so a peer number can't be worse merely because tokq misread the peer's format;
4. puts tokq's own numbers beside the peer's: with --with-tokq it quantizes the model with tokq's
   method of the same name on the same CalibrationSet and scores it the same way; otherwise it takes
   them from benchmarks/results/quant-quality-<model>-*.json (quant_quality.py) when that file was
   made with the same protocol and the same calibration tokens (checked by their hash). `comparison`
   then holds both point estimates per method and `tokq_no_worse` (mean KL and perplexity ratio
   both <= the peer's).

Peer settings per model come from quant_protocol.MODELS (int4 symmetric, that model's group size);
fp8 is FP8_DYNAMIC (per-channel fp8 weights, dynamic per-token fp8 activations). A peer run that fails
or exceeds --timeout-min is recorded as such (with the tail of its log) and the next method runs.

Writes benchmarks/results/peer-quant-<model>.json (atomically, after every method; `complete` is
false until the last one is done). Methods already in that file from an earlier run with the same
protocol and calibration tokens are kept unless re-run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from quant_protocol import MODELS, RESULTS, Protocol, base_checkpoint, base_hiddens, evaluate, load_base
from safetensors.torch import load_file, save_file

from tokq import __version__
from tokq.engine.checkpoint import load_model
from tokq.engine.layers import Linear
from tokq.reports.json_io import write_json

JOB = Path(__file__).parent / "peer_llmcompressor_job.py"
DEFAULT_PEER_PYTHON = os.environ.get("TOKQ_PEER_PYTHON", "/work/peer-venv/bin/python")
METHODS = ("gptq", "awq", "fp8", "gptq-no-actorder")  # names as in quant_quality.py's runs
PROBE_TOKENS = 128  # reader-parity probe: the first tokens of the first evaluation window
TOKQ_SCHEME = {"gptq": None, "awq": None, "fp8": "w8a8-fp8", "gptq-no-actorder": None}  # None: the model's W4 setting
TOKQ_METHOD = {"gptq-no-actorder": ("gptq", {"act_order": False})}  # run name -> tokq method, options


def kernel_names(model) -> list[str]:
    """The quantized formats and kernels the loaded model runs (one entry per distinct choice)."""
    return sorted({m.method.name for m in model.modules() if isinstance(m, Linear) and hasattr(m.method, "kernel_name")})


def log_tail(path: Path, chars: int = 3000) -> str:
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    return text[-chars:]


def wait_measured(proc: subprocess.Popen, timeout_s: float) -> tuple[int | None, float | None]:
    """Wait for `proc` (killed past `timeout_s`): its exit code (None: timed out) and its own peak RSS in MiB, from
    os.wait4's rusage of that child alone (the children it waited for included), not of this process's others."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss / 1024  # KiB on Linux
        if time.monotonic() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            return None, None
        time.sleep(0.5)


def run_peer(peer_python: str, checkpoint: Path, tokens: Path, method: str, group_size: int, work: Path,
             timeout_s: float, threads: int, log_dir: Path) -> dict:
    """One peer quantization in a subprocess; returns its record (status, meta, checkpoint dir)."""
    out, meta_path = work / f"peer-{method}", work / f"peer-{method}.json"
    log_path = log_dir / f"peer-{method}.log"
    cmd = [peer_python, str(JOB), "--model-dir", str(checkpoint), "--tokens", str(tokens), "--method", method,
           "--group-size", str(group_size), "--out", str(out), "--meta", str(meta_path), "--threads", str(threads)]
    print(f"[{method}] peer: {' '.join(cmd)}  (log: {log_path})", flush=True)
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        rc, peak_rss_mib = wait_measured(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work),
                                         timeout_s)
    wall = time.perf_counter() - started
    record = {"peer_wall_s": wall, "log": str(log_path), "peer_peak_rss_mib": peak_rss_mib}
    if rc is None:
        return {**record, "status": "timeout", "error": f"peer run exceeded {timeout_s / 60:.0f} min",
                "log_tail": log_tail(log_path)}
    if rc != 0 or not meta_path.is_file():
        return {**record, "status": "peer_failed", "error": f"peer exited with {rc}", "log_tail": log_tail(log_path)}
    return {**record, "status": "quantized", "peer": json.loads(meta_path.read_text(encoding="utf-8")),
            "checkpoint": str(out)}


def reused_peer(method: str, work: Path, previous: dict | None) -> dict | None:
    """A checkpoint an earlier run left under --keep (with its meta file), or None.

    Its wall time is the earlier run's (from the previous result file), else the job's own total.
    """
    out, meta_path = work / f"peer-{method}", work / f"peer-{method}.json"
    if not (meta_path.is_file() and (out / "config.json").is_file()):
        return None
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    print(f"[{method}] peer: reusing {out} (quantized earlier in {meta['seconds']['total']:.0f} s)", flush=True)
    wall = (previous or {}).get("peer_wall_s") or meta["seconds"]["total"]
    return {"status": "quantized", "reused": True, "peer_wall_s": wall, "peer": meta,
            "checkpoint": str(out)}


def peer_probe_logits(peer_python: str, checkpoint: Path, probe: Path, threads: int) -> tuple[torch.Tensor | None, str]:
    """The peer stack's own logits for its checkpoint on the probe tokens (see the job's --logits-of)."""
    out = checkpoint.parent / f"{checkpoint.name}-probe-logits.safetensors"
    out.unlink(missing_ok=True)  # never compare against an earlier run's logits
    cmd = [peer_python, str(JOB), "--logits-of", str(checkpoint), "--probe", str(probe), "--probe-out", str(out),
           "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=checkpoint.parent)
    if proc.returncode != 0 or not out.is_file():
        return None, (proc.stdout + proc.stderr)[-2000:]
    return load_file(str(out))["logits"], ""


def reader_parity(quant, probe_ids: torch.Tensor, peer: torch.Tensor) -> dict:
    """tokq's logits for the peer checkpoint vs the peer stack's own, on the same probe tokens.

    Same weights, same fp32, same thread count: int4 checkpoints agree to rounding (bitwise when
    both sides run the same ops). FP8_DYNAMIC is chaotic under any rounding difference: per-token
    fp8 activation rounding (3 mantissa bits) turns a 1e-7 difference into a flipped code, so expect
    exact agreement only with equal threads, and a KL of the size of the fp8 error otherwise.
    """
    with torch.inference_mode():
        ours = quant.compute_logits(quant(probe_ids[None])[0]).float()
    lp, lq = torch.log_softmax(peer, -1), torch.log_softmax(ours, -1)
    return {"positions": int(ours.shape[0]), "max_abs_dlogit": float((ours - peer).abs().max()),
            "peer_logit_absmax": float(peer.abs().max()),
            "kl_mean": float((lp.exp() * (lp - lq)).sum(-1).clamp_min(0).mean()),
            "top1_agreement": float((lp.argmax(-1) == lq.argmax(-1)).double().mean()),
            "threads": torch.get_num_threads()}


def score_checkpoint(record: dict, base, windows, hiddens, probe: tuple[torch.Tensor, torch.Tensor | None, str]) -> dict:
    """Load the peer checkpoint with tokq's reader and score it; failures to load are findings, kept."""
    path = Path(record.pop("checkpoint"))
    qc = json.loads((path / "config.json").read_text(encoding="utf-8")).get("quantization_config")
    record["quantization_config"] = qc
    try:
        quant = load_model(path, dtype="fp32")
    except Exception as exc:  # noqa: BLE001 - a reader failure is the result to report
        return {**record, "status": "tokq_load_failed", "error": f"{type(exc).__name__}: {exc}"}
    record["tokq_kernels"] = kernel_names(quant)
    probe_ids, peer_logits, peer_error = probe
    record["reader_parity"] = (reader_parity(quant, probe_ids, peer_logits) if peer_logits is not None
                               else {"error": f"the peer could not load its own checkpoint: {peer_error}"})
    record["summary"] = evaluate(base, quant, windows, hiddens)
    record["status"] = "ok"
    return record


def run_tokq(name: str, model: str, calib, windows, base, hiddens) -> dict:
    from tokq.quantization.methods.options import MethodOptions
    from tokq.quantization.pipeline import quantize_model, resolve_scheme

    method, options = TOKQ_METHOD.get(name, (name, {}))
    setting, fp8 = MODELS[model], method == "fp8"
    quant = load_base(model)
    scheme, notes = resolve_scheme(method, quant.config, TOKQ_SCHEME[name] or setting.scheme,
                                   group_size=None if fp8 else setting.group_size, symmetric=None if fp8 else True)
    result = quantize_model(quant, method, scheme, None if fp8 else calib, MethodOptions(**options))
    return {"status": "ok", "source": "peer_quant.py", "scheme": scheme.to_json(), "notes": notes, "options": result.options.to_json(),
            "seconds": result.seconds, "tokq_kernels": kernel_names(quant), "summary": evaluate(base, quant, windows, hiddens)}


def previous_results(path: Path, protocol: dict, tokens_hash: str) -> dict:
    if not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return {}
    if old.get("protocol") != protocol or (old.get("calibration") or {}).get("tokens_hash") != tokens_hash:
        return {}
    return old.get("methods", {})


def tokq_reference(model: str, protocol: dict, tokens_hash: str) -> tuple[str | None, dict]:
    """tokq's own results for the same protocol and calibration tokens, from quant_quality.py's file."""
    for path in sorted(RESULTS.glob(f"quant-quality-{model}-*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            continue
        if data.get("protocol") == protocol and (data.get("calibration") or {}).get("tokens_hash") == tokens_hash:
            runs = {m: r for m, r in (data.get("runs") or {}).items() if m in METHODS and r.get("quality")}
            return str(path.relative_to(RESULTS.parent.parent)), {
                m: {"status": "ok", "source": "quant_quality.py", "scheme": r.get("scheme"),
                    "seconds": r.get("quantize_seconds"), "summary": r["quality"]} for m, r in runs.items()}
    return None, {}


def compare(methods: dict) -> dict:
    """Per method with both sides scored: tokq's and the peer's point estimates, and whether tokq is no worse.

    Point estimates on the same tokens (no CI: the per-token arrays are not kept across processes), so a
    `tokq_no_worse` false by a hair (one metric a fraction of a percent worse) is a tie, not a loss;
    the per-metric flags show which metric decided it.
    """
    out = {}
    for method, entry in methods.items():
        tokq, peer = (entry.get(k) or {} for k in ("tokq", "peer"))
        if not (tokq.get("summary") and peer.get("summary")):
            continue
        t, p = tokq["summary"], peer["summary"]
        out[method] = {
            "kl_mean": {"tokq": t["kl_mean"], "peer": p["kl_mean"], "tokq_over_peer": t["kl_mean"] / p["kl_mean"]},
            "kl_p99": {"tokq": t["kl_p99"], "peer": p["kl_p99"]},
            "top1_agreement": {"tokq": t["top1_agreement"], "peer": p["top1_agreement"]},
            "ppl_ratio": {"tokq": t["ppl_ratio"], "peer": p["ppl_ratio"]},
            "kl_mean_no_worse": t["kl_mean"] <= p["kl_mean"],
            "ppl_ratio_no_worse": t["ppl_ratio"] <= p["ppl_ratio"],
            "tokq_no_worse": t["kl_mean"] <= p["kl_mean"] and t["ppl_ratio"] <= p["ppl_ratio"],
        }
    return out


def print_table(methods: dict) -> None:
    head = f"{'method':<17} {'who':<14} {'status':<16} {'KL mean':>9} {'KL p99':>9} {'top1':>7} {'ppl ratio':>9} {'quant s':>8}"
    print(head)
    print("-" * len(head))
    for method, entry in sorted(methods.items()):
        for who, rec in (("llm-compressor", entry.get("peer")), ("tokq", entry.get("tokq"))):
            if not rec:
                continue
            s = rec.get("summary") or {}
            # quantization time alone on both sides (the peer's oneshot; tokq's quantize_model)
            wall = ((rec.get("peer") or {}).get("seconds") or {}).get("quantize", rec.get("seconds"))
            nums = (f"{s['kl_mean']:>9.5f} {s['kl_p99']:>9.4f} {s['top1_agreement']:>7.4f} {s['ppl_ratio']:>9.4f}"
                    if s else f"{'-':>9} {'-':>9} {'-':>7} {'-':>9}")
            print(f"{method:<17} {who:<14} {rec.get('status', '?'):<16} {nums} {'-' if wall is None else str(round(wall)):>8}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    ap.add_argument("--methods", default="gptq,awq,fp8", help="comma-separated subset of gptq,awq,fp8,gptq-no-actorder")
    ap.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON,
                    help="python of the peer venv (benchmarks/peer_venv.sh; env TOKQ_PEER_PYTHON)")
    ap.add_argument("--timeout-min", type=float, default=30.0, help="give up on one peer run after this long")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both sides (0: torch's default)")
    ap.add_argument("--with-tokq", action="store_true", help="also run tokq's method of the same name and score it")
    ap.add_argument("--keep", type=Path, help="keep the peer checkpoints and logs under this directory")
    ap.add_argument("--reuse", action="store_true",
                    help="with --keep: score a checkpoint an earlier run left there instead of quantizing again")
    ap.add_argument("--out", type=Path, help="result file (default benchmarks/results/peer-quant-<model>.json)")
    ap.add_argument("--tokq-only", action="store_true",
                    help="run only tokq's side (as --with-tokq) and keep the peer records already in the result file")
    ap.add_argument("--table-only", action="store_true",
                    help="run nothing: refresh tokq's side and the comparison in the existing result file, print it")
    args = ap.parse_args()
    out_path = args.out or RESULTS / f"peer-quant-{args.model}.json"
    if args.table_only:
        if not out_path.is_file():
            sys.exit(f"{out_path} does not exist: run without --table-only first")
        finish(json.loads(out_path.read_text(encoding="utf-8")), out_path)
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        sys.exit(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHODS)}")
    if not Path(args.peer_python).is_file() and not args.tokq_only:
        sys.exit(f"peer python {args.peer_python} not found: make the peer venv with `bash benchmarks/peer_venv.sh` "
                 "or pass --peer-python")
    if args.threads:
        torch.set_num_threads(args.threads)

    setting, protocol = MODELS[args.model], Protocol()
    checkpoint = base_checkpoint(args.model)
    calib = protocol.calibration(checkpoint)
    windows, eval_hash = protocol.eval_windows_for(checkpoint)
    base = load_base(args.model)
    hiddens = base_hiddens(base, windows)  # the base runs once; every variant is compared with it
    provenance = checkpoint / "provenance.json"
    payload = {
        "benchmark": "peer_quant", "tokq_version": __version__, "model": args.model, "checkpoint": str(checkpoint),
        "model_provenance": json.loads(provenance.read_text(encoding="utf-8")) if provenance.is_file() else None,
        "setting": {"scheme": setting.scheme, "group_size": setting.group_size, "symmetric": True},
        "protocol": protocol.to_json(), "calibration": calib.to_json(),
        "eval": {"source": protocol.eval_source, "data_hash": eval_hash, "windows": len(windows.windows),
                 "window": protocol.eval_window},
        "hardware": {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
                     "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "evaluator": "tokq.evalsuite.divergence (teacher-forced, fp32 base vs quantized, full vocabulary)",
        "complete": False,
        "methods": previous_results(out_path, protocol.to_json(), calib.to_json()["tokens_hash"]),
    }
    with tempfile.TemporaryDirectory(prefix="tokq-peer-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        tokens, probe_path = work / "calibration.safetensors", work / "probe.safetensors"
        save_file({"input_ids": calib.tokens.contiguous()}, str(tokens))
        probe_ids = torch.tensor(windows.windows[0].tokens[:PROBE_TOKENS], dtype=torch.long)
        save_file({"input_ids": probe_ids[None].contiguous()}, str(probe_path))
        for method in methods:
            entry = payload["methods"].setdefault(method, {})
            if args.tokq_only:
                entry["tokq"] = run_tokq(method, args.model, calib, windows, base, hiddens)
                write_json(out_path, payload)
                continue
            record = (args.reuse and reused_peer(method, work, entry.get("peer"))) or run_peer(
                args.peer_python, checkpoint, tokens, method, setting.group_size, work, args.timeout_min * 60,
                args.threads, work)
            if record["status"] == "quantized":
                peer_logits, peer_error = peer_probe_logits(args.peer_python, Path(record["checkpoint"]), probe_path,
                                                            torch.get_num_threads())
                record = score_checkpoint(record, base, windows, hiddens, (probe_ids, peer_logits, peer_error))
            if not args.keep:
                record.pop("log", None)
            entry["peer"] = record
            print(f"[{method}] peer: {record['status']} {record.get('error', '')}", flush=True)
            if args.with_tokq:
                entry["tokq"] = run_tokq(method, args.model, calib, windows, base, hiddens)
            write_json(out_path, payload)
    payload["complete"] = True
    finish(payload, out_path)


def finish(payload: dict, out_path: Path) -> None:
    """Add tokq's side where quant_quality.py has it, compare, write, print."""
    ref_file, ref = tokq_reference(payload["model"], payload["protocol"], payload["calibration"]["tokens_hash"])
    payload["tokq_reference"] = ref_file
    for method, rec in ref.items():
        entry = payload["methods"].get(method)
        if entry is not None and (not entry.get("tokq") or entry["tokq"].get("source") == "quant_quality.py"):
            entry["tokq"] = rec  # a result of this script's own --with-tokq / --tokq-only is kept
    payload["comparison"] = compare(payload["methods"])
    write_json(out_path, payload)
    print(f"wrote {out_path}")
    print_table(payload["methods"])
    for method, c in sorted(payload["comparison"].items()):
        print(f"{method}: tokq mean KL / peer mean KL = {c['kl_mean']['tokq_over_peer']:.3f}; "
              f"ppl ratio tokq {c['ppl_ratio']['tokq']:.4f} vs peer {c['ppl_ratio']['peer']:.4f}; "
              f"tokq no worse: {'yes' if c['tokq_no_worse'] else 'NO'} "
              f"(mean KL {'yes' if c['kl_mean_no_worse'] else 'no'}, ppl ratio {'yes' if c['ppl_ratio_no_worse'] else 'no'})")


if __name__ == "__main__":
    main()
