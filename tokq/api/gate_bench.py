"""The gate's speed experiment: base and variant on the [bench] workload, paired and interleaved by blocks of
engine steps in one process (engine.paired_bench), analysed with bootstrap intervals (evalsuite.speed_stats)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

console = Console(stderr=True)


def paired_bench(project, checkpoint: Path, base: Path, runtime, seed: int) -> dict:
    """The paired speed experiment (engine.paired_bench) on the [bench] workload and its analysis."""
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from tokq.engine.checkpoint import load_model
    from tokq.engine.paired_bench import SIDES, paired_engines, run_paired
    from tokq.engine.roofline import copy_bandwidth, decode_roofline
    from tokq.engine.workload import Workload
    from tokq.evalsuite.speed_stats import analyze
    from tokq.machine_load import LoadMonitor

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
    with Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True) as progress:
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
