"""`tokq bench A [B ...]`: serve one workload with each variant on tokq's engine; one table of serving metrics.
`tokq bench --base-url URL`: the same kind of workload sent to any OpenAI-compatible server (vLLM's `bench serve`).

The work is `tokq.api.bench` (also `tokq.bench(...)` from Python) and `tokq.remote.bench_serve`; this module
parses the options and prints the table. The options also answer to vLLM's names (--random-input-len, ...).
"""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


def bench_cmd(
    variants: list[str] = typer.Argument(None, help="Checkpoint directories, zoo names or tokq.toml variants "
                                                    "(none with --base-url)."),
    prompt_len: int = typer.Option(512, "--prompt-len", "--random-input-len", help="Prompt tokens per request."),
    gen_len: int = typer.Option(256, "--gen-len", "--random-output-len",
                                help="Output tokens per request (the mean with --gen-len-range)."),
    gen_len_range: float = typer.Option(0.0, "--gen-len-range",
                                        help="Mixed output lengths: uniform in gen-len x [1 - r, 1 + r] (0: fixed)."),
    concurrency: int = typer.Option(None, "--concurrency", "--max-concurrency",
                                    help="Requests served at once (the engine's max_num_seqs; default 16). With "
                                         "--base-url: requests in flight (default: no limit)."),
    num_prompts: int = typer.Option(None, "--num-prompts", help="Requests in the workload (default: --concurrency, "
                                                                "or 16 without one)."),
    static: bool = typer.Option(False, "--static", help="Also run static batching for comparison (a fixed batch runs "
                                                        "until its longest member finishes; finished members keep "
                                                        "computing as padding)."),
    arrival_rate: float = typer.Option(math.inf, "--arrival-rate", "--request-rate",
                                       help="Poisson arrivals, requests per second (default: all at once)."),
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
    base_url: str = typer.Option(None, "--base-url", help="Benchmark this OpenAI-compatible server (e.g. "
                                                          "http://127.0.0.1:8000) from the client side instead."),
    endpoint: str = typer.Option("/v1/completions", "--endpoint", help="With --base-url: /v1/completions or "
                                                                       "/v1/chat/completions."),
    model: str = typer.Option(None, "--model", help="With --base-url: the served model's name (default: the "
                                                    "first id of GET /v1/models)."),
    tokenizer: str = typer.Option(None, "--tokenizer", help="With --base-url: checkpoint folder, zoo name or "
                                                            "variant whose tokenizer builds and counts the tokens "
                                                            "(default: --model when it is one)."),
    dataset_name: str = typer.Option(None, "--dataset-name", help="With --base-url: random or docs (prompts cut "
                                                                  "from --data; the default when --data is given)."),
    random_range_ratio: float = typer.Option(0.0, "--random-range-ratio",
                                             help="With --base-url: prompt and output lengths uniform in "
                                                  "len x [1 - r, 1 + r]."),
    percentile_metrics: str = typer.Option("ttft,tpot,itl", "--percentile-metrics",
                                           help="With --base-url: metrics to report percentiles of "
                                                "(ttft,tpot,itl,e2el)."),
    metric_percentiles: str = typer.Option("99", "--metric-percentiles",
                                           help="With --base-url: percentiles to report, e.g. 50,90,99."),
    save_result: bool = typer.Option(False, "--save-result", help="With --base-url: write the result JSON "
                                                                  "(vLLM's file name unless --result-filename)."),
    result_filename: Path = typer.Option(None, "--result-filename", help="With --base-url: the JSON's path."),
    result_dir: Path = typer.Option(None, "--result-dir", help="With --save-result: the folder of the JSON (vLLM's "
                                                               "option; default: the working directory)."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape of the gaps between arrivals with "
                                                               "--request-rate: 1 Poisson, < 1 burstier, > 1 "
                                                               "steadier (vLLM's)."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos",
                                    help="Generate every requested token even past an end-of-sequence token. "
                                         "tokq's own engine always does (every variant makes the same tokens); "
                                         "--no-ignore-eos applies to --base-url."),
    timeout: float = typer.Option(600.0, "--timeout", help="With --base-url: seconds one request may take, "
                                                           "retries included."),
) -> None:
    """Serve one workload with each variant (and mode) on tokq's engine and print one table; with --base-url,
    send it to an OpenAI-compatible server and print vLLM's summary."""
    if base_url is not None:
        from tokq.remote.bench_serve import ServeBenchSettings

        if variants:
            from tokq.errors import ConfigError

            raise ConfigError(f"tokq bench --base-url measures the server, not {', '.join(variants)}: drop the "
                              "model arguments (name the served model with --model)")
        settings = ServeBenchSettings(
            base_url, endpoint=endpoint, model=model, tokenizer=tokenizer, burstiness=burstiness,
            ignore_eos=ignore_eos,
            dataset_name=dataset_name or ("docs" if documents else "random"), data=documents,
            num_prompts=num_prompts or concurrency or 16, random_input_len=prompt_len, random_output_len=gen_len,
            random_range_ratio=random_range_ratio, max_concurrency=concurrency, request_rate=arrival_rate,
            percentile_metrics=percentile_metrics, metric_percentiles=metric_percentiles, seed=seed,
            timeout_s=timeout)
        _bench_endpoint(settings, json_path, save_result, result_filename, result_dir)
        return
    if not ignore_eos:
        from tokq.errors import ConfigError

        raise ConfigError("--no-ignore-eos: tokq's in-process bench always generates every requested token, so "
                          "that every variant makes the same number; it applies to --base-url runs")
    concurrency = concurrency or 16
    from tokq.api.bench import run_bench
    from tokq.reports.json_io import check_json_target, write_json
    from tokq.runtime import setup_runtime
    from tokq.settings import BenchSettings

    check_json_target(json_path)  # refused before the benchmark, not after
    runtime = setup_runtime(threads, device, seed)
    settings = BenchSettings(prompt_len=prompt_len, gen_len=gen_len, gen_len_range=gen_len_range,
                             concurrency=concurrency, num_prompts=num_prompts, arrival_rate=arrival_rate,
                             burstiness=burstiness, static=static, draft=draft, num_speculative=num_speculative,
                             dtype=dtype,
                             kv_dtype=kv_dtype, kv_memory=kv_memory, max_num_batched_tokens=max_num_batched_tokens,
                             data=documents, seed=seed)
    result = run_bench(variants, settings, runtime)
    _print_table(result.rows, result.workload, runtime, result.dtype, result.bandwidth["start"])
    if json_path:
        write_json(json_path, result.to_json())


