"""tokq's Triton kernels on one CUDA GPU: correctness against the reference, then timings (one table).

    python benchmarks/gpu_kernels.py [--quick] [--out PATH]        # on the GPU machine (gpu_kernels.sh)
    python benchmarks/gpu_kernels.py --smoke                        # anywhere: tiny shapes, Triton's CPU interpreter

Linear kernels run on synthetic weights of real layer shapes (Llama-2-7B's and Llama-3-70B's projections,
and the zoo models' largest layer) at several batch sizes M; each is compared, in the same run, with a
dense fp16 `F.linear` (cuBLAS) of the same shape:
- triton_w4a16 (int4 g128 sym, fp16 activations): M = 1 ... 1024.
- triton_w8a8_int8 (per-channel int8 weights, per-token int8 activations, quantization kernel included):
  M = 16 ... 4096.
- triton_fp8 (e4m3 weights and per-token e4m3 activations): M = 16 ... 4096; fp8 weight-only at small M.
Paged attention: the decode kernel on batches of sequences (fp16 and int8 KV) and the prefill kernel on a
chunk at the end of a long sequence, against the fp32 reference and, for speed, F.scaled_dot_product_attention
on contiguous K/V (no paging).

Every timing is a median (min/max) over --repeats samples of CUDA-event-timed batches of calls; each call
reads a different copy of the weights (or KV cache) so that what is read exceeds the 60 MB L2 several times
over, as in a real decode step. GB/s counts the bytes a call must move at least (the packed weight + x + y;
for attention the K/V of the attended positions + q + out); the roofline is a device-to-device copy
measured in the same run. Correctness: relative error ‖out - ref‖ / ‖ref‖ against kernels.reference (fp32).

Targets (issue 4, H200): w4a16 at M=1 moves >= 70% of the measured bandwidth and is >= 3x fp16 for M <= 16;
w8a8 int8 >= 1.5x fp16 at M >= 256; fp8 >= 1.6x fp16 at M >= 256; paged decode >= 60% of bandwidth.
Writes benchmarks/results/gpu-kernels.json; exit status 1 if a correctness check fails.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # must precede the first import of a Triton kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tokq import __version__  # noqa: E402
from tokq.kernels import paged  # noqa: E402
from tokq.kernels.problem import LinearProblem  # noqa: E402
from tokq.kernels.reference import FP8_E4M3_MAX, FP8Weight, IntWeight, linear_reference  # noqa: E402
from tokq.kernels.triton import fp8 as triton_fp8  # noqa: E402
from tokq.kernels.triton import paged_attention as triton_attention  # noqa: E402
from tokq.kernels.triton import w4a16 as triton_w4a16  # noqa: E402
from tokq.kernels.triton import w8a8 as triton_w8a8  # noqa: E402

RESULTS = Path(__file__).parent / "results"
L2_BYTES = 60 << 20
STREAM_BYTES = 4 * L2_BYTES
MAX_COPIES = 16

# (model, layer, N, K)
LINEAR_SHAPES = [
    ("llama2-7b", "qkv_proj", 12288, 4096), ("llama2-7b", "o_proj", 4096, 4096),
    ("llama2-7b", "gate_up_proj", 22016, 4096), ("llama2-7b", "down_proj", 4096, 11008),
    ("llama3-70b", "o_proj", 8192, 8192), ("llama3-70b", "down_proj", 8192, 28672),
    ("gemma3-270m", "gate_up_proj", 4096, 640),
]
QUICK_SHAPES = {"llama2-7b/gate_up_proj", "llama2-7b/down_proj", "llama3-70b/o_proj"}
SMOKE_SHAPES = [("tiny", "a", 40, 64), ("tiny", "b", 24, 96)]
W4_MS = (1, 4, 16, 64, 256, 1024)
W8_MS = (16, 256, 1024, 4096)
FP8_WEIGHT_ONLY_MS = (1, 16)


@dataclass(frozen=True)
class AttentionCase:
    name: str
    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    query_len: int = 1  # 1: decode; more: a prefill chunk at the end of each sequence
    kv_dtype: str = "fp16"


ATTENTION_CASES = [
    AttentionCase("llama-8b decode", 64, 4096, 32, 8, 128),
    AttentionCase("llama-8b decode int8 KV", 64, 4096, 32, 8, 128, kv_dtype="int8"),
    AttentionCase("llama-8b decode long", 8, 32768, 32, 8, 128),
    AttentionCase("smollm2 decode", 128, 2048, 9, 3, 64),
    AttentionCase("gemma3 decode window 512", 64, 4096, 4, 1, 256, window=512),
    AttentionCase("gemma3 decode global", 64, 4096, 4, 1, 256),
    AttentionCase("llama-8b prefill chunk 512", 4, 4096, 32, 8, 128, query_len=512),
]
SMOKE_ATTENTION = [
    AttentionCase("tiny decode", 3, 40, 4, 2, 64),
    AttentionCase("tiny decode int8", 2, 33, 4, 1, 64, kv_dtype="int8"),
    AttentionCase("tiny prefill", 2, 48, 4, 2, 64, query_len=20, window=24),
]


# --------------------------------------------------------------------------------------------------
# Timing


def cuda() -> bool:
    return torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET")


def synchronize() -> None:
    if cuda():
        torch.cuda.synchronize()


def time_calls(call: Callable[[int], object], copies: int, repeats: int, min_ms: float) -> dict:
    """Median/min/max seconds per call of call(i) (i cycling over the copies), CUDA events around batches."""
    for i in range(max(copies, 3)):  # warm-up, autotuning included
        call(i % copies)
    synchronize()
    if not cuda():
        t = time.perf_counter()
        call(0)
        return {"median_s": time.perf_counter() - t, "min_s": None, "max_s": None, "calls": 1}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(copies):
        call(i)
    end.record()
    end.synchronize()
    per_call = start.elapsed_time(end) / 1e3 / copies
    calls = max(copies, int(min_ms / 1e3 / max(per_call, 1e-7)))
    samples = []
    for _ in range(repeats):
        start.record()
        for i in range(calls):
            call(i % copies)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples), "calls": calls}


def copy_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy (bytes read + written): the memory roofline of this run."""
    if not cuda():
        return float("nan")
    src = torch.empty(int(gib * (1 << 30)) // 2, dtype=torch.float16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = time_calls(lambda i: dst.copy_(src), 1, repeats, 50.0)
    return 2 * gib * (1 << 30) / t["median_s"] / 1e9


def copies_for(nbytes: int, smoke: bool) -> int:
    return 1 if smoke else min(MAX_COPIES, max(1, math.ceil(STREAM_BYTES / max(nbytes, 1))))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "__dataclass_fields__"):
        return sum(nbytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


# --------------------------------------------------------------------------------------------------
# Linear kernels


def random_int_weight(n: int, k: int, bits: int, group_size: int, device, seed: int) -> IntWeight:
    g = torch.Generator(device="cpu").manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group_size, generator=g) * 0.02 + 0.001
    return IntWeight(q.to(device), scale.to(device), None, bits, group_size)


