"""tokq's full-sequence forward vs HF transformers' forward on a real model, same run, same threads.

    python benchmarks/forward.py [--model smollm2-135m] [--seqs 512 2048] [--repeats 5] [--threads 2]

Runs are interleaved (tokq, HF, tokq, HF, ...) so machine noise hits both alike; the result is
quoted as medians with min/max, and as the median of paired ratios (HF time / tokq time of
back-to-back runs, order alternating), which cancels slow drifts in load on a shared machine. The roofline is this machine's own dense
fp32 GEMM rate measured in the same run: the forward at these lengths is compute bound, so
achieved FLOP/s divided by that rate is the fraction of the hardware tokq reaches.
Writes benchmarks/results/forward-<model>-<device>.json.
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
from tokq.zoo import resolve_model

RESULTS = Path(__file__).parent / "results"


def forward_flops(config, seq: int) -> float:
    """Multiply-adds x2 of one forward over `seq` tokens: linears, attention (causal half), LM head."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    per_token_linear = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    linear = 2 * seq * (config.num_layers * per_token_linear + h * config.vocab_size)
    attention = config.num_layers * 2 * 2 * config.num_heads * config.head_dim * seq * seq / 2
    return linear + attention


def measure_gemm_peak(size: int = 2048, repeats: int = 10) -> float:
    """Best fp32 GEMM rate seen on this machine (FLOP/s): the practical compute roofline."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * size**3 / min(times)


def time_call(fn, ids) -> float:
    t = time.perf_counter()
    with torch.inference_mode():
        fn(ids)
    return time.perf_counter() - t


def summary(times: list[float], seq: int) -> dict:
    tps = [seq / t for t in times]
    return {"tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
            "seconds": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    checkpoint = resolve_model(args.model)
    ours = load_model(checkpoint, dtype="fp32")
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, local_files_only=True).eval()
    peaks = [measure_gemm_peak()]
    # Both return full logits: HF's forward computes them, so tokq's must too for a fair race.
    runners = {"tokq": lambda ids: ours.logits(ids), "hf": lambda ids: hf(ids, use_cache=False).logits}

    results = []
    for seq in args.seqs:
        ids = torch.randint(0, ours.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
        for fn in runners.values():
            time_call(fn, ids)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in runners}
        for rep in range(args.repeats):
            # Back-to-back pairs, order alternating, so drifts in machine load cancel in the paired ratio.
            order = list(runners) if rep % 2 == 0 else list(reversed(runners))
            for name in order:
                times[name].append(time_call(runners[name], ids))
        paired = [h / t for t, h in zip(times["tokq"], times["hf"], strict=True)]
        row = {"seq": seq, "flops": forward_flops(ours.config, seq)}
        for name in runners:
            row[name] = summary(times[name], seq)
        row["speedup_tokq_over_hf"] = row["tokq"]["tokens_per_s_median"] / row["hf"]["tokens_per_s_median"]
        row["paired_speedup_median"] = statistics.median(paired)
        row["paired_speedup_min"], row["paired_speedup_max"] = min(paired), max(paired)
        results.append(row)
        peaks.append(measure_gemm_peak())  # measured between rows too: the machine is shared and noisy
    peak = max(peaks)
    for row in results:
        for name in runners:
            row[name]["roofline_fraction"] = row["flops"] / statistics.median(row[name]["seconds"]) / peak
    for row in results:
        print(f"seq {row['seq']:5d}: tokq {row['tokq']['tokens_per_s_median']:8.1f} tok/s "
              f"[{row['tokq']['tokens_per_s_min']:.1f}-{row['tokq']['tokens_per_s_max']:.1f}]  "
              f"hf {row['hf']['tokens_per_s_median']:8.1f} tok/s "
              f"[{row['hf']['tokens_per_s_min']:.1f}-{row['hf']['tokens_per_s_max']:.1f}]  "
              f"ratio {row['speedup_tokq_over_hf']:.3f} (paired {row['paired_speedup_median']:.3f} "
              f"[{row['paired_speedup_min']:.3f}-{row['paired_speedup_max']:.3f}])  roofline tokq {row['tokq']['roofline_fraction']:.2f} "
              f"hf {row['hf']['roofline_fraction']:.2f}")

    import transformers

    payload = {
        "benchmark": "forward",
        "tokq_version": __version__,
        "model": args.model,
        "dtype": "fp32",
        "device": "cpu",
        "threads": args.threads,
        "repeats": args.repeats,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gemm_peak_flops": peak,
        "gemm_peak_samples": peaks,
        "attention_backend": "dense-sdpa",
        "results": results,
    }
    out = args.out or RESULTS / f"forward-{args.model}-cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