def _bench_endpoint(settings, json_path: Path | None, save_result: bool, result_filename: Path | None,
                    result_dir: Path | None = None) -> None:
    from tokq.api.bench import run_bench_endpoint
    from tokq.remote.bench_serve import (
        default_result_filename,
        format_result,
        parse_metric_percentiles,
        parse_percentile_metrics,
    )
    from tokq.reports.json_io import check_json_target, write_json

    check_json_target(json_path)
    check_json_target(result_filename, "--result-filename")
    result = run_bench_endpoint(settings)
    print(format_result(result, parse_percentile_metrics(settings.percentile_metrics),
                        parse_metric_percentiles(settings.metric_percentiles)))
    if save_result or result_filename:
        target = result_filename or Path(default_result_filename(result))
        if result_dir is not None and not target.is_absolute():
            result_dir.mkdir(parents=True, exist_ok=True)
            target = result_dir / target
        write_json(target, result, "--result-filename")
    if json_path:
        write_json(json_path, result)


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
        kernels = ", ".join(r["kernels"]["linear"] + r["kernels"]["attention"] + r["kernels"].get("decode", []))
        spec = r.get("speculative")
        mode = r["mode"] + (f" (accept {spec['acceptance_rate']:.0%}, x{spec['net_speedup']:.2f})" if spec else "")
        table.add_row(r["variant"], mode, _ms(m["ttft_mean_s"]), _ms(m["tpot_mean_s"]), _ms(m["tbt_p95_s"]),
                      f"{m['output_tokens_per_s']:.1f}", f"{m['total_tokens_per_s']:.1f}", memory,
                      f"{m['kv_waste']:.1%}", roof, kernels)
    out = Console()
    if not out.is_terminal:  # logs and CI: wide enough that no column is cut
        out = Console(width=220)
    out.print(table)