def random_fp8_weight(n: int, k: int, device, seed: int) -> FP8Weight:
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(device)
    scale = w.abs().amax(1, keepdim=True) / FP8_E4M3_MAX
    return FP8Weight((w / scale).to(torch.float8_e4m3fn), scale)


@dataclass
class LinearKernel:
    name: str
    make_weight: Callable[[int, int, int], object]  # (n, k, seed) -> IntWeight | FP8Weight
    prepare: Callable
    run: Callable
    act: str | None
    ms: tuple[int, ...]


def linear_kernels(device) -> list[LinearKernel]:
    return [
        LinearKernel("triton_w4a16", lambda n, k, s: random_int_weight(n, k, 4, 128 if k % 128 == 0 else 32, device, s),
                     triton_w4a16.prepare_w4a16, triton_w4a16.run_w4a16, None, W4_MS),
        LinearKernel("triton_w8a8_int8", lambda n, k, s: random_int_weight(n, k, 8, k, device, s),
                     triton_w8a8.prepare_w8a8_int8, triton_w8a8.run_w8a8_int8, "int8", W8_MS),
        LinearKernel("triton_fp8", lambda n, k, s: random_fp8_weight(n, k, device, s),
                     triton_fp8.prepare_fp8, triton_fp8.run_fp8, "fp8", W8_MS),
        LinearKernel("triton_fp8_weight_only", lambda n, k, s: random_fp8_weight(n, k, device, s),
                     triton_fp8.prepare_fp8, triton_fp8.run_fp8, None, FP8_WEIGHT_ONLY_MS),
    ]


