"""Continuous vs static batching on SmolLM2-135M (RTN int4 g64, bf16 activations) on this CPU, and the decode
step time of the two CPU attention kernels, all in one run.

    python benchmarks/continuous_batching.py [--threads 2] [--repeats 3] [--weights int4|bf16] [--out PATH]

1. Decode step time at batch 1 and 16 (prompt 256, decode-only steps after a warm-up, median per repeat)
   with attention kernel `cpu_paged_sdpa` (the old one) and `cpu_paged_batched` (the new one, selected by name),
   interleaved per repeat; also the milliseconds per step spent inside the attention calls.
2. Workloads at concurrency 1, 4, 16 (3 x concurrency requests, prompt 256, output 64 +-95%, all at
   once, a 256-token step budget): continuous and static batching, interleaved per repeat. Reports output
   tokens/s, the continuous / static ratio per repeat, TBT p95 / TPOT, and each mode's step count: with
   static batching the finished members of a batch keep running as padding, so static / continuous steps
   is the ratio a step cost independent of batch size would give.

The machine is shared: the load average is recorded before and after every repeat; ratios measured within
one repeat are what counts. Writes benchmarks/results/continuous_batching.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from tokq.engine.checkpoint import load_model
from tokq.engine.llm_engine import EngineConfig, LLMEngine
from tokq.engine.sampling import SamplingParams
from tokq.engine.workload import Workload, run_workload
from tokq.zoo import resolve_model

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m"
KERNELS = ("cpu_paged_sdpa", "cpu_paged_batched")


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def load() -> list[float]:
    return list(os.getloadavg())


def decode_step(model, batch: int, kernel: str, prompt_len: int = 256, new_tokens: int = 24) -> dict:
    """Median wall time of a decode-only step at `batch`, and the part of it inside attention calls."""
    engine = LLMEngine(model, EngineConfig(max_model_len=prompt_len + new_tokens, max_num_seqs=batch,
                                           attention_kernels=kernel))
    spent = [0.0]
    for prepared in engine.runner.kernels:
        attend = prepared.attend

        def timed(*args, _attend=attend, **kwargs):
            t = time.perf_counter()
            out = _attend(*args, **kwargs)
            spent[0] += time.perf_counter() - t
            return out
        prepared.attend = timed
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(1000, model.config.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    steps, attn = [], []
    while engine.has_unfinished():
        spent[0] = 0.0
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if max(engine.last_scheduled.num_tokens) == 1 and len(engine.last_scheduled.seqs) == batch:
            steps.append(dt)
            attn.append(spent[0])
    steps, attn = steps[3:], attn[3:]  # the first decode steps pay one-off costs
    return {"step_ms": statistics.median(steps) * 1e3, "attention_ms": statistics.median(attn) * 1e3,
            "steps": len(steps)}


def serve(model, workload: Workload, mode: str, prompts: list[list[int]]) -> dict:
    max_len = workload.prompt_len + max(workload.output_lengths())
    engine = LLMEngine(model, EngineConfig(static=mode == "static", max_model_len=max_len,
                                           max_num_seqs=workload.num_requests // 3, max_num_batched_tokens=256))
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))
    metrics = run_workload(engine, workload, prompts).to_json()
    return {k: metrics[k] for k in ("wall_s", "output_tokens", "output_tokens_per_s", "tpot_mean_s", "tbt_p50_s",
                                    "tbt_p95_s", "ttft_mean_s", "steps")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", choices=["int4", "bf16"], default="int4")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out", type=Path, default=RESULTS / "continuous_batching.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(MODEL), dtype="bf16")
    if args.weights == "int4":
        from tokq.quantization.pipeline import quantize_model
        from tokq.quantization.scheme import preset
        quantize_model(model, "rtn", preset("w4a16").with_weights(group_size=64))

    steps: dict[str, list[dict]] = {}
    runs: dict[str, dict[str, list[dict]]] = {str(c): {"continuous": [], "static": []} for c in args.concurrency}
    loads = []
    for rep in range(args.repeats):
        before = load()
        for batch in (1, 16):
            for kernel in KERNELS:
                row = decode_step(model, batch, kernel)
                steps.setdefault(f"{kernel}_batch{batch}", []).append(row)
                print(f"[{rep}] batch {batch} {kernel}: step {row['step_ms']:.1f} ms, attention "
                      f"{row['attention_ms']:.1f} ms", flush=True)
        for c in args.concurrency:
            workload = Workload(prompt_len=256, gen_len=64, num_requests=3 * c, gen_len_range=0.95, seed=0)
            prompts = workload.prompts(model.config.vocab_size)
            for mode in ("continuous", "static"):
                row = serve(model, workload, mode, prompts)
                runs[str(c)][mode].append(row)
                print(f"[{rep}] concurrency {c} {mode}: {row['output_tokens_per_s']:.1f} tok/s, {row['steps']} steps, "
                      f"TBT p95 {row['tbt_p95_s'] * 1e3:.0f} ms, TPOT {row['tpot_mean_s'] * 1e3:.0f} ms", flush=True)
        loads.append({"repeat": rep, "before": before, "after": load()})

    step_summary = {name: {"step_ms": summary([r["step_ms"] for r in rows]),
                           "attention_ms": summary([r["attention_ms"] for r in rows])} for name, rows in steps.items()}
    for batch in (1, 16):
        old, new = steps[f"cpu_paged_sdpa_batch{batch}"], steps[f"cpu_paged_batched_batch{batch}"]
        step_summary[f"old_over_new_batch{batch}"] = summary(
            [o["step_ms"] / n["step_ms"] for o, n in zip(old, new, strict=True)])
    for kernel in KERNELS:
        b1, b16 = steps[f"{kernel}_batch1"], steps[f"{kernel}_batch16"]
        step_summary[f"{kernel}_batch16_over_batch1"] = summary(
            [x["step_ms"] / y["step_ms"] for x, y in zip(b16, b1, strict=True)])
    serving = {}
    for c, modes in runs.items():
        cont, stat = modes["continuous"], modes["static"]
        serving[c] = {
            "runs": modes,
            "continuous_over_static": summary([a["output_tokens_per_s"] / b["output_tokens_per_s"]
                                               for a, b in zip(cont, stat, strict=True)]),
            "static_steps_over_continuous_steps": summary([b["steps"] / a["steps"] for a, b in zip(cont, stat,
                                                                                                strict=True)]),
            "continuous_tbt_p95_over_tpot": summary([a["tbt_p95_s"] / a["tpot_mean_s"] for a in cont]),
        }
    c16 = serving.get("16")
    result = {
        "benchmark": "continuous_batching", "model": MODEL, "weights": args.weights, "threads": args.threads,
        "repeats": args.repeats, "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "load_average": loads,
        "workload": {"prompt_len": 256, "gen_len": 64, "gen_len_range": 0.95, "requests": "3 x concurrency",
                     "max_num_batched_tokens": 256},
        "decode_step": step_summary, "serving": serving,
        "targets": None if c16 is None else {
            "continuous >= 2x static at concurrency 16": c16["continuous_over_static"]["median"] >= 2.0,
            "TBT p95 <= 2x TPOT at concurrency 16": c16["continuous_tbt_p95_over_tpot"]["median"] <= 2.0,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"decode_step": step_summary, "targets": result["targets"]}, indent=1))


if __name__ == "__main__":
    main()
