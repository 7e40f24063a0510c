"""`tokq compare` over HTTP against the in-process compare, on a real model: do URL sides give the same numbers?

    python benchmarks/remote_compare.py [--base smollm2-135m] [--int4 /tmp/tokq-remote-compare/int4-awq]
                                        [--method awq] [--data DIR] [--docs 4] [--window 512]
                                        [--sample-windows 8] [--dtype fp32] [--topk-remote 20] [--threads 1]

1. The int4 variant: `tokq quantize --method awq` of the base into --int4 (built once; reused when it exists).
2. Documents: --data, or the first document (sorted) of each source folder of the default long-document set
   (`tokq data build-default`), --docs of them copied into a work folder; --sample-windows windows of --window
   tokens spread over them (the compare flags; 8 x 512 = 4096 tokens by default).
3. Three compares, each a `tokq compare` subprocess with the same window flags, --dtype, no probes, no decode
   path, no baseline cache:
     (a) in_process: `tokq compare BASE INT4` with --full-kl-rows above the scored tokens (every position scored
         over the whole vocabulary by both models: the exact KL, the reference);
     (b) url_url: `tokq compare url=...base...#tokenizer=BASE url=...int4...` against two `tokq serve` processes
         (--dtype as the compare's, --max-model-len = --window, --threads each);
     (c) local_url: `tokq compare BASE url=...int4...`.
4. The checks: ΔNLL, perplexity ratio and top-1 agreement are exact on every path (within --nll-tol of (a) when
   the dtypes match); a URL path's `kl` is a rigorous lower bound: <= (a)'s exact KL (and <= its CI's upper end);
   how tight it is (bound / exact) and the point estimate `kl_estimate` against the exact KL; tokenization
   agreement (a URL compare fails with a DataError otherwise: it finishing is the check, and the scored-token
   counts must be equal).

Writes benchmarks/results/remote-compare-<base>.json (every compare's overall numbers, the checks, wall time
per path, load average before/after and during) and prints a table. Not timing-sensitive: the wall times are
recorded, not judged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokq import __version__  # noqa: E402
from tokq.machine_load import LoadMonitor, load_average  # noqa: E402
from tokq.paths import data_dir, models_dir  # noqa: E402

TOKQ = [sys.executable, "-m", "tokq"]
PATHS = ("in_process", "url_url", "local_url")
METRICS = ("delta_nll", "ppl_ratio", "top1", "kl", "kl_estimate")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv: list[str], log: Path) -> float:
    """Run a tokq command to completion (its output in `log`); its wall time. Exit 0 or 1 (a failed rule) is a
    finished run; anything else stops the benchmark with the log's tail."""
    start = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(argv[2:5])} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    return seconds


