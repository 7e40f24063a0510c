"""Where a decode step's time goes: each op's share of the step, and the share outside tokq's kernels.

    python benchmarks/decode_profile.py [--model smollm2-135m] [--threads 1 2] [--steps 40] [--out PATH]

One sequence (a 512-token prompt), decoding through tokq's engine, for the bf16 model and for RTN int4 g64 with the
int8 LM head (the build benchmarks/vs_llamacpp.py calls int4+int8head), on each decode path: the native step
(engine/native_step.py, the default where it runs) and the compiled graph (TOKQ_NATIVE_STEP=0). After 20 warm-up
steps, 60 steps are timed (median step) and `--steps` are profiled with torch's profiler: per op its self time per
step and its share of the profiled wall time. "kernels" sums tokq's native ops (tokq_native::*, which the native
step names for the profiler though it calls them as C++ functions) and aten's weight-only ops; everything else (the
step's pointwise work, the compiled graph's own code and Python wrapper, dynamo's prologue and guards, allocations,
copies, the LM head's argmax, the engine's scheduling and Python) is "outside kernels"; that share is given against the
profiled step and, since the profiler's cost per recorded op lands outside the kernels too, against the unprofiled
median step (outside_kernels_share_unprofiled). Writes
benchmarks/results/decode-profile-<model>-<cpu>.json (cpu as vs_llamacpp.py names it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
TOP_OPS = 12


def build(model_name: str, config: str):
    from vs_llamacpp import as_saved  # the int4 build as a user runs it: written and loaded back

    from tokq.engine.checkpoint import load_model
    from tokq.quantization.lm_head import quantize_lm_head_
    from tokq.quantization.pipeline import quantize_model
    from tokq.quantization.scheme import preset
    from tokq.zoo import resolve_model

    path = resolve_model(model_name)
    model = load_model(path, dtype=torch.bfloat16)
    if config == "int4+int8head":
        scheme = preset("w4a16").with_weights(group_size=64)
        quantize_model(model, "rtn", scheme)
        quantize_lm_head_(model, "int8")
        model = as_saved(model, scheme, path)
    return model


KERNEL_PREFIXES = ("tokq_native::", "aten::_weight_int4pack_mm", "aten::_weight_int8pack_mm")
PATHS = {"native step": "1", "compiled graph": "0"}  # TOKQ_NATIVE_STEP


def profile_step(model, threads: int, steps: int, path: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from tokq.engine import huge_pages, native_step
    from tokq.engine.llm_engine import EngineConfig, LLMEngine
    from tokq.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    os.environ[native_step.ENV] = PATHS[path]
    engine = LLMEngine(model, EngineConfig(max_model_len=2048, max_num_seqs=1, compile_decode=True))
    if (engine.runner.native_step is not None) != (path == "native step"):
        raise RuntimeError(f"the {path} path is not the one this engine runs ({engine.runner.native_step_why})")
    engine.add_request(list(range(100, 612)), SamplingParams(max_tokens=20 + 60 + steps + 8, ignore_eos=True))
    for _ in range(20):
        engine.step()
    times = []
    for _ in range(60):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    times.sort()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - started) / steps
    ops = sorted(((e.self_cpu_time_total / steps / 1e6, e.key, e.count / steps) for e in prof.key_averages()),
                 reverse=True)
    kernels = sum(t for t, key, _ in ops if key.startswith(KERNEL_PREFIXES))
    return {"threads": threads, "huge_page_bytes": huge_pages.huge_page_bytes(),  # engine/huge_pages.py
            "step_ms_median": times[len(times) // 2] * 1e3, "step_ms_min": times[0] * 1e3,
            "step_ms_max": times[-1] * 1e3, "profiled_step_ms": wall * 1e3,
            "kernels_share": kernels / wall, "outside_kernels_share": 1 - kernels / wall,
            # the same against the unprofiled median step: the profiler's own cost per recorded op (~700 a step)
            # lands outside the kernels above; here only the kernels' time is taken from the profile
            "outside_kernels_share_unprofiled": 1 - kernels / times[len(times) // 2],
            "ops": [{"op": key[:90], "ms_per_step": t * 1e3, "share": t / wall, "calls_per_step": calls}
                    for t, key, calls in ops[:TOP_OPS]],
            # the kernels by name (docs quote them so, whatever their order)
            "kernel_ms_per_step": {key: t * 1e3 for t, key, _ in ops if key.startswith(KERNEL_PREFIXES)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from vs_llamacpp import cpu_facts, cpu_tag  # the same CPU naming as the side-by-side's results

    from tokq import __version__

    load_before = os.getloadavg()
    results = {}
    for config in ("bf16", "int4+int8head"):
        model = build(args.model, config)
        for threads, path in ((t, p) for t in args.threads for p in PATHS):
            key = f"{config} {path} @{threads}t"
            results[key] = profile_step(model, threads, args.steps, path)
            r = results[key]
            print(f"{key}: step {r['step_ms_median']:.2f} ms, kernels {r['kernels_share']:.0%}, "
                  f"outside kernels {r['outside_kernels_share']:.0%}")
        del model
    out = args.out or RESULTS / f"decode-profile-{args.model}-{cpu_tag(cpu_facts())}.json"
    out.write_text(json.dumps({
        "benchmark": "decode_profile", "model": args.model, "tokq_version": __version__, "torch": torch.__version__,
        "cpu": cpu_facts(), "machine": platform.machine(), "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "prompt_tokens": 512, "results": results,
        "notes": "one sequence; shares are of the profiled wall time per step (the profiler adds a little to it); "
                 "kernels = tokq_native::* ops and aten's weight-only int4/int8 ops"}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
