"""`tokq.bench`: serve one workload with each model (and mode) on tokq's engine; serving metrics per row.

Per model and mode (continuous batching; static batching with `static`): TTFT, TPOT, TBT p95, output and total
throughput, memory, KV waste, the kernels used, and the decode roofline (bytes a decode step must read / the
copy bandwidth measured in the same run) with the fraction achieved. `draft` adds a speculative-decoding row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from tokq import __version__
from tokq.progress import progress_display
from tokq.settings import BenchSettings, settings_from

console = Console(stderr=True)


@dataclass
class BenchResult:
    """One row per (model, mode); `to_json()` is the `tokq bench --json` record."""

    models: list[str]
    checkpoints: dict[str, Path]
    rows: list[dict]
    workload: object  # engine.workload.Workload
    runtime: object  # runtime.RuntimeInfo
    dtype: str  # the compute dtype used
    kv_dtype: str
    bandwidth: dict  # copy bandwidth measured before and after: {"start": ..., "end": ...}

    def to_json(self) -> dict:
        return {"tokq_version": __version__, "command": "bench", "variants": self.models,
                "checkpoints": {k: str(v) for k, v in self.checkpoints.items()}, "dtype": self.dtype,
                "kv_dtype": self.kv_dtype, "workload": self.workload.to_json(), "runtime": self.runtime.to_json(),
                "bandwidth": self.bandwidth, "rows": self.rows}


def bench(models: list[str | Path] | str | Path, *, threads: int | None = None, device: str = "auto",
          **workload) -> BenchResult:
    """Serve the workload (BenchSettings fields: prompt_len, gen_len, concurrency, num_prompts, arrival_rate,
    static, draft, ...) with each model: zoo names, checkpoint folders or tokq.toml variants."""
    from tokq.runtime import setup_runtime

    names = [str(m) for m in ([models] if isinstance(models, (str, Path)) else models)]
    s = settings_from(BenchSettings, workload, "tokq.bench")
    runtime = setup_runtime(threads, device, s.seed)
    return run_bench(names, s, runtime)


def bench_endpoint(base_url: str, **options) -> dict:
    """Benchmark an OpenAI-compatible server from the client side (vLLM's `bench serve`); options are
    tokq.remote.bench_serve.ServeBenchSettings fields. Returns vLLM's result dict."""
    from tokq.remote.bench_serve import ServeBenchSettings

    return run_bench_endpoint(settings_from(ServeBenchSettings, {"base_url": base_url, **options},
                                            "tokq.api.bench.bench_endpoint"))


def run_bench_endpoint(s) -> dict:
    """The client bench against an OpenAI-compatible server (`tokq bench --base-url`), with progress."""
    from tokq.remote.bench_serve import run_serve_bench
    from tokq.remote.urls import redact

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
               TimeElapsedColumn())
    with progress_display(*columns, console=console) as progress:
        task = progress.add_task(f"bench {redact(s.base_url)}", total=None)
        return run_serve_bench(s, lambda total: progress.update(task, total=total, advance=1))


