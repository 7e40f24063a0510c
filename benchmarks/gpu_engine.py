"""tokq's serving engine on one CUDA GPU: both zoo architectures, fp16 vs int4 vs W8A8 int8 vs fp8,
continuous vs static batching, one table.

    python benchmarks/gpu_engine.py [--quick] [--out PATH]     # on the GPU machine (gpu_engine.sh)
    python benchmarks/gpu_engine.py --smoke                     # anywhere: 2-layer models, tiny workload, CPU

The GPU machine is offline and only small files travel to it, so the models are built from the zoo
models' own config.json (benchmarks/model_configs/) with random weights: every shape, kernel and byte
moved is the real model's, only the outputs are meaningless (quality is measured elsewhere, on CPU, on
the real weights). Variants are quantized in memory: RTN int4 g64 (w4a16), W8A8 int8 (per-channel
weights, per-token dynamic activations) and fp8 e4m3 W8A8.

Workload (the common serving benchmark): 512 prompt tokens, 256 output tokens (mixed lengths: ±50%),
concurrency 16, 32 requests, all at once. Per row: TTFT, TPOT, TBT p95, throughput, the kernels used,
and the decode roofline against a copy bandwidth measured in the same run.
Writes benchmarks/results/gpu-engine.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from tokq import __version__
from tokq.engine.checkpoint import random_model
from tokq.engine.config import parse_config
from tokq.engine.roofline import copy_bandwidth
from tokq.engine.workload import Workload, bench_model

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "model_configs"
VARIANTS = {"fp16": None, "int4": ("rtn", "w4a16-g64"), "w8a8-int8": ("rtn", "w8a8-int8"), "fp8": ("fp8", "w8a8-fp8")}


def build(name: str, variant: str, dtype: torch.dtype, device: str, smoke: bool):
    from tokq.quantization.pipeline import quantize_model
    from tokq.quantization.scheme import preset

    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    if smoke:
        raw["num_hidden_layers"] = 2
        raw.pop("layer_types", None)
    model = random_model(parse_config(raw, where=name), dtype, "cpu")
    recipe = VARIANTS[variant]
    if recipe is not None:
        method, scheme = recipe
        # g64: SmolLM2's hidden size 576 is not a multiple of 128
        quantize_model(model, method, preset("w4a16").with_weights(group_size=64) if scheme == "w4a16-g64" else scheme)
    return model.to(device)  # quantized layers re-choose their kernel for the device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 requests of 256 + 128 tokens")
    parser.add_argument("--smoke", action="store_true", help="CPU, 2-layer models, a tiny workload")
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gpu-engine.json")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --smoke for the CPU check")
    dtype = torch.float32 if args.smoke else torch.float16
    if args.smoke:
        workload = Workload(prompt_len=24, gen_len=6, num_requests=4, gen_len_range=0.5)
        engine_kwargs = dict(max_num_seqs=2, max_num_batched_tokens=64)
    elif args.quick:
        workload = Workload(prompt_len=256, gen_len=128, num_requests=16, gen_len_range=0.5)
        engine_kwargs = dict(max_num_seqs=16, max_num_batched_tokens=2048)
    else:
        workload = Workload(prompt_len=512, gen_len=256, num_requests=32, gen_len_range=0.5)
        engine_kwargs = dict(max_num_seqs=16, max_num_batched_tokens=2048)
    start = time.perf_counter()
    bandwidth = copy_bandwidth(device, mib=64 if args.smoke else 1024)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; copy bandwidth "
          f"{bandwidth['gbps_median']:.0f} GB/s; torch {torch.__version__}", flush=True)
    rows, failures = [], []
    for name in args.models:
        for variant in args.variants:
            try:
                model = build(name, variant, dtype, device, args.smoke)
                prompts = workload.prompts(model.config.vocab_size)
                for row in bench_model(f"{name} {variant}", model, workload, ["continuous", "static"], engine_kwargs,
                                       bandwidth["gbps_median"], prompts):
                    rows.append(row)
                    m = row["metrics"]
                    print(f"{row['variant']:24s} {row['mode']:10s} TTFT {m['ttft_mean_s'] * 1e3:8.1f} ms  "
                          f"TPOT {m['tpot_mean_s'] * 1e3:7.2f} ms  TBT p95 {m['tbt_p95_s'] * 1e3:7.2f} ms  "
                          f"{m['output_tokens_per_s']:8.0f} out tok/s  roofline {row['roofline_fraction']:.0%}  "
                          f"{', '.join(row['kernels']['linear'] + row['kernels']['attention'])}", flush=True)
                del model
            except Exception as exc:  # one variant failing must not hide the others' numbers
                failures.append({"model": name, "variant": variant, "error": f"{type(exc).__name__}: {exc}"})
                print(f"{name} {variant}: FAILED {type(exc).__name__}: {exc}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    report = {"tokq_version": __version__, "benchmark": "gpu-engine", "device": device,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
              "python": platform.python_version(), "weights": "random (real configs)", "workload": workload.to_json(),
              "engine": engine_kwargs, "bandwidth": bandwidth, "rows": rows, "failures": failures,
              "seconds": time.perf_counter() - start}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} in {report['seconds']:.0f} s; {len(failures)} failure(s)")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
