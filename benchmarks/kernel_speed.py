"""CPU linear kernels vs dense fp32 and bf16 matmuls, on the real models' layer shapes and 4096x4096.

    python benchmarks/kernel_speed.py [--threads 1] [--repeats 5] [--ms 5] [--ms-total 0] [--out PATH]

For each shape (N, K) and batch M in 1, 4, 16, 64, 256 it times, in the same run and interleaved
round by round (the order rotates each round, so load drift on a shared machine hits all alike):
dense fp32 `F.linear`, dense bf16 `F.linear`, and each CPU kernel the registry would run, prepared
through the registry itself (`TOKQ_KERNELS`-style forcing by name): cpu_int4 (int4 weight-only,
g64 for SmolLM2 whose 576 does not divide by 128, else g128), cpu_int8 (int8 weight-only
per-channel) and cpu_w8a8_int8 (per-token int8 activations). All take bf16 activations.
cpu_fp8_dequant is not timed: after its one-time dequantization it is the bf16 dense matmul.

A sample is a batch of calls lasting at least --ms milliseconds, cycling over enough copies of the
weight that one path's weights exceed the L2 cache (as in a decode step, where every layer's weight
comes from L3/DRAM, not L2); times are per call, quoted as median (min/max) over --repeats samples.
GB/s counts the bytes a call must move (the weight in its stored form + x + y); the bandwidth it is
compared with is a large tensor copy (read + write, 2 x 512 MiB) measured in the same run, at the
start and the end. Note: the L3 of this VM reports 480 MiB, so small layers can beat the copy rate.
Writes benchmarks/results/kernels-cpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokq import __version__
from tokq.engine.roofline import copy_bandwidth
from tokq.kernels.reference import IntWeight
from tokq.kernels.registry import prepare_linear_kernel

RESULTS = Path(__file__).parent / "results"
MS = (1, 4, 16, 64, 256)
# (model, layer, N, K): tokq's merged projections (qkv, gate_up) as the engine runs them.
SHAPES = [
    ("smollm2-135m", "qkv_proj", 960, 576), ("smollm2-135m", "o_proj", 576, 576),
    ("smollm2-135m", "gate_up_proj", 3072, 576), ("smollm2-135m", "down_proj", 576, 1536),
    ("gemma3-270m", "qkv_proj", 1536, 640), ("gemma3-270m", "o_proj", 640, 1024),
    ("gemma3-270m", "gate_up_proj", 4096, 640), ("gemma3-270m", "down_proj", 640, 2048),
    ("square", "4096x4096", 4096, 4096),
]
L2_BYTES = 4 << 20
STREAM_BYTES = 4 * L2_BYTES  # each path cycles over copies totalling at least this
MAX_COPIES = 64


def int_weight(n: int, k: int, bits: int, group_size: int, seed: int) -> IntWeight:
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    return IntWeight(q, torch.rand(n, k // group_size, generator=g) * 0.02 + 0.001, None, bits, group_size)


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj):  # a PreparedKernel or its state; the layer's own buffers are not packed bytes
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj) if not f.metadata.get("layer_buffers"))
    return 0


class TimedPath:
    """One way to compute y = x W^T for a shape: copies of its weight and a call on one copy."""

    def __init__(self, name: str, kernel: str, make, call, x_dtype: torch.dtype):
        self.name, self.kernel, self.call, self.x_dtype = name, kernel, call, x_dtype
        first = make(0)
        self.weight_bytes = tensor_bytes(first)
        copies = min(MAX_COPIES, max(1, math.ceil(STREAM_BYTES / self.weight_bytes)))
        self.weights = [first] + [make(i) for i in range(1, copies)]
        self.i = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weights[self.i]
        self.i = (self.i + 1) % len(self.weights)
        return self.call(x, w)


def make_paths(n: int, k: int, group_size: int) -> list[TimedPath]:
    def dense(dtype):
        return lambda i: (torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * 0.02).to(dtype)

    def quant(bits, gs, act, kernel):
        return lambda i: prepare_linear_kernel(int_weight(n, k, bits, gs, i), act, torch.bfloat16, kernel)

    paths = [
        TimedPath("fp32_dense", "F.linear fp32", dense(torch.float32), lambda x, w: F.linear(x, w), torch.float32),
        TimedPath("bf16_dense", "F.linear bf16", dense(torch.bfloat16), lambda x, w: F.linear(x, w), torch.bfloat16),
        TimedPath(f"int4_g{group_size}", "cpu_int4", quant(4, group_size, None, "cpu_int4"),
              lambda x, kern: kern(x, None, None), torch.bfloat16),
        TimedPath("int8", "cpu_int8", quant(8, k, None, "cpu_int8"), lambda x, kern: kern(x, None, None), torch.bfloat16),
        TimedPath("w8a8_int8", "cpu_w8a8_int8", quant(8, k, "int8", "cpu_w8a8_int8"),
              lambda x, kern: kern(x, None, "int8"), torch.bfloat16),
    ]
    for p in paths[2:]:
        assert p.weights[0].name == p.kernel, (p.name, p.weights[0].name)
        p.weight_bytes = tensor_bytes(p.weights[0].state)  # the packed form a call reads
    return paths


def sample(path: TimedPath, x: torch.Tensor, min_s: float, calls: int) -> tuple[float, int]:
    t = time.perf_counter()
    done = 0
    with torch.inference_mode():
        while True:
            for _ in range(calls):
                path(x)
            done += calls
            elapsed = time.perf_counter() - t
            if elapsed >= min_s:
                return elapsed / done, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ms", type=float, default=5.0, help="minimum milliseconds per sample")
    parser.add_argument("--ms-list", type=int, nargs="+", default=list(MS), help="batch sizes M")
    parser.add_argument("--shapes", nargs="+", default=None, help="only these models/layers (e.g. square smollm2-135m)")
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.time()

    bandwidth = {"start": copy_bandwidth(mib=512)}
    print(f"copy bandwidth: {bandwidth['start']['gbps_median']:.1f} GB/s (median), {args.threads} thread(s)", flush=True)
    rows = []
    shapes = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes or s[1] in args.shapes]
    for model, layer, n, k in shapes:
        group_size = 64 if model.startswith("smollm2") else 128
        paths = make_paths(n, k, group_size)
        for m in args.ms_list:
            xs = {dt: torch.randn(m, k).to(dt) for dt in (torch.float32, torch.bfloat16)}
            calls = {}
            for p in paths:  # warm up, and size each sample's batch of calls
                t = time.perf_counter()
                for _ in range(len(p.weights)):
                    p(xs[p.x_dtype])
                per_call = (time.perf_counter() - t) / len(p.weights)
                calls[p.name] = max(1, min(len(p.weights), int(args.ms / 1e3 / max(per_call, 1e-7))))
            times: dict[str, list[float]] = {p.name: [] for p in paths}
            for r in range(args.repeats):
                order = paths[r % len(paths):] + paths[: r % len(paths)]
                for p in order:
                    times[p.name].append(sample(p, xs[p.x_dtype], args.ms / 1e3, calls[p.name])[0])
            med = {name: statistics.median(ts) for name, ts in times.items()}
            for p in paths:
                io = m * k * xs[p.x_dtype].element_size() + m * n * xs[p.x_dtype].element_size()
                moved = p.weight_bytes + io
                gbps = moved / med[p.name] / 1e9
                rows.append({
                    "model": model, "layer": layer, "n": n, "k": k, "m": m, "path": p.name, "kernel": p.kernel,
                    "median_us": med[p.name] * 1e6, "min_us": min(times[p.name]) * 1e6, "max_us": max(times[p.name]) * 1e6,
                    "weight_bytes": p.weight_bytes, "bytes_moved": moved, "gbps": gbps,
                    "bandwidth_fraction": gbps / bandwidth["start"]["gbps_median"],
                    "speedup_vs_fp32": med["fp32_dense"] / med[p.name], "speedup_vs_bf16": med["bf16_dense"] / med[p.name],
                    "weight_copies": len(p.weights), "repeats": args.repeats,
                })
            line = "  ".join(f"{p.name} {med[p.name] * 1e6:8.1f}us x{med['fp32_dense'] / med[p.name]:.2f}" for p in paths)
            print(f"{model:13s} {layer:13s} M={m:<4d} {line}", flush=True)
    bandwidth["end"] = copy_bandwidth(mib=512)
    bw = statistics.median([bandwidth["start"]["gbps_median"], bandwidth["end"]["gbps_median"]])
    for row in rows:
        row["bandwidth_fraction"] = row["gbps"] / bw

    real_int4_m1 = {f"{r['model']}/{r['layer']}": r["speedup_vs_fp32"] for r in rows
                    if r["m"] == 1 and r["kernel"] == "cpu_int4" and r["model"] != "square"}
    summary = {
        "int4_m1_speedup_vs_fp32_dense": real_int4_m1,
        "int4_m1_speedup_vs_fp32_dense_geomean": (math.exp(statistics.mean(math.log(v) for v in real_int4_m1.values()))
                                                  if real_int4_m1 else None),
        "int4_m1_speedup_vs_fp32_dense_min": min(real_int4_m1.values()) if real_int4_m1 else None,
        "target": "cpu_int4 at M=1 >= 1.5x fp32 dense on the real models' shapes",
    }
    payload = {
        "tokq_version": __version__, "benchmark": "kernels-cpu", "torch": torch.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor(),
        "threads": args.threads, "repeats": args.repeats, "min_ms_per_sample": args.ms, "seed": 0,
        "activations": "bf16 for the quantized kernels and bf16 dense; fp32 for fp32 dense",
        "weights_streamed_past_bytes": STREAM_BYTES, "bandwidth": bandwidth, "bandwidth_used_gbps": bw,
        "seconds": time.time() - started, "summary": summary, "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(args.out)
    print("int4 M=1 vs fp32 dense on the real shapes: " + ", ".join(f"{k} {v:.2f}x" for k, v in real_int4_m1.items()))
    print(f"geomean {summary['int4_m1_speedup_vs_fp32_dense_geomean']:.2f}x; copy bandwidth {bw:.1f} GB/s; "
          f"{payload['seconds']:.0f}s; wrote {args.out}")


if __name__ == "__main__":
    main()