def run_bench(variants: list[str], s: BenchSettings, runtime) -> BenchResult:
    from tokq.engine.checkpoint import load_model
    from tokq.engine.config import read_config
    from tokq.engine.kv_cache import parse_bytes
    from tokq.engine.roofline import copy_bandwidth
    from tokq.engine.workload import Workload, bench_model
    from tokq.errors import ConfigError
    from tokq.zoo import resolve_model

    if not variants:
        raise ConfigError("tokq bench: name at least one model")
    for flag, value in (("--prompt-len", s.prompt_len), ("--gen-len", s.gen_len), ("--concurrency", s.concurrency),
                        ("--max-num-batched-tokens", s.max_num_batched_tokens),
                        ("--num-speculative", s.num_speculative)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    if not 0 <= s.gen_len_range < 1:
        raise ConfigError(f"--gen-len-range {s.gen_len_range}: must be in [0, 1)")
    if s.arrival_rate <= 0:
        raise ConfigError(f"--arrival-rate {s.arrival_rate}: must be > 0 requests per second")
    if not (s.burstiness > 0 and math.isfinite(s.burstiness)):
        raise ConfigError(f"--burstiness {s.burstiness}: must be a positive number (1: Poisson arrivals)")
    workload = Workload(s.prompt_len, s.gen_len, s.num_prompts or s.concurrency, s.gen_len_range, s.arrival_rate,
                        s.seed, s.burstiness)
    checkpoints = {v: resolve_model(v) for v in variants}
    configs = {v: read_config(c) for v, c in checkpoints.items()}
    vocab = {c.vocab_size for c in configs.values()}
    for name, config in configs.items():
        if s.prompt_len + s.gen_len > config.max_position_embeddings:
            raise ConfigError(f"--prompt-len {s.prompt_len} + --gen-len {s.gen_len} exceed {name}'s context of "
                              f"{config.max_position_embeddings} tokens")
    if len(vocab) > 1:
        raise ConfigError(f"the variants have different vocabularies ({sorted(vocab)}): compare variants of one "
                          "model")
    from tokq.dtypes import compute_dtype_name

    compute = compute_dtype_name(s.dtype, runtime.device)
    doc_tokens = _document_tokens(Path(s.data), checkpoints[variants[0]]) if s.data else None
    prompts = workload.prompts(vocab.pop(), doc_tokens)
    engine_kwargs = dict(kv_dtype=s.kv_dtype, max_num_seqs=s.concurrency,
                         max_num_batched_tokens=s.max_num_batched_tokens,
                         kv_memory=parse_bytes(s.kv_memory) if s.kv_memory else None)
    bandwidth = copy_bandwidth(runtime.device)
    modes = ["continuous"] + (["static"] if s.static else [])
    rows: list[dict] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
               TimeElapsedColumn())
    with progress_display(*columns, console=console, transient=True) as progress:
        for name in variants:
            model = load_model(checkpoints[name], dtype=compute, device=runtime.device)
            rows += bench_model(name, model, workload, modes, engine_kwargs, bandwidth["gbps_median"], prompts,
                                progress)
            if s.draft and name == variants[0]:
                baseline = next(r for r in rows if r["variant"] == name and r["mode"] == "continuous")
                rows.append(_speculative_row(name, model, s.draft, compute, runtime.device, workload, prompts,
                                             engine_kwargs, s.num_speculative, baseline["metrics"]["tpot_mean_s"]))
            del model
    bandwidth_end = copy_bandwidth(runtime.device)
    return BenchResult(variants, checkpoints, rows, workload, runtime, compute, s.kv_dtype,
                       {"start": bandwidth, "end": bandwidth_end})


def _document_tokens(folder: Path, checkpoint: Path) -> list[list[int]]:
    from tokq.engine.tokenizer import load_tokenizer
    from tokq.longctx.documents import load_documents

    tokenizer = load_tokenizer(checkpoint)
    docs = load_documents(folder)
    return [tokenizer(d.text, add_special_tokens=False)["input_ids"] for d in docs.documents]


def _speculative_row(name, model, draft, compute, device, workload, prompts, engine_kwargs, k,
                     baseline_tpot_s: float) -> dict:
    """Speculative decoding of the first model with the draft (all requests at once, batched); the net speedup
    is against the same model's continuous-batching TPOT, with a warning when it is below 1."""
    from tokq.engine.checkpoint import load_model
    from tokq.engine.llm_engine import EngineConfig, LLMEngine
    from tokq.engine.sampling import SamplingParams
    from tokq.engine.speculative import SpeculativeDecoder
    from tokq.zoo import resolve_model

    max_len = workload.prompt_len + max(workload.output_lengths()) + k + 1
    draft_model = load_model(resolve_model(draft), dtype=compute, device=device)
    target = LLMEngine(model, EngineConfig(max_model_len=max_len, **engine_kwargs))
    drafter = LLMEngine(draft_model, EngineConfig(max_model_len=max_len, **engine_kwargs))
    for engine in (target, drafter):  # compile the draft's decode graphs before the timed run, as the baseline's were
        engine.warm_up()
    decoder = SpeculativeDecoder(target, drafter, k)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in workload.output_lengths()]
    decoder.generate(prompts, params)
    metrics = decoder.metrics()
    speedup = decoder.warn_if_slower(baseline_tpot_s)
    return {"variant": f"{name} + draft {draft}", "mode": f"speculative k={k}", "metrics": metrics.to_json(),
            "wall_s": decoder.stats.wall_s, "kernels": target.kernel_names, "roofline": None,
            "roofline_fraction": None, "speculative": {**decoder.stats.to_json(), "net_speedup": speedup},
            "model_bytes": 0, "kv_cache_bytes": target.kv_cache_bytes + drafter.kv_cache_bytes}
