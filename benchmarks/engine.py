"""tokq's serving engine on SmolLM2-135M on this CPU: the issue-5 speed targets, ratios measured in one run.

    python benchmarks/engine.py [--threads 1] [--quick] [--out PATH]

1. Batch-1 decode (prompt 128, 64 new tokens, greedy): tokens/s of the bf16 baseline, of an RTN int4 g64
   variant (quantized in memory; same kernels as a saved checkpoint), and of HF transformers' `generate`
   (bf16, SDPA, its own KV cache) with the same threads. Interleaved repeats, medians with min/max.
   Targets: int4 >= 1.5x the baseline; the baseline >= HF generate.
2. Concurrency 16 with mixed output lengths (48 requests, prompt 256, output 128 +-95%, all at once,
   a 256-token step budget): continuous batching vs static batching, bf16. Targets: continuous
   throughput >= 2x static; TBT p95 <= 2x TPOT; KV waste < 4%.

Writes benchmarks/results/engine-smollm2-135m-cpu.json (every run's full metrics, the targets, threads,
torch version, machine, the copy bandwidth and the decode roofline fraction).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tokq import __version__
from tokq.engine.checkpoint import load_model
from tokq.engine.llm_engine import EngineConfig, LLMEngine
from tokq.engine.roofline import copy_bandwidth
from tokq.engine.sampling import SamplingParams
from tokq.engine.workload import Workload, bench_model
from tokq.zoo import resolve_model

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m"


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def tokq_decode_tps(model, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s of one request (TPOT from its token times: prefill excluded)."""
    engine = LLMEngine(model, EngineConfig(max_model_len=len(prompt) + new_tokens, max_num_seqs=1))
    engine.generate([prompt[:8]], SamplingParams(max_tokens=2, ignore_eos=True))
    out = engine.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))[0]
    return 1.0 / out.metrics.tpot_s


def hf_decode_tps(hf_model, prompt: list[int], new_tokens: int) -> float:
    """HF generate's decode tokens/s: (time for N tokens - time for 1 token) / (N - 1)."""
    ids = torch.tensor([prompt])

    def run(n: int) -> float:
        t = time.perf_counter()
        hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    run(2)
    return (new_tokens - 1) / (run(new_tokens) - run(1))


def batch1(model_bf16, model_int4, hf_model, repeats: int, new_tokens: int) -> dict:
    prompt = Workload(prompt_len=128, num_requests=1, seed=1).prompts(model_bf16.config.vocab_size)[0]
    runs: dict[str, list[float]] = {"tokq_bf16": [], "tokq_int4": [], "hf_generate_bf16": []}
    for _ in range(repeats):  # interleaved: drift on the shared machine hits all three alike
        runs["tokq_bf16"].append(tokq_decode_tps(model_bf16, prompt, new_tokens))
        runs["tokq_int4"].append(tokq_decode_tps(model_int4, prompt, new_tokens))
        runs["hf_generate_bf16"].append(hf_decode_tps(hf_model, prompt, new_tokens))
    ratios = {
        "int4_vs_bf16": [a / b for a, b in zip(runs["tokq_int4"], runs["tokq_bf16"], strict=True)],
        "bf16_vs_hf_generate": [a / b for a, b in zip(runs["tokq_bf16"], runs["hf_generate_bf16"], strict=True)],
    }
    return {"prompt_len": len(prompt), "new_tokens": new_tokens,
            "tokens_per_s": {k: summary(v) for k, v in runs.items()},
            "ratios": {k: summary(v) for k, v in ratios.items()},
            "targets": {"int4_vs_bf16 >= 1.5": statistics.median(ratios["int4_vs_bf16"]) >= 1.5,
                        "bf16_vs_hf_generate >= 1.0": statistics.median(ratios["bf16_vs_hf_generate"]) >= 1.0}}


def concurrency(model, workload: Workload, step_tokens: int, bandwidth_gbps: float) -> dict:
    prompts = workload.prompts(model.config.vocab_size)
    rows = bench_model(MODEL, model, workload, ["continuous", "static"],
                       dict(max_num_seqs=16, max_num_batched_tokens=step_tokens), bandwidth_gbps, prompts)
    runs = {row["mode"]: row for row in rows}
    for mode, row in runs.items():
        m = row["metrics"]
        print(f"  {mode:10s} {m['output_tokens_per_s']:7.1f} out tok/s  TPOT {m['tpot_mean_s'] * 1e3:6.1f} ms  "
              f"TBT p95 {m['tbt_p95_s'] * 1e3:6.1f} ms  TTFT {m['ttft_mean_s']:6.2f} s  KV waste {m['kv_waste']:.2%}  "
              f"preemptions {m['preemptions']}  roofline {row['roofline_fraction']:.0%}", flush=True)
    cont, stat = runs["continuous"]["metrics"], runs["static"]["metrics"]
    speedup = cont["output_tokens_per_s"] / stat["output_tokens_per_s"]
    return {"workload": workload.to_json(), "max_num_batched_tokens": step_tokens, "runs": runs,
            "continuous_vs_static_throughput": speedup,
            "tbt_p95_over_tpot": cont["tbt_p95_s"] / cont["tpot_mean_s"],
            "targets": {"continuous_vs_static >= 2": speedup >= 2.0,
                        "tbt_p95 <= 2 x tpot": cont["tbt_p95_s"] <= 2 * cont["tpot_mean_s"],
                        "kv_waste < 4%": cont["kv_waste"] < 0.04}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer requests and tokens (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "engine-smollm2-135m-cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    from tokq.quantization.pipeline import quantize_model
    from tokq.quantization.scheme import preset

    checkpoint = resolve_model(MODEL)
    start = time.perf_counter()
    bandwidth = copy_bandwidth("cpu")
    model_bf16 = load_model(checkpoint, dtype="bf16")
    model_int4 = load_model(checkpoint, dtype="bf16")
    quantize_model(model_int4, "rtn", preset("w4a16").with_weights(group_size=64))
    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16, local_files_only=True,
                                                    attn_implementation="sdpa").eval()
    new_tokens = 16 if args.quick else 64
    print(f"batch-1 decode ({args.threads} thread(s), {args.repeats} interleaved repeats)", flush=True)
    one = batch1(model_bf16, model_int4, hf_model, args.repeats, new_tokens)
    for name, s in one["tokens_per_s"].items():
        print(f"  {name:18s} {s['median']:6.1f} tok/s (min {s['min']:.1f}, max {s['max']:.1f})")
    print(f"  int4 / bf16 {one['ratios']['int4_vs_bf16']['median']:.2f}x, bf16 / HF generate "
          f"{one['ratios']['bf16_vs_hf_generate']['median']:.2f}x", flush=True)
    del hf_model
    workload = Workload(prompt_len=64 if args.quick else 256, gen_len=16 if args.quick else 128,
                        num_requests=24 if args.quick else 48, gen_len_range=0.95, seed=0)
    print(f"concurrency 16, {workload.num_requests} requests, mixed output lengths", flush=True)
    many = concurrency(model_bf16, workload, 256, bandwidth["gbps_median"])
    report = {
        "tokq_version": __version__, "benchmark": "engine", "model": MODEL, "device": "cpu", "threads": args.threads,
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "processor": platform.processor(), "bandwidth": {"start": bandwidth, "end": copy_bandwidth("cpu")},
        "quick": args.quick, "batch1_decode": one, "concurrency16_mixed": many,
        "seconds": time.perf_counter() - start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    targets = {**one["targets"], **many["targets"]}
    print("targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in targets.items()))
    print(f"wrote {args.out} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
