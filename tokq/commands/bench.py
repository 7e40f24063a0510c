"""`tokq bench A [B ...]`: serve one workload with each variant on tokq's engine; one table of serving metrics.

The work is `tokq.api.bench` (also `tokq.bench(...)` from Python); this module parses the options and prints
the table.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


def bench_cmd(
    variants: list[str] = typer.Argument(..., help="Checkpoint directories, zoo names or tokq.toml variants."),
    prompt_len: int = typer.Option(512, "--prompt-len", help="Prompt tokens per request."),
    gen_len: int = typer.Option(256, "--gen-len", help="Output tokens per request (the mean with --gen-len-range)."),
    gen_len_range: float = typer.Option(0.0, "--gen-len-range",
                                        help="Mixed output lengths: uniform in gen-len x [1 - r, 1 + r] (0: fixed)."),
    concurrency: int = typer.Option(16, "--concurrency", help="Requests served at once (the engine's max_num_seqs)."),
    num_prompts: int = typer.Option(None, "--num-prompts", help="Requests in the workload (default: --concurrency)."),
    static: bool = typer.Option(False, "--static", help="Also run static batching for comparison (a fixed batch runs "
                                                        "until its longest member finishes; finished members keep "
                                                        "computing as padding)."),
    arrival_rate: float = typer.Option(math.inf, "--arrival-rate", help="Poisson arrivals, requests per second "
                                                                       "(default: all at once)."),
    draft: str = typer.Option(None, "--draft", help="A draft model for speculative decoding (adds a 'speculative' row)."),
    num_speculative: int = typer.Option(4, "--num-speculative", help="Tokens the draft proposes per step."),
    dtype: str = typer.Option("auto", "--dtype", help="Compute dtype: auto (bf16 on CPU, fp16 on CUDA), fp32, bf16, fp16."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="KV cache dtype: auto (the compute dtype), fp16, bf16, fp32, fp8."),
    kv_memory: str = typer.Option(None, "--kv-memory", help="KV cache budget, e.g. 2GiB (default: what the workload "
                                                            "needs, within 80% of the device's memory)."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", help="Token budget of one step."),
    documents: Path = typer.Option(None, "--data", help="Take prompts from these documents instead of random tokens."),
    json_path: Path = typer.Option(None, "--json", help="Write every number as JSON to this path."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompts, output lengths and arrivals."),
) -> None:
    """Serve one workload with each variant (and mode) on tokq's engine and print one table."""
    from tokq.api.bench import run_bench
    from tokq.reports.json_io import check_json_target, write_json
    from tokq.runtime import setup_runtime
    from tokq.settings import BenchSettings

    check_json_target(json_path)  # refused before the benchmark, not after
    runtime = setup_runtime(threads, device, seed)
    settings = BenchSettings(prompt_len=prompt_len, gen_len=gen_len, gen_len_range=gen_len_range,
                             concurrency=concurrency, num_prompts=num_prompts, arrival_rate=arrival_rate,
                             static=static, draft=draft, num_speculative=num_speculative, dtype=dtype,
                             kv_dtype=kv_dtype, kv_memory=kv_memory, max_num_batched_tokens=max_num_batched_tokens,
                             data=documents, seed=seed)
    result = run_bench(variants, settings, runtime)
    _print_table(result.rows, result.workload, runtime, result.dtype, result.bandwidth["start"])
    if json_path:
        write_json(json_path, result.to_json())


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.1f}"


def _print_table(rows: list[dict], workload, runtime, compute: str, bandwidth: dict) -> None:
    from tokq.engine.kv_cache import format_bytes

    arrivals = "all at once" if math.isinf(workload.arrival_rate) else f"Poisson {workload.arrival_rate}/s"
    lengths = f"{workload.gen_len}" + (f" ±{workload.gen_len_range:.0%}" if workload.gen_len_range else "")
    table = Table(title=f"tokq bench: {workload.num_requests} requests, {workload.prompt_len} in / {lengths} out, "
                        f"{arrivals}; {compute} on {runtime.device}, {runtime.threads} threads; copy bandwidth "
                        f"{bandwidth['gbps_median']:.1f} GB/s")
    for col in ("variant", "mode", "TTFT ms", "TPOT ms", "TBT p95 ms", "out tok/s", "total tok/s", "weights+KV",
                "KV waste", "decode roofline", "kernels"):
        table.add_column(col, justify="left" if col in ("variant", "mode", "kernels") else "right")
    for r in rows:
        m = r["metrics"]
        roof = "-" if not r.get("roofline") else \
            f"{r['roofline']['roofline_step_s'] * 1e3:.1f} ms ({r['roofline_fraction']:.0%})"
        memory = format_bytes(r.get("model_bytes", 0) + r["kv_cache_bytes"])
        kernels = ", ".join(r["kernels"]["linear"] + r["kernels"]["attention"])
        spec = r.get("speculative")
        mode = r["mode"] + (f" (accept {spec['acceptance_rate']:.0%}, x{spec['net_speedup']:.2f})" if spec else "")
        table.add_row(r["variant"], mode, _ms(m["ttft_mean_s"]), _ms(m["tpot_mean_s"]), _ms(m["tbt_p95_s"]),
                      f"{m['output_tokens_per_s']:.1f}", f"{m['total_tokens_per_s']:.1f}", memory,
                      f"{m['kv_waste']:.1%}", roof, kernels)
    out = Console()
    if not out.is_terminal:  # logs and CI: wide enough that no column is cut
        out = Console(width=220)
    out.print(table)