def bench_linear(args, device, dtype: torch.dtype, bandwidth: float) -> tuple[list[dict], list[str]]:
    rows, failures = [], []
    shapes = SMOKE_SHAPES if args.smoke else [s for s in LINEAR_SHAPES
                                             if not args.quick or f"{s[0]}/{s[1]}" in QUICK_SHAPES]
    for model, layer, n, k in shapes:
        dense = [(torch.randn(n, k, device=device, dtype=dtype) * 0.02)]
        dense += [torch.randn_like(dense[0]) * 0.02 for _ in range(copies_for(nbytes(dense[0]), args.smoke) - 1)]
        for kernel in linear_kernels(device):
            if args.smoke and kernel.name.startswith("triton_fp8"):
                continue  # the interpreter's fp8 casts are wrong (tests/test_triton_w8a8_fp8.py runs fp16 stand-ins)
            first = kernel.make_weight(n, k, 0)
            problem = LinearProblem.of(first, kernel.act, dtype, device)
            states = [kernel.prepare(first, problem)]
            state_bytes = nbytes(states[0])
            for i in range(1, copies_for(state_bytes, args.smoke)):
                states.append(kernel.prepare(kernel.make_weight(n, k, i), problem))
            ms = (1, 3, 17) if args.smoke else kernel.ms
            for m in ms:
                x = torch.randn(m, k, device=device, dtype=dtype)
                out = kernel.run(x, states[0], None, kernel.act)
                ref = linear_reference(x.float(), first, None, kernel.act)
                err = relative_error(out, ref)
                tol = 1e-2 if dtype != torch.float32 else 1e-4
                ok = err < tol
                if not ok:
                    failures.append(f"{kernel.name} {model}/{layer} M={m}: relative error {err:.2e} >= {tol:.0e}")
                t = time_calls(lambda i: kernel.run(x, states[i % len(states)], None, kernel.act),  # noqa: B023 (called at once)
                               len(states), args.repeats, args.min_ms)
                t_dense = time_calls(lambda i: F.linear(x, dense[i % len(dense)]), len(dense), args.repeats, args.min_ms)  # noqa: B023
                moved = state_bytes + m * k * x.element_size() + m * n * x.element_size()
                gbps = moved / t["median_s"] / 1e9
                rows.append({
                    "kernel": kernel.name, "model": model, "layer": layer, "n": n, "k": k, "m": m,
                    "relative_error": err, "correct": ok,
                    "median_us": t["median_s"] * 1e6, "min_us": (t["min_s"] or t["median_s"]) * 1e6,
                    "max_us": (t["max_s"] or t["median_s"]) * 1e6, "fp16_dense_median_us": t_dense["median_s"] * 1e6,
                    "speedup_vs_fp16": t_dense["median_s"] / t["median_s"],
                    "tflops": 2 * m * n * k / t["median_s"] / 1e12, "bytes_moved": moved, "gbps": gbps,
                    "bandwidth_fraction": gbps / bandwidth if bandwidth == bandwidth else None,
                    "weight_copies": len(states),
                })
                r = rows[-1]
                print(f"{kernel.name:22s} {model:11s} {layer:12s} M={m:<5d} err {err:.1e}  "
                      f"{r['median_us']:9.1f} us  fp16 {r['fp16_dense_median_us']:9.1f} us  x{r['speedup_vs_fp16']:.2f}  "
                      f"{gbps:7.0f} GB/s" + (f" ({r['bandwidth_fraction']:.0%})" if r["bandwidth_fraction"] else ""),
                      flush=True)
        if cuda():
            torch.cuda.empty_cache()
    return rows, failures


# --------------------------------------------------------------------------------------------------
# Paged attention


