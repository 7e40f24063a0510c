"""Streamed quantize at scale: tokq's GPTQ on a large zoo model, its peak RSS and time per block, beside
llm-compressor's GPTQ on the same calibration token ids.

    python benchmarks/quantize_scale.py --model qwen2.5-coder-1.5b [--calib code] [--num-samples 32] [--seq-len 512]
        [--group-size 128] [--threads 1] [--peer-python /work/peer-venv/bin/python] [--skip-peer] [--out PATH]

tokq runs as users run it, `tokq quantize --method gptq` in a child process (streamed: one decoder block in memory at
a time, the default), on `--calib` (a built-in set's name or a folder) with the given samples, length and seed; its
--json record gives the seconds of every block and the calibration's token hash. The benchmark draws the same
calibration windows itself (calibration_samples, same arguments), checks that their hash is the one tokq recorded,
and hands those token ids to llm-compressor's GPTQ (benchmarks/peer_quant.run_peer, its default recipe at the same
group size) in the peer venv. Each side's peak RSS is its own child's (os.wait4's rusage: the child and whatever it
waited for), never the benchmark's.

Target (issue 36): tokq's peak RSS <= 35% of the model's fp32 parameter bytes.

Writes benchmarks/results/quantize-scale-<model>.json (no path of this machine in it).
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

sys.path.insert(0, str(Path(__file__).parent))
from peer_quant import run_peer, wait_measured  # noqa: E402
from quant_protocol import RESULTS  # noqa: E402

from tokq import __version__  # noqa: E402
from tokq.engine.tokenizer import load_tokenizer, model_adds_bos  # noqa: E402
from tokq.longctx.builtin_sets import calibration_folder  # noqa: E402
from tokq.quantization.calibration import calibration_samples  # noqa: E402
from tokq.zoo import resolve_model  # noqa: E402

TARGET_FRACTION = 0.35
DEFAULT_PEER_PYTHON = os.environ.get("TOKQ_PEER_PYTHON", "/work/peer-venv/bin/python")


def fp32_parameter_bytes(checkpoint: Path) -> int:
    """4 bytes per parameter of the checkpoint's safetensors (read from their headers, no tensor loaded)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return 4 * total


def run_measured(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Run `cmd` as a child; its wall seconds, exit code and own peak RSS (peer_quant.wait_measured)."""
    started = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        rc, peak = wait_measured(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env), 4 * 3600)
    return {"wall_s": time.perf_counter() - started, "returncode": rc, "peak_rss_mib": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--calib", default="code", help="a built-in set (code, default) or a folder")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON)
    ap.add_argument("--skip-peer", action="store_true", help="tokq's side only")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not args.skip_peer and not Path(args.peer_python).is_file():
        sys.exit(f"peer python {args.peer_python} not found: bash benchmarks/peer_venv.sh, or pass --skip-peer")

    checkpoint = resolve_model(args.model)
    folder = calibration_folder(Path(args.calib), print)
    tokenizer = load_tokenizer(checkpoint)
    calib = calibration_samples(folder, tokenizer, model_adds_bos(tokenizer), args.num_samples, args.seq_len, args.seed)
    fp32_bytes = fp32_parameter_bytes(checkpoint)
    load_before = os.getloadavg()
    record: dict = {
        "benchmark": "quantize_scale", "tokq_version": __version__, "model": args.model,
        "fp32_parameter_bytes": fp32_bytes, "fp32_parameter_mib": fp32_bytes / 2**20,
        "settings": {"method": "gptq", "scheme": "w4a16", "group_size": args.group_size, "calib": args.calib,
                     "num_samples": args.num_samples, "seq_len": args.seq_len, "seed": args.seed,
                     "threads": args.threads},
        "calibration": {**calib.to_json(), "source": f"--calib {args.calib}"},
        "hardware": {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "load_average_before": load_before,
    }
    with tempfile.TemporaryDirectory(prefix="tokq-quantize-scale-") as tmp:
        work = Path(tmp)
        tokq_json = work / "tokq.json"
        cmd = [sys.executable, "-m", "tokq", "quantize", "--model", args.model, "--method", "gptq", "--group-size",
               str(args.group_size), "--calib", str(folder), "--num-samples", str(args.num_samples), "--seq-len",
               str(args.seq_len), "--seed", str(args.seed), "--threads", str(args.threads), "--out",
               str(work / "tokq-gptq"), "--json", str(tokq_json)]
        print(f"tokq: {' '.join(cmd[2:])}", flush=True)
        tokq = run_measured(cmd, work / "tokq.log", {**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if tokq["returncode"] != 0:
            sys.exit(f"tokq quantize failed ({tokq['returncode']}):\n{(work / 'tokq.log').read_text()[-2000:]}")
        run = json.loads(tokq_json.read_text())["run"]
        if run["calibration"]["tokens_hash"] != calib.to_json()["tokens_hash"]:
            sys.exit("tokq drew other calibration tokens than this benchmark: the peer would not see the same ids")
        blocks = [b["seconds"] for b in run["blocks"]]
        record["tokq"] = {**tokq, "quantize_seconds": run["seconds"], "block_seconds": blocks,
                          "block_seconds_median": sorted(blocks)[len(blocks) // 2] if blocks else None,
                          "peak_rss_fraction_of_fp32": tokq["peak_rss_mib"] * 2**20 / fp32_bytes}
        record["target"] = {"peak_rss_fraction_max": TARGET_FRACTION,
                            "met": record["tokq"]["peak_rss_fraction_of_fp32"] <= TARGET_FRACTION}
        print(f"tokq: {tokq['wall_s']:.0f} s, peak RSS {tokq['peak_rss_mib']:.0f} MiB "
              f"({100 * record['tokq']['peak_rss_fraction_of_fp32']:.1f}% of fp32)", flush=True)
        if not args.skip_peer:
            from safetensors.torch import save_file

            tokens = work / "calibration.safetensors"
            save_file({"input_ids": calib.tokens.contiguous()}, str(tokens))
            peer = run_peer(args.peer_python, checkpoint, tokens, "gptq", args.group_size, work, 4 * 3600,
                            args.threads, work)
            meta = peer.get("peer") or {}
            record["llm_compressor"] = {
                "status": peer["status"], "wall_s": peer["peer_wall_s"], "seconds": meta.get("seconds"),
                "versions": meta.get("versions"), "recipe": meta.get("recipe"),
                "peak_rss_mib": peer.get("peer_peak_rss_mib"), "error": peer.get("error"),
                "peak_rss_fraction_of_fp32": (peer["peer_peak_rss_mib"] * 2**20 / fp32_bytes
                                              if peer.get("peer_peak_rss_mib") else None),
            }
            print(f"llm-compressor: {peer['status']}, {peer['peer_wall_s']:.0f} s, peak RSS "
                  f"{peer.get('peer_peak_rss_mib') or 0:.0f} MiB", flush=True)
    record["load_average_after"] = os.getloadavg()
    out = args.out or RESULTS / f"quantize-scale-{args.model}.json"
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
