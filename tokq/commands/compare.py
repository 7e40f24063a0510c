"""`tokq compare A B --data DIR`: is B worse than A on these documents, where, and how sure are we."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tokq.errors import EXIT_CHECK_FAILED, EXIT_INCONCLUSIVE
from tokq.longctx.documents import (
    DEFAULT_MAX_DOC_MB,
    DEFAULT_MAX_FILE_MB,
    MAX_DOC_MB_HELP,
    MAX_FILE_MB_HELP,
    ReadLimits,
    read_limits,
)

console = Console(stderr=True)
BASE_NAMES = ("fp16", "bf16", "base")


def resolve_variant(name: str, other: str | None = None) -> Path:
    """A variant name, zoo name or path; `fp16` / `bf16` / `base` (when tokq.toml does not define them) name
    the 16-bit model the other side was quantized from (its tokq_quantization.json records it)."""
    from tokq.errors import ConfigError
    from tokq.project import find_variant
    from tokq.zoo import resolve_model

    if name in BASE_NAMES and find_variant(name) is None:
        if other is None:
            raise ConfigError(f"{name!r} names the 16-bit base of the other model, but both sides are {name!r}")
        record = resolve_model(other) / "tokq_quantization.json"
        source = json.loads(record.read_text()).get("source_checkpoint") if record.is_file() else None
        if not source:
            raise ConfigError(f"{name!r} names the 16-bit base of {other}, which records none (no tokq_quantization.json "
                              "with source_checkpoint): name the base model's directory or zoo name instead")
        return resolve_model(source)
    return resolve_model(name)


def _thresholds(values: dict[str, list[str]]) -> dict[str, dict[str | None, float]]:
    """--max-kl 0.05 --max-kl 4K-8K=0.1 -> {"max_kl": {None: 0.05, "4K-8K": 0.1}}. A label must be overall or a
    position bucket (config.bucket_problem): any other text would be copied into the reports, and match nothing."""
    from tokq.config import bucket_problem
    from tokq.errors import ConfigError

    out: dict[str, dict[str | None, float]] = {}
    for name, items in values.items():
        flag = f"--{name.replace('_', '-')}"
        for item in items or []:
            bucket, _, value = item.rpartition("=")
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"{flag} {item!r}: give a number, or BUCKET=number (e.g. 4K-8K=0.1)") from None
            if not math.isfinite(number):  # nan would make every comparison false: a silent pass
                raise ConfigError(f"{flag} {item!r}: give a finite number")
            problem = bucket_problem(name, bucket) if bucket else None
            if problem:
                raise ConfigError(f"{flag} {item!r} {problem}")
            out.setdefault(name, {})[None if bucket in ("", "overall") else bucket] = number
    return out


def thresholds_from_config() -> dict[str, dict[str | None, float]]:
    """`[compare.thresholds]` of tokq.toml: max_kl = 0.05, or max_kl = { overall = 0.05, "4K-8K" = 0.1 }, checked
    as the gate checks it (config.compare_thresholds: errors name file:line)."""
    from tokq.config import compare_thresholds
    from tokq.project import find_config

    path = find_config()
    return {} if path is None else compare_thresholds(path)


def compare_pair(a: str, b: str, runtime, *, data: Path | None = None, window: int = 2048, stride: int | None = None,
                 max_tokens: int | None = None, sample_windows: int | None = None, topk: int = 256,
                 full_kl_rows: int = 256,
                 decode_windows: int = 2, decode_tokens: int = 128, probes: bool = True,
                 probe_max_context: int | None = None, probe_depths: int = 5, probe_repeats: int = 1,
                 thresholds: dict | None = None, threshold_on: str = "bound",
                 resamples: int = 1000,
                 use_cache: bool = True, dtype: str = "auto", kv_dtype: str = "auto", b_kv_dtype: str | None = None,
                 kv_memory: str | None = None, strict: bool = False, seed: int = 0,
                 limits: ReadLimits | None = None) -> dict:
    """Everything `tokq compare` does after parsing its options (the gate calls it too): the result JSON."""
    from tokq.engine.checkpoint import load_model
    from tokq.engine.config import read_config
    from tokq.engine.kv_cache import parse_bytes
    from tokq.engine.llm_engine import EngineConfig, LLMEngine
    from tokq.engine.tokenizer import check_windows_fit, load_tokenizer, model_adds_bos
    from tokq.errors import ConfigError, DataError
    from tokq.evalsuite.compare import CompareSettings, ModelRun, run_compare, token_window_docs
    from tokq.longctx.documents import load_documents
    from tokq.longctx.probes import evenly_spaced_depths
    from tokq.longctx.windows import as_text_encoder, build_windows
    from tokq.paths import data_dir

    for flag, value in (("--topk", topk), ("--resamples", resamples), ("--window", window),
                        ("--probe-depths", probe_depths), ("--probe-repeats", probe_repeats)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    if full_kl_rows < 0:
        raise ConfigError(f"--full-kl-rows {full_kl_rows}: must be >= 0 (0: the top-k lower bound of the KL only)")
    if threshold_on not in ("bound", "point"):
        raise ConfigError(f"--threshold-on {threshold_on!r}: use bound (the CI's unfavourable bound) or point")
    ckpt_b = resolve_variant(b, a)
    ckpt_a = resolve_variant(a, b)
    config_a, config_b = read_config(ckpt_a), read_config(ckpt_b)
    context = min(config_a.max_position_embeddings, config_b.max_position_embeddings)
    if window > context:
        raise DataError(f"--window {window} exceeds the models' context of {context} tokens: use --window {context} "
                        "or less")
    tok_a, tok_b = load_tokenizer(ckpt_a), load_tokenizer(ckpt_b)
    if config_a.vocab_size != config_b.vocab_size or tok_a.get_vocab() != tok_b.get_vocab():
        raise ConfigError(f"{a} and {b} use different tokenizers (vocabularies of {len(tok_a.get_vocab())} and "
                          f"{len(tok_b.get_vocab())} tokens): per-token metrics need the same tokens; compare variants "
                          "of one model")
    topk = min(topk, config_a.vocab_size)  # more than the vocabulary is all of it: the KL is exact
    if data is None:
        data = data_dir() / "default"
        if not data.is_dir():
            raise DataError(f"the default document set {data} is not built yet: run `tokq data build-default` or "
                            "pass --data DIR")
    docs = load_documents(data, strict=strict, limits=limits)
    add_bos = model_adds_bos(tok_a)
    encoder = as_text_encoder(tok_a, add_bos)
    # not every document encoded up front: with --max-tokens, only as much as the windows can reach
    windows = build_windows(docs.documents, encoder, window, stride, add_bos, max_tokens)
    if sample_windows is not None:
        if sample_windows < 1:
            raise ConfigError(f"--sample-windows {sample_windows}: must be >= 1")
        windows = windows.sample(sample_windows)
    if not windows.windows:
        raise DataError(f"{data}: no document yields a window of at least 16 tokens; add longer documents")
    check_windows_fit(windows.windows, config_a.vocab_size, a, tok_a)
    capacity = window - int(add_bos)
    used = {w.doc_id for w in windows.windows}
    shorter = sum(1 for d in used if windows.doc_tokens[d] <= capacity)
    console.print(f"{len(windows.windows)} windows from {len(used)} documents ({shorter} shorter than a window, used "
                  f"whole; {len(used) - shorter} longer, windowed by {windows.stride}); "
                  f"{len(windows.dropped_documents)} too short to score", highlight=False)
    compute = dtype if dtype != "auto" else ("fp16" if runtime.device.startswith("cuda") else "bf16")
    budget = parse_bytes(kv_memory) if kv_memory else None
    probe_ctx = min(probe_max_context or window, context)
    engine_len = max(window, probe_ctx + 16)
    _check_power(thresholds or {}, threshold_on, window, probe_ctx, probe_depths, probe_repeats,
                 min(engine_len, context) if probes else None, len(used))

    def loader(checkpoint: Path, tokenizer, cache_dtype: str):
        def load() -> LLMEngine:
            model = load_model(checkpoint, dtype=compute, device=runtime.device)
            return LLMEngine(model, EngineConfig(max_model_len=min(engine_len, context), kv_memory=budget,
                                                 kv_dtype=cache_dtype, max_num_seqs=4,
                                                 max_num_batched_tokens=max(2048, window)), tokenizer)
        return load

    settings = CompareSettings(window=window, stride=windows.stride, max_tokens=max_tokens, topk=topk,
                               full_kl_rows=full_kl_rows,
                               decode_windows=decode_windows, decode_tokens=decode_tokens, probes=probes,
                               probe_max_context=probe_ctx, probe_depths=evenly_spaced_depths(probe_depths),
                               probe_repeats=probe_repeats, resamples=resamples, seed=seed, use_cache=use_cache,
                               dtype=compute, kv_dtype=kv_dtype, kv_memory=budget, thresholds=thresholds or {},
                               threshold_on=threshold_on)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("windows"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        def track(label: str, total: int):
            task = progress.add_task(label, total=total)
            return lambda n: progress.advance(task, n)

        result = run_compare(ModelRun(a, ckpt_a, loader(ckpt_a, tok_a, kv_dtype), tok_a),
                             ModelRun(b, ckpt_b, loader(ckpt_b, tok_b, b_kv_dtype or kv_dtype), tok_b),
                             windows, token_window_docs(windows), settings,
                             probe_documents=[d for d in docs.documents if d.doc_id in used][:50], progress=track)
    result["data"] = {"path": str(data), "documents": len(docs.documents), "skipped": len(docs.skipped),
                      "shorter_than_window": shorter, "windowed": len(used) - shorter}
    result["runtime"] = runtime.to_json()
    result["kv_dtype"] = {"a": kv_dtype, "b": b_kv_dtype or kv_dtype}
    result["data"] = {"path": str(data), "documents": len(docs.documents), "skipped": len(docs.skipped),
                      "shorter_than_window": shorter, "windowed": len(used) - shorter}
    result["runtime"] = runtime.to_json()
    result["kv_dtype"] = {"a": kv_dtype, "b": b_kv_dtype or kv_dtype}
    return result


def _check_power(thresholds: dict, on: str, window: int, probe_ctx: int, probe_depths: int, probe_repeats: int,
                 engine_len: int | None, documents: int) -> None:
    """Refuse, before minutes of scoring, a threshold this run cannot decide (evalsuite.power): e.g.
    --max-flip-rate 0.25 over 5 probes, whose exact upper bound is 0.52 even with no flip. engine_len None:
    no probes run."""
    from tokq.evalsuite.compare import THRESHOLD_METRICS
    from tokq.evalsuite.power import Sample, check_thresholds
    from tokq.longctx.probes import probe_grid

    n_probes = probe_grid(window, probe_ctx, probe_depths, probe_repeats, engine_len).size if engine_len else 0
    sample = Sample("this run", n_probes, documents, more_probes="raise --probe-repeats / --probe-depths",
                    more_documents="give more documents, or raise --sample-windows")
    check_thresholds(thresholds, {name: direction for name, (_, direction) in THRESHOLD_METRICS.items()}, on, sample)


def compare_cmd(
    a: str = typer.Argument(..., help="Baseline: a tokq.toml variant, zoo name, checkpoint directory, or fp16 "
                                      "(the base B was quantized from)."),
    b: str = typer.Argument(..., help="Candidate: a tokq.toml variant, zoo name or checkpoint directory."),
    data: Path = typer.Option(None, "--data", help="Folder of documents (default: the default long-document set)."),
    window: int = typer.Option(2048, "--window", help="Tokens per window (BOS included where the model uses one)."),
    stride: int = typer.Option(None, "--stride", help="Document tokens between window starts (default: no overlap)."),
    max_tokens: int = typer.Option(None, "--max-tokens", help="Stop after this many window tokens in total."),
    sample_windows: int = typer.Option(None, "--sample-windows",
                                       help="Score only this many windows, spread evenly over all documents."),
    topk: int = typer.Option(256, "--topk", help="A's top-k kept per position (KL over it + the remaining mass; the "
                             "default from benchmarks/kl_topk.py)."),
    full_kl_rows: int = typer.Option(256, "--full-kl-rows", help="Positions per path both models score over the whole "
                                     "vocabulary: the KL beyond A's top-k is measured there and estimated for the rest "
                                     "(0: the top-k lower bound only; at least the scored tokens: exact)."),
    decode_windows: int = typer.Option(2, "--decode-windows", help="Windows also scored through the decode path."),
    decode_tokens: int = typer.Option(128, "--decode-tokens", help="Positions per decode window run one token at a time."),
    probes: bool = typer.Option(True, "--probes/--no-probes", help="Passkey retrieval probes on the documents."),
    probe_max_context: int = typer.Option(None, "--probe-max-context",
                                          help="Longest probe context (default: the window)."),
    probe_depths: int = typer.Option(5, "--probe-depths", help="Needle depths per probe context, evenly spaced 0..1."),
    probe_repeats: int = typer.Option(1, "--probe-repeats", help="Probes per (context, depth), each with its own key: "
                                      "more probes narrow the flip rate's exact interval."),
    max_kl: list[str] = typer.Option(None, "--max-kl", help="Fail above this mean KL (or BUCKET=value)."),
    min_top1: list[str] = typer.Option(None, "--min-top1", help="Fail below this top-1 agreement (or BUCKET=value)."),
    max_ppl_ratio: list[str] = typer.Option(None, "--max-ppl-ratio", help="Fail above this perplexity ratio B/A."),
    max_flip_rate: list[str] = typer.Option(None, "--max-flip-rate", help="Fail when the flip rate's (A right, B "
                                            "wrong) exact upper 95% bound is above this."),
    max_kl_p95: list[str] = typer.Option(None, "--max-kl-p95", help="Fail above this 95th percentile of per-token KL."),
    max_kl_p99: list[str] = typer.Option(None, "--max-kl-p99", help="Fail above this 99th percentile of per-token KL."),
    max_rms_delta_p: list[str] = typer.Option(None, "--max-rms-delta-p", help="Fail above this RMS of Δp (actual "
                                              "token's probability, B − A)."),
    threshold_on: str = typer.Option("bound", "--threshold-on", help="bound: a threshold fails when the 95% CI's "
                                     "unfavourable bound crosses it; point: when the estimate does."),
    resamples: int = typer.Option(1000, "--resamples", help="Bootstrap resamples for the 95% CIs."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Score A again instead of reading its cached scores."),
    dtype: str = typer.Option("auto", "--dtype", help="Compute dtype: auto (bf16 on CPU, fp16 on CUDA), fp32, bf16, fp16."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="KV cache dtype for both models: auto, fp16, bf16, fp32, fp8."),
    b_kv_dtype: str = typer.Option(None, "--b-kv-dtype", help="B's KV cache dtype when it differs from A's (e.g. "
                                                              "fp8: compare a model with itself on an fp8 cache)."),
    kv_memory: str = typer.Option(None, "--kv-memory", help="KV cache budget per model (e.g. 2GiB)."),
    strict: bool = typer.Option(False, "--strict", help="Fail on unreadable or binary files instead of skipping them."),
    max_doc_mb: float = typer.Option(DEFAULT_MAX_DOC_MB, "--max-doc-mb", help=MAX_DOC_MB_HELP),
    max_file_mb: float = typer.Option(DEFAULT_MAX_FILE_MB, "--max-file-mb", help=MAX_FILE_MB_HELP),
    json_path: Path = typer.Option(None, "--json", help="Write every number as JSON to this path."),
    report_dir: Path = typer.Option(None, "--report-dir", help="Write report.json, report.md, report.html (plots) and "
                                                               "junit.xml to this folder."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap, the probes and the decode sample."),
) -> None:
    """Score the same windows with A and B; KL, top-1, ΔNLL by position with CIs; exit 1 on a regression."""
    from tokq.reports.json_io import check_json_target, write_json
    from tokq.reports.markdown import compare_markdown
    from tokq.runtime import setup_runtime

    check_json_target(json_path)  # refused before minutes of scoring, not after
    runtime = setup_runtime(threads, device, seed)
    if report_dir:  # refused before minutes of scoring, not after
        from tokq.reports.folder import check_report_folder

        check_report_folder(report_dir, "--report-dir")
    # thresholds given on the command line replace tokq.toml's [compare.thresholds] of the same name
    thresholds = {**thresholds_from_config(), **_thresholds({"max_kl": max_kl, "min_top1": min_top1,
                                                             "max_ppl_ratio": max_ppl_ratio,
                                                             "max_flip_rate": max_flip_rate, "max_kl_p95": max_kl_p95,
                                                             "max_kl_p99": max_kl_p99,
                                                             "max_rms_delta_p": max_rms_delta_p})}
    result = compare_pair(a, b, runtime, data=data, window=window, stride=stride, max_tokens=max_tokens,
                          sample_windows=sample_windows, topk=topk, full_kl_rows=full_kl_rows,
                          decode_windows=decode_windows,
                          decode_tokens=decode_tokens, probes=probes, probe_max_context=probe_max_context,
                          probe_depths=probe_depths, probe_repeats=probe_repeats,
                          thresholds=thresholds, threshold_on=threshold_on, resamples=resamples,
                          use_cache=not no_cache, dtype=dtype,
                          kv_dtype=kv_dtype, b_kv_dtype=b_kv_dtype, kv_memory=kv_memory, strict=strict, seed=seed,
                          limits=read_limits(max_doc_mb, max_file_mb))
    print(compare_markdown(result), end="")
    if json_path:
        write_json(json_path, result)
    if report_dir:
        from tokq.reports.compare_report import write_report

        console.print(f"report: {write_report(report_dir, result)}")
    if not result["passed"]:
        # a rule the data could not decide (all unmet rules inconclusive) is exit 3, never a pass or a regression
        undecided = all(t["passed"] or t.get("inconclusive") for t in result["thresholds"])
        raise typer.Exit(EXIT_INCONCLUSIVE if undecided else EXIT_CHECK_FAILED)
