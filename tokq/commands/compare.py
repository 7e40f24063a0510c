"""`tokq compare A B --data DIR`: is B worse than A on these documents, where, and how sure are we.

The work is `tokq.api.compare` (also `tokq.compare(...)` from Python); this module parses the options.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console

from tokq.longctx.read_limits import (
    DEFAULT_MAX_DOC_MB,
    DEFAULT_MAX_FILE_MB,
    MAX_DOC_MB_HELP,
    MAX_FILE_MB_HELP,
)

console = Console(stderr=True)


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
    from tokq.config import compare_thresholds, find_config

    path = find_config()
    return {} if path is None else compare_thresholds(path)


def compare_cmd(
    a: str = typer.Argument(..., help="Baseline: a tokq.toml variant, zoo name, checkpoint directory, fp16 (the "
                                      "base B was quantized from), or a served model: url=http://HOST:PORT/v1"
                                      "#model=NAME&tokenizer=DIR&topk=K (/v1 and the # keys optional; an OpenAI-compatible server with prompt "
                                      "logprobs; the KL is then a lower bound, see --help's epilog)."),
    b: str = typer.Argument(..., help="Candidate: a tokq.toml variant (a url variant too), zoo name, checkpoint "
                                      "directory, or url=http://HOST:PORT/v1#model=NAME&tokenizer=DIR&topk=K "
                                      "(/v1 and the # keys optional)."),
    data: str = typer.Option(None, "--data", help="Folder of documents, or a tokq.toml \\[data.NAME] set name (its "
                                                  "keys apply where an option is left at its default; default: the "
                                                  "default long-document set)."),
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
    threshold_on: str = typer.Option("bound", "--threshold-on", help="bound: a threshold passes when the 95% CI's "
                                     "unfavourable bound is within it, fails when the whole CI is beyond it, is "
                                     "inconclusive otherwise; point: the estimate decides."),
    resamples: int = typer.Option(1000, "--resamples", help="Bootstrap resamples for the 95% CIs."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Score A again instead of reading its cached scores."),
    dtype: str = typer.Option("auto", "--dtype", help="Compute dtype: auto (bf16 on CPU, fp16 on CUDA), fp32, bf16, fp16."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="KV cache dtype for both models: auto (a checkpoint's "
                                 "calibrated int8/fp8 cache, else the compute dtype), fp16, bf16, fp32, fp8, int8."),
    b_kv_dtype: str = typer.Option(None, "--b-kv-dtype", help="B's KV cache dtype when it differs from A's (e.g. "
                                                              "fp8: compare a model with itself on an fp8 cache)."),
    b_kv_scales: str = typer.Option("auto", "--b-kv-scales", help="B's int8/fp8 KV scales: auto (the checkpoint's "
                                    "calibrated ones, from `tokq quantize --kv-cache`) or unit (scale 1, fp8 only)."),
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
    max_concurrency: int = typer.Option(8, "--max-concurrency", help="Requests in flight to a url= side (a fleet "
                                        "behind the URL sets the throughput)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds one request to a url= side may take in all, "
                                  "retries and a slowly sending server included."),
) -> None:
    """Score the same windows with A and B; KL, top-1, ΔNLL by position with CIs; exit 1 on a regression.

    A side may be a served model, url=http://HOST:PORT/v1 (/v1 optional) with optional #model=NAME (the served name; default the
    server's first), &tokenizer=DIR (the served model's tokenizer, needed when both sides are URLs) and &topk=K
    (default 20, capped by the server's --max-logprobs). Each window is sent as token ids with prompt_logprobs=K
    (vLLM, tokq serve) or logprobs=K with echo (llama.cpp), and the echoed tokens are checked against the window.
    A URL side reports only its own top-K: ΔNLL, Δp and top-1 stay exact, `kl` is a rigorous lower bound (a max-kl
    rule can fail on it, never pass: inconclusive at best) and `kl_estimate` a point estimate."""
    from dataclasses import fields

    from tokq.api.compare import resolve_data, run_compare_settings
    from tokq.reports.json_io import check_json_target
    from tokq.runtime import setup_runtime
    from tokq.settings import CompareSettings

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
    given = dict(window=window, stride=stride, max_tokens=max_tokens, sample_windows=sample_windows, topk=topk,
                 full_kl_rows=full_kl_rows, decode_windows=decode_windows, decode_tokens=decode_tokens,
                 probes=probes, probe_max_context=probe_max_context, probe_depths=probe_depths,
                 probe_repeats=probe_repeats, thresholds=thresholds, threshold_on=threshold_on,
                 resamples=resamples, use_cache=not no_cache, dtype=dtype, kv_dtype=kv_dtype, b_kv_dtype=b_kv_dtype,
                 b_kv_scales=b_kv_scales, kv_memory=kv_memory, strict=strict, max_doc_mb=max_doc_mb, max_file_mb=max_file_mb, seed=seed,
                 max_concurrency=max_concurrency, timeout=timeout)
    folder, set_keys = resolve_data(data)
    defaults = {f.name: f.default for f in fields(CompareSettings)}
    # a [data.NAME] set's keys apply where the command line left the default
    given.update({k: v for k, v in set_keys.items() if given[k] == defaults[k]})
    result = run_compare_settings(a, b, folder, CompareSettings(**given), runtime)
    print(result.to_markdown(), end="")
    if json_path:
        result.write_json(json_path)
    if report_dir:
        console.print(f"report: {result.write_report(report_dir)}")
    if not result.passed:
        # a rule the data could not decide (all unmet rules inconclusive) is exit 3, never a pass or a regression
        raise typer.Exit(result.exit_code)