@contextlib.contextmanager
def serving(model: Path, name: str, port: int, args, log: Path, start_timeout_s: float = 600.0):
    """`tokq serve MODEL` on `port`; yields its base URL once /v1/models answers; SIGTERM at the end."""
    argv = [*TOKQ, "serve", str(model), "--port", str(port), "--served-model-name", name, "--dtype", args.dtype,
            "--max-model-len", str(args.window), "--max-logprobs", str(args.topk_remote),
            "--threads", str(args.threads), "--log-level", "warning"]
    out = log.open("w+b")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                out.seek(0)
                raise RuntimeError(f"tokq serve {model} exited {proc.returncode}: {out.read().decode()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"tokq serve {model} did not answer /v1/models in {start_timeout_s} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


def pick_documents(args, work: Path) -> Path:
    """--data as given, else --docs documents of the default set (the first of each source folder, sorted)."""
    if args.data:
        return Path(args.data)
    source = Path(args.source) if args.source else data_dir() / "default"
    if not source.is_dir():
        subprocess.run([*TOKQ, "data", "build-default", "--out", str(source)], check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    firsts = [next(iter(sorted(p for p in folder.rglob("*") if p.is_file())), None)
              for folder in sorted(p for p in source.iterdir() if p.is_dir())]
    chosen = [p for p in firsts if p is not None][:args.docs]
    docs = work / "docs"
    shutil.rmtree(docs, ignore_errors=True)
    docs.mkdir(parents=True)
    for path in chosen:  # flat names: the source folder and the file
        shutil.copy(path, docs / f"{path.relative_to(source).parts[0]}--{path.name}")
    return docs


def ensure_int4(base: str, args, docs: Path, work: Path) -> tuple[Path, float | None]:
    out = Path(args.int4)
    if (out / "config.json").is_file():
        return out, None
    seconds = run([*TOKQ, "quantize", "--method", args.method, "--model", base, "--out", str(out),
                   "--calib", str(docs), "--threads", str(args.threads)], work / "quantize.log")
    return out, seconds


def overall(result: dict) -> dict:
    """The numbers this benchmark compares, from a compare's JSON."""
    o = result["prefill"]["overall"]

    def point(key: str) -> dict | None:
        m = o.get(key)
        return None if m is None else {"value": m["value"], "ci": [m.get("low"), m.get("high")]}
    return {key: point(key) for key in METRICS} | {
        "scored_tokens": result["windows"]["scored_tokens"], "windows": result["windows"]["count"],
        "kl_kind": result["kl_estimator"]["prefill"]["kind"], "topk": result["kl_estimator"].get("topk"),
        "seconds": result["throughput"], "passed": result["passed"]}


def checks(numbers: dict, nll_tol: float) -> dict:
    """What must hold between the in-process compare and each URL path."""
    ref = numbers["in_process"]
    exact_kl, exact_hi = ref["kl"]["value"], ref["kl"]["ci"][1]
    out = {}
    for path in PATHS[1:]:
        n = numbers[path]
        d_nll = abs(n["delta_nll"]["value"] - ref["delta_nll"]["value"])
        d_ppl = abs(n["ppl_ratio"]["value"] - ref["ppl_ratio"]["value"]) if n["ppl_ratio"] else None
        d_top1 = abs(n["top1"]["value"] - ref["top1"]["value"])
        bound = n["kl"]["value"]
        out[path] = {
            "tokenization_agrees": n["scored_tokens"] == ref["scored_tokens"],  # a mismatch is a DataError first
            "delta_nll_abs_diff": d_nll, "delta_nll_within_tol": d_nll <= nll_tol,
            "ppl_ratio_abs_diff": d_ppl,
            "top1_abs_diff": d_top1, "top1_exact": d_top1 <= 0.5 / n["scored_tokens"],
            "kl_bound": bound, "kl_exact": exact_kl,
            "kl_bound_le_exact": bound <= exact_kl + 1e-6,
            "kl_bound_le_exact_ci_high": exact_hi is None or bound <= exact_hi + 1e-6,
            "kl_bound_over_exact": bound / exact_kl if exact_kl else None,
            "kl_bound_ci_high_le_exact_ci_high": (n["kl"]["ci"][1] or 0) <= (exact_hi or float("inf")) + 1e-6,
            "kl_estimate": n["kl_estimate"]["value"],
            "kl_estimate_over_exact": n["kl_estimate"]["value"] / exact_kl if exact_kl else None,
        }
    return out


def table(numbers: dict, wall: dict, chk: dict) -> str:
    head = f"{'path':<11} {'dNLL':>10} {'PPL ratio':>10} {'top-1':>8} {'KL':>9} {'KL CI':>19} {'KL est':>9} " \
           f"{'KL kind':>12} {'wall s':>7}"
    lines = [head, "-" * len(head)]
    for path in PATHS:
        n = numbers[path]
        ci = n["kl"]["ci"]
        est = n["kl_estimate"]["value"] if n["kl_estimate"] else None
        lines.append(f"{path:<11} {n['delta_nll']['value']:>10.6f} {n['ppl_ratio']['value']:>10.6f} "
                     f"{n['top1']['value']:>8.5f} {n['kl']['value']:>9.5f} "
                     f"{f'[{ci[0]:.4f}, {ci[1]:.4f}]':>19} {'-' if est is None else f'{est:.5f}':>9} "
                     f"{n['kl_kind']:>12} {wall[path]:>7.1f}")
    lines.append("")
    for path, c in chk.items():
        lines.append(f"{path}: |ΔNLL diff| {c['delta_nll_abs_diff']:.2e}, |top-1 diff| {c['top1_abs_diff']:.2e}, "
                     f"KL bound/exact {c['kl_bound_over_exact']:.3f} (<= exact: {c['kl_bound_le_exact']}), "
                     f"estimate/exact {c['kl_estimate_over_exact']:.3f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="smollm2-135m")
    p.add_argument("--int4", default="/tmp/tokq-remote-compare/int4-awq", help="built here once, then reused")
    p.add_argument("--method", default="awq", help="tokq quantize --method for --int4 (awq or rtn)")
    p.add_argument("--work", default="/tmp/tokq-remote-compare", help="logs, documents and the compares' JSON")
    p.add_argument("--data", default=None, help="folder of documents (default: --docs of the default set)")
    p.add_argument("--source", default=None, help="the default set's folder (default: tokq's data dir; built "
                   "there by `tokq data build-default` when missing)")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--sample-windows", type=int, default=8)
    p.add_argument("--dtype", default="fp32", help="compute dtype of every side (the compares and tokq serve)")
    p.add_argument("--topk-remote", type=int, default=20, help="k a URL side reports (tokq serve --max-logprobs)")
    p.add_argument("--threads", type=int, default=1, help="per process: each server, each compare")
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--nll-tol", type=float, default=1e-4)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base_dir = Path(args.base) if Path(args.base).is_dir() else models_dir() / args.base
    docs = pick_documents(args, work)
    int4, quantize_s = ensure_int4(args.base, args, docs, work)
    common = ["--data", str(docs), "--window", str(args.window), "--sample-windows", str(args.sample_windows),
              "--dtype", args.dtype, "--no-probes", "--decode-windows", "0", "--no-cache", "--threads",
              str(args.threads), "--resamples", str(args.resamples)]
    load_before = load_average()
    monitor = LoadMonitor()
    wall, results = {}, {}
    full_rows = args.window * args.sample_windows + 1  # above the scored tokens: the exact KL
    wall["in_process"] = run([*TOKQ, "compare", str(base_dir), str(int4), *common, "--full-kl-rows", str(full_rows),
                              "--json", str(work / "in_process.json")], work / "in_process.log")
    ports = free_port(), free_port()
    serve_started = time.perf_counter()
    with serving(base_dir, "base", ports[0], args, work / "serve-base.log") as url_base, \
            serving(int4, "int4", ports[1], args, work / "serve-int4.log") as url_int4:
        serve_start_s = time.perf_counter() - serve_started
        k = f"topk={args.topk_remote}"
        a_url = f"url={url_base}/v1#model=base&tokenizer={base_dir}&{k}"
        b_url = f"url={url_int4}/v1#model=int4&{k}"
        wall["url_url"] = run([*TOKQ, "compare", a_url, b_url, *common, "--json", str(work / "url_url.json")],
                              work / "url_url.log")
        wall["local_url"] = run([*TOKQ, "compare", str(base_dir), b_url, *common, "--json",
                                 str(work / "local_url.json")], work / "local_url.log")
    load = monitor.stop()
    for path in PATHS:
        results[path] = json.loads((work / f"{path}.json").read_text())
    numbers = {path: overall(results[path]) for path in PATHS}
    chk = checks(numbers, args.nll_tol)
    record = {
        "benchmark": "remote_compare", "tokq_version": __version__, "python": platform.python_version(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_before": load_before,
                    "load_after": load_average(), "load_during": load},
        "base": str(base_dir), "int4": str(int4), "method": args.method, "quantize_seconds": quantize_s,
        "documents": sorted(p.name for p in docs.iterdir()),
        "settings": {"window": args.window, "sample_windows": args.sample_windows, "dtype": args.dtype,
                     "topk_remote": args.topk_remote, "threads_per_process": args.threads,
                     "full_kl_rows_in_process": full_rows, "resamples": args.resamples, "nll_tol": args.nll_tol},
        "wall_seconds": wall, "serve_start_seconds": serve_start_s,
        "commands": {"in_process": f"tokq compare {base_dir} {int4} --full-kl-rows {full_rows} ...",
                     "url_url": "tokq compare url=http://127.0.0.1:P1/v1#model=base&tokenizer=BASE&topk=K "
                                 "url=http://127.0.0.1:P2/v1#model=int4&topk=K ...",
                     "local_url": "tokq compare BASE url=http://127.0.0.1:P2/v1#model=int4&topk=K ...",
                     "common": " ".join(common)},
        "numbers": numbers, "checks": chk,
        "all_checks_pass": all(c["tokenization_agrees"] and c["delta_nll_within_tol"] and c["top1_exact"]
                               and c["kl_bound_le_exact"] for c in chk.values()),
        "remote": {path: results[path]["kl_estimator"]["remote"] for path in PATHS[1:]},
        "kl_method": {path: results[path]["kl_method"] for path in PATHS},
    }
    name = Path(args.base).name
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"remote-compare-{name}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(table(numbers, wall, chk))
    print(f"\nall checks pass: {record['all_checks_pass']}; load average before {load_before}, after "
          f"{record['machine']['load_after']}; wrote {out}")


if __name__ == "__main__":
    main()