def attention_inputs(case: AttentionCase, device, dtype, seed: int):
    """A random paged layout (shuffled blocks) holding `case.batch` sequences of `case.context` tokens."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = [case.context - (i * 7) % max(1, case.context // 8) for i in range(case.batch)]  # mixed lengths
    layout = paged.random_paged_layout(lens, [case.query_len] * case.batch, num_kv_heads=case.kv_heads,
                                       head_dim=case.head_dim, block_size=16, dtype=dtype, device=device,
                                       generator=g, kv_dtype=case.kv_dtype)
    q = torch.randn(sum(min(case.query_len, s) for s in lens), case.q_heads, case.head_dim, generator=g).to(device, dtype)
    return q, layout


def bench_attention(args, device, dtype: torch.dtype, bandwidth: float) -> tuple[list[dict], list[str]]:
    rows, failures = [], []
    for case in SMOKE_ATTENTION if args.smoke else ATTENTION_CASES:
        if args.quick and "long" in case.name:
            continue
        q, layout = attention_inputs(case, device, dtype, 0)
        scale = case.head_dim ** -0.5

        def run(i, q=q, layout=layout, case=case, scale=scale):
            return triton_attention.paged_attention_triton(q, layout.k_cache, layout.v_cache, layout.meta, scale,
                                                           case.window, layout.k_scale, layout.v_scale)

        out = run(0)
        ref = paged.paged_attention_reference(q, layout.k_cache, layout.v_cache, layout.meta, scale, case.window,
                                              layout.k_scale, layout.v_scale)
        err = relative_error(out, ref)
        tol = 1e-2 if dtype != torch.float32 else 1e-4
        if err >= tol:
            failures.append(f"paged attention {case.name}: relative error {err:.2e} >= {tol:.0e}")
        t = time_calls(run, 1, args.repeats, args.min_ms)
        lens = layout.meta.seq_lens.tolist()
        attended = sum(min(s, case.window) if case.window and case.query_len == 1 else s for s in lens)
        kv_elem = 1 if case.kv_dtype == "int8" else torch.finfo(dtype).bits // 8
        moved = 2 * attended * case.kv_heads * case.head_dim * kv_elem + 2 * q.numel() * q.element_size()
        gbps = moved / t["median_s"] / 1e9
        sdpa_us = None
        if cuda() and case.kv_dtype != "int8":  # contiguous K/V, no paging: what the paging costs
            kc = torch.randn(case.batch, case.kv_heads, case.context, case.head_dim, device=device, dtype=dtype)
            vc = torch.randn_like(kc)
            qc = torch.randn(case.batch, case.q_heads, case.query_len, case.head_dim, device=device, dtype=dtype)
            ts = time_calls(lambda i: F.scaled_dot_product_attention(qc, kc, vc, is_causal=case.query_len > 1,  # noqa: B023
                                                                     enable_gqa=True), 1, args.repeats, args.min_ms)
            sdpa_us = ts["median_s"] * 1e6
        rows.append({
            "case": case.name, **{f: getattr(case, f) for f in ("batch", "context", "q_heads", "kv_heads", "head_dim",
                                                                   "window", "query_len", "kv_dtype")},
            "relative_error": err, "correct": err < tol, "median_us": t["median_s"] * 1e6,
            "min_us": (t["min_s"] or t["median_s"]) * 1e6, "max_us": (t["max_s"] or t["median_s"]) * 1e6,
            "bytes_moved": moved, "gbps": gbps, "bandwidth_fraction": gbps / bandwidth if bandwidth == bandwidth else None,
            "sdpa_contiguous_us": sdpa_us,
        })
        print(f"paged attention {case.name:28s} err {err:.1e}  {t['median_s'] * 1e6:9.1f} us  {gbps:7.0f} GB/s"
              + (f" ({rows[-1]['bandwidth_fraction']:.0%})" if rows[-1]["bandwidth_fraction"] else "")
              + (f"  sdpa contiguous {sdpa_us:.1f} us" if sdpa_us else ""), flush=True)
        if cuda():
            torch.cuda.empty_cache()
    return rows, failures


# --------------------------------------------------------------------------------------------------
# Targets and report


def targets(linear: list[dict], attention: list[dict]) -> list[dict]:
    def rows(kernel, pred):
        return [r for r in linear if r["kernel"] == kernel and pred(r)]

    big = lambda r: r["model"] != "gemma3-270m"  # noqa: E731  (launch-bound small layer, reported, not targeted)
    checks = [
        ("w4a16 M=1 bandwidth fraction >= 0.70", rows("triton_w4a16", lambda r: r["m"] == 1 and big(r)),
         "bandwidth_fraction", 0.70),
        ("w4a16 M<=16 speedup vs fp16 >= 3.0", rows("triton_w4a16", lambda r: r["m"] <= 16 and big(r)),
         "speedup_vs_fp16", 3.0),
        ("w8a8 int8 M>=256 speedup vs fp16 >= 1.5", rows("triton_w8a8_int8", lambda r: r["m"] >= 256 and big(r)),
         "speedup_vs_fp16", 1.5),
        ("fp8 M>=256 speedup vs fp16 >= 1.6", rows("triton_fp8", lambda r: r["m"] >= 256 and big(r)),
         "speedup_vs_fp16", 1.6),
        ("paged decode bandwidth fraction >= 0.60", [r for r in attention if r["query_len"] == 1], "bandwidth_fraction", 0.60),
    ]
    out = []
    for name, rs, key, goal in checks:
        values = [r[key] for r in rs if r.get(key) is not None]
        out.append({"target": name, "rows": len(values), "met": sum(v >= goal for v in values),
                    "median": statistics.median(values) if values else None, "min": min(values) if values else None,
                    "max": max(values) if values else None})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter: checks that everything runs")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (about half the time)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--min-ms", type=float, default=20.0, help="minimum milliseconds per timed sample")
    ap.add_argument("--only", choices=["linear", "attention"], default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default results/gpu-kernels.json on a GPU)")
    args = ap.parse_args()
    if not args.smoke and not cuda():
        print("no CUDA device: run on a GPU machine (benchmarks/gpu_kernels.sh), or --smoke for the CPU interpreter")
        return 1
    device = torch.device("cuda" if cuda() else "cpu")
    dtype = torch.float16 if cuda() else torch.float32  # the interpreter's fp16 tl.dot is exact enough; fp32 is safest
    started = time.time()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    print(f"device {torch.cuda.get_device_name() if cuda() else 'cpu (Triton interpreter)'}; "
          f"copy bandwidth {bandwidth:.0f} GB/s; torch {torch.__version__}", flush=True)
    linear, attention, failures = [], [], []
    if args.only in (None, "linear"):
        linear, f = bench_linear(args, device, dtype, bandwidth)
        failures += f
    if args.only in (None, "attention"):
        attention, f = bench_attention(args, device, dtype, bandwidth)
        failures += f
    summary = targets(linear, attention) if not args.smoke else []
    for t in summary:
        if t["rows"]:
            print(f"target {t['target']}: met on {t['met']}/{t['rows']} rows (median {t['median']:.2f}, "
                  f"min {t['min']:.2f}, max {t['max']:.2f})")
    for f in failures:
        print(f"FAILED {f}")
    payload = {
        "tokq_version": __version__, "benchmark": "gpu-kernels", "smoke": args.smoke,
        "device": torch.cuda.get_device_name() if cuda() else "cpu (TRITON_INTERPRET=1)",
        "capability": list(torch.cuda.get_device_capability()) if cuda() else None,
        "torch": torch.__version__, "triton": __import__("triton").__version__, "python": platform.python_version(),
        "dtype": str(dtype).replace("torch.", ""), "repeats": args.repeats, "min_ms_per_sample": args.min_ms,
        "copy_bandwidth_gbps": bandwidth, "weights_streamed_past_bytes": STREAM_BYTES,
        "seconds": time.time() - started, "targets": summary, "failures": failures,
        "linear": linear, "attention": attention,
    }
    out = args.out or (RESULTS / "gpu-kernels.json" if not args.smoke else None)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        tmp.replace(out)
        print(f"wrote {out}")
    print(f"{time.time() - started:.0f} s; {len(failures)} correctness failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
