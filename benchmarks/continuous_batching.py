"""Continuous vs static batching on SmolLM2-135M (RTN int4 g64, bf16 activations) on this CPU, with and
without the prefill cap of mixed steps (EngineConfig.max_prefill_tokens_with_decode), all in one run.

    python benchmarks/continuous_batching.py [--threads 1] [--repeats 3] [--concurrency 4 16]
        [--workloads fixed mixed poisson] [--kernels] [--weights int4|bf16] [--out PATH]

Workloads at each concurrency c (max_num_seqs = c, 2 x c requests, prompt 256 random tokens, output 64,
the engine's default step budget of 2048 tokens; outputs forced to their length):
- fixed: every output 64 tokens, all requests at once. Static batching loses nothing structural here
  (no member finishes early); continuous / static is bounded by static steps / continuous steps (a step's
  cost barely grows with its batch on this CPU), and both numbers are reported.
- mixed: output lengths uniform in [0.1, 1.9] x 64, all at once: a static batch runs until its longest
  member finishes, the finished ones computed as padding; continuous batching refills their seats.
- poisson: the mixed lengths arriving as a Poisson process (--rate requests/s; default about what
  continuous batching serves at c): static batching also waits for a batch to drain before admitting.
Modes, interleaved within each repeat: continuous (cap 256), continuous_nocap (cap None, the default), static.
Reported per workload: output tokens/s, continuous / static and cap / no-cap ratios per repeat, TBT p95 /
TPOT (mean of per-request TPOT), step counts. Medians with min/max over repeats.

--kernels adds the decode step time of the two CPU attention kernels at batch 1 and 16 (prompt 256,
decode-only steps, with the time inside attention): `cpu_paged_sdpa` and `cpu_paged_batched`.

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
from tokq.engine.workload import Workload, run_workload, warm_up
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


MODES = {"continuous": dict(static=False, max_prefill_tokens_with_decode=256),
         "continuous_nocap": dict(static=False, max_prefill_tokens_with_decode=None),
         "static": dict(static=True)}
PROMPT, GEN = 256, 64
KEYS = ("wall_s", "output_tokens", "output_tokens_per_s", "tpot_mean_s", "tbt_p50_s", "tbt_p95_s", "tbt_p99_s",
        "ttft_mean_s", "steps")


def workload_of(name: str, c: int, rate: float | None) -> Workload:
    if name == "fixed":
        return Workload(prompt_len=PROMPT, gen_len=GEN, num_requests=2 * c, seed=0)
    if name == "mixed":
        return Workload(prompt_len=PROMPT, gen_len=GEN, num_requests=2 * c, gen_len_range=0.9, seed=0)
    return Workload(prompt_len=PROMPT, gen_len=GEN, num_requests=2 * c, gen_len_range=0.9, seed=0,
                    arrival_rate=rate or c / 8.0)


def serve(model, workload: Workload, c: int, mode: str, prompts: list[list[int]]) -> dict:
    max_len = workload.prompt_len + max(workload.output_lengths())
    engine = LLMEngine(model, EngineConfig(max_model_len=max_len, max_num_seqs=c, **MODES[mode]))
    warm_up(engine, prompts[0])
    metrics = run_workload(engine, workload, prompts).to_json()
    return {k: metrics[k] for k in KEYS}


def ratios(a: list[dict], b: list[dict], key: str, invert: bool = False) -> dict:
    return summary([(y[key] / x[key]) if invert else (x[key] / y[key]) for x, y in zip(a, b, strict=True)])


def kernel_steps(model, repeats: int) -> dict:
    steps: dict[str, list[dict]] = {}
    for rep in range(repeats):
        for batch in (1, 16):
            for kernel in KERNELS:
                row = decode_step(model, batch, kernel)
                steps.setdefault(f"{kernel}_batch{batch}", []).append(row)
                print(f"[{rep}] batch {batch} {kernel}: step {row['step_ms']:.1f} ms, attention "
                      f"{row['attention_ms']:.1f} ms", flush=True)
    out = {name: {"step_ms": summary([r["step_ms"] for r in rows]),
                  "attention_ms": summary([r["attention_ms"] for r in rows])} for name, rows in steps.items()}
    for batch in (1, 16):
        out[f"sdpa_over_batched_batch{batch}"] = ratios(steps[f"cpu_paged_sdpa_batch{batch}"],
                                                        steps[f"cpu_paged_batched_batch{batch}"], "step_ms")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", choices=["int4", "bf16"], default="int4")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--workloads", nargs="+", choices=["fixed", "mixed", "poisson"],
                        default=["fixed", "mixed", "poisson"])
    parser.add_argument("--rate", type=float, default=None, help="poisson arrivals/s (default: concurrency / 8)")
    parser.add_argument("--kernels", action="store_true", help="also time the two CPU attention kernels")
    parser.add_argument("--out", type=Path, default=RESULTS / "continuous_batching.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(MODEL), dtype="bf16")
    if args.weights == "int4":
        from tokq.quantization.pipeline import quantize_model
        from tokq.quantization.scheme import preset
        quantize_model(model, "rtn", preset("w4a16").with_weights(group_size=64))

    runs: dict[str, dict[str, list[dict]]] = {}
    loads = []
    for rep in range(args.repeats):
        before = load()
        for c in args.concurrency:
            for name in args.workloads:
                workload = workload_of(name, c, args.rate)
                prompts = workload.prompts(model.config.vocab_size)
                for mode in MODES:
                    row = serve(model, workload, c, mode, prompts)
                    runs.setdefault(f"{name}_c{c}", {m: [] for m in MODES})[mode].append(row)
                    print(f"[{rep}] {name} c{c} {mode}: {row['output_tokens_per_s']:.1f} tok/s, {row['steps']} steps, "
                          f"TBT p95 {row['tbt_p95_s'] * 1e3:.0f} ms, TPOT {row['tpot_mean_s'] * 1e3:.0f} ms, "
                          f"load {os.getloadavg()[0]:.2f}", flush=True)
        loads.append({"repeat": rep, "before": before, "after": load()})

    serving = {}
    for key, modes in runs.items():
        cont, nocap, stat = modes["continuous"], modes["continuous_nocap"], modes["static"]
        serving[key] = {
            "workload": workload_of(key.split("_")[0], int(key.split("_c")[1]), args.rate).to_json(),
            "runs": modes,
            "output_tokens_per_s": {m: summary([r["output_tokens_per_s"] for r in rows]) for m, rows in modes.items()},
            "continuous_over_static": ratios(cont, stat, "output_tokens_per_s"),
            "continuous_nocap_over_static": ratios(nocap, stat, "output_tokens_per_s"),
            "cap_over_nocap": ratios(cont, nocap, "output_tokens_per_s"),
            # the bound on continuous / static if a step cost the same whatever its batch
            "static_steps_over_continuous_steps": ratios(cont, stat, "steps", invert=True),
            "static_steps_over_continuous_nocap_steps": ratios(nocap, stat, "steps", invert=True),
            "tbt_p95_over_tpot": {m: summary([r["tbt_p95_s"] / r["tpot_mean_s"] for r in rows])
                                  for m, rows in modes.items()},
        }
    targets = {}
    for name in args.workloads:
        row = serving.get(f"{name}_c16")
        if row:
            targets[f"{name}: continuous >= 2x static at concurrency 16"] = row["continuous_over_static"]["median"] >= 2
            targets[f"{name}: TBT p95 <= 2x TPOT at concurrency 16 (continuous, cap)"] = \
                row["tbt_p95_over_tpot"]["continuous"]["median"] <= 2
    result = {
        "benchmark": "continuous_batching", "model": MODEL, "weights": args.weights, "threads": args.threads,
        "repeats": args.repeats, "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "load_average": loads,
        "engine": {"max_num_batched_tokens": EngineConfig.max_num_batched_tokens,
                   "max_prefill_tokens_with_decode": EngineConfig.max_prefill_tokens_with_decode,
                   "max_num_seqs": "concurrency", "modes": {m: {k: v for k, v in cfg.items()} for m, cfg in MODES.items()}},
        "serving": serving, "targets": targets,
        "decode_step": kernel_steps(model, args.repeats) if args.kernels else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: {m: v[m] for m in ("continuous_over_static", "static_steps_over_continuous_steps",
                                           "cap_over_nocap", "tbt_p95_over_tpot")} for k, v in serving.items()},
                     indent=1))
    print(json.dumps(targets, indent=1))


if __name__ == "__main__":
    main()
