"""The gate's speed experiment: base and variant on the [bench] workload, paired and interleaved by blocks of
engine steps in one process (engine.paired_bench), analysed with bootstrap intervals (evalsuite.speed_stats);
when a side is a URL, paired blocks of requests over HTTP instead (remote.paired_http_bench), the same analysis."""

from __future__ import annotations

import contextlib
from pathlib import Path

from rich.console import Console

console = Console(stderr=True)


def paired_bench(project, checkpoint: Path, base: Path, runtime, seed: int) -> dict:
    """The paired speed experiment (engine.paired_bench) on the [bench] workload and its analysis."""
    from rich.progress import TextColumn, TimeElapsedColumn

    from tokq.engine.checkpoint import load_model
    from tokq.engine.paired_bench import SIDES, paired_engines, run_paired
    from tokq.engine.roofline import copy_bandwidth, decode_roofline
    from tokq.engine.workload import Workload
    from tokq.evalsuite.speed_stats import analyze
    from tokq.machine_load import LoadMonitor
    from tokq.progress import progress_display

    w = project.bench
    workload = Workload(w.prompt_len, w.gen_len, w.num_prompts or w.concurrency, w.gen_len_range,
                        w.arrival_rate or float("inf"), seed)
    from tokq.dtypes import compute_dtype_name

    compute = compute_dtype_name(project.dtype, runtime.device)
    bandwidth = copy_bandwidth(runtime.device)["gbps_median"]
    models = {"base": load_model(base, dtype=compute, device=runtime.device),
              "variant": load_model(checkpoint, dtype=compute, device=runtime.device)}
    engines = paired_engines(models, workload, w.concurrency)
    monitor = LoadMonitor()
    with progress_display(TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("paired bench: pass 0", total=None)
        trace = run_paired(engines, workload, models["base"].config.vocab_size, budget_s=w.max_seconds,
                           block_steps=w.block_steps,
                           on_pass=lambda n, s: progress.update(task, description=f"paired bench: pass {n}, "
                                                                                  f"{s:.0f} s"))
    load = monitor.stop()
    analysis = analyze(trace, seed=seed)
    batch = min(workload.num_requests, w.concurrency)
    sides = {}
    for s in SIDES:
        engine = engines[s]
        roof = decode_roofline(models[s], engine.kv_spec.bytes_per_token, batch,
                               workload.prompt_len + workload.gen_len / 2, bandwidth)
        tpot = analysis.metrics[s]["mean_tpot_ms"] / 1e3
        weights = sum(t.numel() * t.element_size() for t in [*models[s].parameters(), *models[s].buffers()])
        sides[s] = {"metrics": analysis.metrics[s], "kernels": engine.kernel_names, "roofline": roof,
                    "roofline_fraction": roof["roofline_step_s"] / tpot if tpot > 0 else None,
                    "stalls": len(analysis.stalls[s])}
        sides[s]["memory"] = {"weights_bytes": weights, "kv_cache_bytes": engine.kv_cache_bytes}
    return {"workload": workload.to_json(), "max_seconds": w.max_seconds, "block_steps": w.block_steps,
            "copy_bandwidth_gbps": bandwidth, "seconds": trace.seconds, "passes": len(trace.passes),
            "stopped_by": trace.stopped_by, "machine_load": load, "analysis": analysis.to_json(),
            "base": sides["base"], "variant": sides["variant"],
            "memory": {s: sides[s]["memory"] for s in SIDES}, "_analysis": analysis}


def paired_http_bench(project, sides: dict[str, str | Path], runtime, seed: int, timeout: float = 600.0) -> dict:
    """The paired speed experiment over HTTP (remote.paired_http_bench) when a side is a URL: `sides` maps "base"
    and "variant" to a compare side (`url=...#model=...`) or a local checkpoint, which is served in this process
    for the duration, so that both sides are measured by the same client over the same HTTP path."""
    from rich.progress import TextColumn, TimeElapsedColumn

    from tokq.engine.tokenizer import load_tokenizer
    from tokq.engine.workload import Workload
    from tokq.progress import progress_display
    from tokq.remote.endpoint_scoring import parse_side
    from tokq.remote.paired_http_bench import (
        SIDES,
        HttpSide,
        HttpWorkload,
        analyze_http,
        run_paired_http,
        serve_checkpoint,
    )
    from tokq.remote.urls import redact

    w = project.bench
    lengths = Workload(w.prompt_len, w.gen_len, w.num_prompts or w.concurrency, w.gen_len_range,
                       w.arrival_rate or float("inf"), seed).output_lengths()
    workload = HttpWorkload(w.prompt_len, lengths, w.concurrency, w.arrival_rate)
    specs = {s: parse_side(str(sides[s])) for s in SIDES}
    local = {s: Path(sides[s]) for s in SIDES if specs[s] is None}
    tokenizer_dir = next(iter(local.values()), None) or next(
        (Path(spec.tokenizer) for spec in specs.values() if spec and spec.tokenizer), None)
    if tokenizer_dir is None:  # the gate's base is local today; a both-URL caller must name a tokenizer
        from tokq.errors import ConfigError

        raise ConfigError("both sides are URLs: name the served models' tokenizer (url=...#tokenizer=DIR)")
    tokenizer = load_tokenizer(tokenizer_dir)
    with contextlib.ExitStack() as served:
        http = {}
        for s in SIDES:
            if specs[s] is not None:
                http[s] = HttpSide(specs[s].connect_url, specs[s].model, "url")
                continue
            # the engine holds the whole block at once: concurrency sequences of prompt + output (+ a BOS, slack)
            url = served.enter_context(serve_checkpoint(
                local[s], local[s].name, max_model_len=w.prompt_len + max(lengths) + 16,
                max_num_seqs=w.concurrency, dtype=project.dtype, device=str(runtime.device)))
            http[s] = HttpSide(url, None, "in_process")
        with progress_display(TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=True) as progress:
            task = progress.add_task("paired bench over HTTP: block 0", total=None)
            trace = run_paired_http(http, tokenizer, workload, budget_s=w.max_seconds, seed=seed, timeout_s=timeout,
                                    on_block=lambda n, t: progress.update(
                                        task, description=f"paired bench over HTTP: block {n}, {t:.0f} s"))
    analysis = analyze_http(trace, seed=seed)
    load = trace.machine_load
    side_rows = {s: {"metrics": analysis.metrics[s], "url": redact(http[s].url), "model": trace.models[s],
                     "served": http[s].served, "stalls": len(analysis.stalls[s]), "memory": None,
                     "kernels": None, "roofline_fraction": None} for s in SIDES}
    return {"over": "http", "urls": trace.urls, "models": trace.models,
            "served": {s: http[s].served for s in SIDES},
            "workload": {"prompt_len": w.prompt_len, "output_lens": lengths, "concurrency": w.concurrency,
                         "arrival_rate": w.arrival_rate, "ignore_eos": True, "temperature": 0.0},
            "max_seconds": w.max_seconds, "block_steps": None, "seconds": trace.seconds,
            "passes": len(trace.blocks), "blocks": len(trace.blocks), "stopped_by": trace.stopped_by,
            "machine_load": load, "client_load_average": load.get("load_average_end"),
            "analysis": analysis.to_json(), "base": side_rows["base"], "variant": side_rows["variant"],
            "memory": None, "_analysis": analysis}


def http_speed_verdicts(rules, analysis) -> list[dict]:
    """The speed rules on the HTTP experiment (evalsuite.gate_rules), and the memory rules, which no endpoint
    reports: not measured, inconclusive (never a pass)."""
    from tokq.evalsuite.gate_rules import speed_verdicts
    from tokq.evalsuite.rule_defs import MEMORY_MEASURES

    out = []
    for rule in rules:
        if rule.name not in MEMORY_MEASURES:
            row = speed_verdicts([rule], analysis, {})[0]
            if row["value"] is not None:  # "... (N passes, M block segments)": here both are block pairs
                row["rule"] = row["rule"].rsplit(" (", 1)[0] + f" ({analysis.passes} block pairs over HTTP)"
            out.append(row)
            continue
        label = MEMORY_MEASURES[rule.name][0]
        out.append({"kind": "speed", "name": rule.name, "metric": label, "bucket": None,
                    "threshold": rule.threshold, "direction": rule.direction, "value": None, "low": None,
                    "high": None, "result": "inconclusive", "passed": False, "inconclusive": True,
                    "rule": f"{label}: not measured (a side is served over HTTP, and an endpoint reports no "
                            "weight or KV byte counts): inconclusive, never a pass"})
    return out
