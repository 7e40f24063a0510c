"""`tokq bench A [B ...]`: serve one workload with each variant on tokq's engine; one table of serving metrics.

Per variant and mode (continuous batching; static batching with --static): TTFT, TPOT, TBT p95,
output and total throughput, memory, KV waste, the kernels used, and the decode roofline (bytes a
decode step must read / the copy bandwidth measured in the same run) with the fraction achieved.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tokq import __version__

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
    from tokq.engine.checkpoint import load_model
    from tokq.engine.config import read_config
    from tokq.engine.kv_cache import parse_bytes
    from tokq.engine.roofline import copy_bandwidth
    from tokq.engine.workload import Workload, bench_model
    from tokq.errors import ConfigError
    from tokq.reports.json_io import check_json_target, write_json
    from tokq.runtime import setup_runtime
    from tokq.zoo import resolve_model

    check_json_target(json_path)  # refused before the benchmark, not after
    runtime = setup_runtime(threads, device, seed)
    for flag, value in (("--prompt-len", prompt_len), ("--gen-len", gen_len), ("--concurrency", concurrency),
                        ("--max-num-batched-tokens", max_num_batched_tokens), ("--num-speculative", num_speculative)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    if not 0 <= gen_len_range < 1:
        raise ConfigError(f"--gen-len-range {gen_len_range}: must be in [0, 1)")
    if arrival_rate <= 0:
        raise ConfigError(f"--arrival-rate {arrival_rate}: must be > 0 requests per second")
    workload = Workload(prompt_len, gen_len, num_prompts or concurrency, gen_len_range, arrival_rate, seed)
    checkpoints = {v: resolve_model(v) for v in variants}
    configs = {v: read_config(c) for v, c in checkpoints.items()}
    vocab = {c.vocab_size for c in configs.values()}
    for name, config in configs.items():
        if prompt_len + gen_len > config.max_position_embeddings:
            raise ConfigError(f"--prompt-len {prompt_len} + --gen-len {gen_len} exceed {name}'s context of "
                              f"{config.max_position_embeddings} tokens")
    if len(vocab) > 1:
        raise ConfigError(f"the variants have different vocabularies ({sorted(vocab)}): compare variants of one model")
    compute = dtype if dtype != "auto" else ("fp16" if runtime.device.startswith("cuda") else "bf16")
    doc_tokens = _document_tokens(documents, checkpoints[variants[0]]) if documents else None
    prompts = workload.prompts(vocab.pop(), doc_tokens)
    engine_kwargs = dict(kv_dtype=kv_dtype, max_num_seqs=concurrency, max_num_batched_tokens=max_num_batched_tokens,
                         kv_memory=parse_bytes(kv_memory) if kv_memory else None)
    bandwidth = copy_bandwidth(runtime.device)
    modes = ["continuous"] + (["static"] if static else [])
    rows: list[dict] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        for name in variants:
            model = load_model(checkpoints[name], dtype=compute, device=runtime.device)
            rows += bench_model(name, model, workload, modes, engine_kwargs, bandwidth["gbps_median"], prompts,
                                progress)
            if draft and name == variants[0]:
                baseline = next(r for r in rows if r["variant"] == name and r["mode"] == "continuous")
                rows.append(_speculative_row(name, model, draft, compute, runtime.device, workload, prompts,
                                             engine_kwargs, num_speculative, baseline["metrics"]["tpot_mean_s"]))
            del model
    bandwidth_end = copy_bandwidth(runtime.device)
    _print_table(rows, workload, runtime, compute, bandwidth)
    if json_path:
        write_json(json_path, {
            "tokq_version": __version__, "command": "bench", "variants": variants,
            "checkpoints": {k: str(v) for k, v in checkpoints.items()}, "dtype": compute, "kv_dtype": kv_dtype,
            "workload": workload.to_json(), "runtime": runtime.to_json(),
            "bandwidth": {"start": bandwidth, "end": bandwidth_end}, "rows": rows,
        })


def _document_tokens(folder: Path, checkpoint: Path) -> list[list[int]]:
    from tokq.engine.tokenizer import load_tokenizer
    from tokq.longctx.documents import load_documents

    tokenizer = load_tokenizer(checkpoint)
    docs = load_documents(folder)
    return [tokenizer(d.text, add_special_tokens=False)["input_ids"] for d in docs.documents]


def _speculative_row(name, model, draft, compute, device, workload, prompts, engine_kwargs, k,
                     baseline_tpot_s: float) -> dict:
    """Speculative decoding of the first variant with the draft (all requests at once, batched); the net
    speedup is against the same variant's continuous-batching TPOT, with a warning when it is below 1."""
    from tokq.engine.checkpoint import load_model
    from tokq.engine.llm_engine import EngineConfig, LLMEngine
    from tokq.engine.sampling import SamplingParams
    from tokq.engine.speculative import SpeculativeDecoder
    from tokq.zoo import resolve_model

    max_len = workload.prompt_len + max(workload.output_lengths()) + k + 1
    draft_model = load_model(resolve_model(draft), dtype=compute, device=device)
    target = LLMEngine(model, EngineConfig(max_model_len=max_len, **engine_kwargs))
    drafter = LLMEngine(draft_model, EngineConfig(max_model_len=max_len, **engine_kwargs))
    decoder = SpeculativeDecoder(target, drafter, k)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in workload.output_lengths()]
    decoder.generate(prompts, params)
    metrics = decoder.metrics()
    speedup = decoder.warn_if_slower(baseline_tpot_s)
    return {"variant": f"{name} + draft {draft}", "mode": f"speculative k={k}", "metrics": metrics.to_json(),
            "wall_s": decoder.stats.wall_s, "kernels": target.kernel_names, "roofline": None,
            "roofline_fraction": None, "speculative": {**decoder.stats.to_json(), "net_speedup": speedup},
            "model_bytes": 0, "kv_cache_bytes": target.kv_cache_bytes + drafter.kv_cache_bytes}


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
