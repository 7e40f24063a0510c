"""Building a `target = "gate"` variant: the smallest mix of its recipe's formats that passes [gate.quality].

The algorithm and the rule against tuning on the gate's own windows are in tokq.mixed.gate_search; this module
wires it to tokq: the documents of the gate's [data.NAME] set that its windows do not use, split into choice and
held-out parts and written to scratch folders (calibration and sensitivities read the choice part; every candidate
build is compared with the base on the held-out part by `run_compare_settings` with the gate's own settings and
rules), and the chosen point built into the variant's path with the recipe's hash and the search record in its
tokq_quantization.json (the gate report draws it).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from tokq.errors import ConfigError

console = Console(stderr=True)

FRONTIER_POINTS = 64  # asked of the knapsack; thinned to points whose predicted KL differs


def _write_documents(documents, folder: Path) -> Path:
    """The documents as numbered text files (a folder the compare and the calibration read like any other)."""
    folder.mkdir(parents=True)
    for i, doc in enumerate(documents):
        (folder / f"doc{i:04d}.txt").write_text(doc.text, encoding="utf-8")
    return folder


def build_for_gate(base: Path, name: str, recipe: dict, target: Path, data_set, compare_settings, runtime,
                   recipe_sha256: str, force: bool, threads: int | None, device: str) -> dict:
    """Search, then build the chosen mix into `target`; returns the search record (also in tokq_quantization.json)."""
    from tokq.api.compare import data_set_settings, run_compare_settings
    from tokq.api.compare_windows import document_windows
    from tokq.api.quantize import run_quantize
    from tokq.engine.tokenizer import load_tokenizer
    from tokq.longctx.read_limits import read_limits
    from tokq.mixed.gate_search import (
        MARGIN,
        PASS,
        Evaluation,
        GateSearch,
        bisect_smallest_passing,
        first_guess,
        frontier_points,
        search_documents,
        thin_by_kl,
        tightened,
        tightest_max_kl,
    )
    from tokq.mixed.knapsack import frontier
    from tokq.mixed.search import calibrate
    from tokq.mixed.splits import split_documents
    from tokq.quantization.layer_schemes import DENSE
    from tokq.quantization.recipe import gate_target_problem, split_recipe
    from tokq.settings import QuantizeSettings

    settings_keys, _runtime_keys = split_recipe(recipe)
    problem = gate_target_problem(recipe)  # tokq.toml was checked on load; a recipe from Python may not be
    if problem:
        raise ConfigError(problem)
    folder, _keys = data_set_settings(data_set)
    s = compare_settings
    tokenizer = load_tokenizer(base)
    limits = read_limits(s.max_doc_mb, s.max_file_mb)
    _data, docs, windows, _add_bos = document_windows(folder, tokenizer, s.window, s, limits)
    gate_docs = {w.doc_id for w in windows.windows}
    rest = search_documents(docs.documents, gate_docs)
    choice, held_out = split_documents(rest)
    console.print(escape(f"variant {name}: searching for the smallest mix of {settings_keys['mix']} that passes "
                         f"[gate.quality], on {len(choice)} + {len(held_out)} documents of [data.{data_set.name}] "
                         f"that the gate's windows ({len(gate_docs)} documents) do not use"), highlight=False)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.search-", dir=target.parent))
    try:
        choice_dir = _write_documents(choice, scratch / "choice")
        held_dir = _write_documents(held_out, scratch / "held_out")
        base_settings = QuantizeSettings(**{**settings_keys, "calib": choice_dir})
        sensitivity, costs, sizes, all_quantized = _measure(base, choice, settings_keys["mix"], base_settings,
                                                            folder, runtime, choice_dir)
        scaled, _low, calibration = calibrate(costs, sizes, all_quantized)
        # a point with every Linear at 16 bits is the base itself, not a quantized build
        points = thin_by_kl([p for p in frontier_points(frontier(scaled, sizes, FRONTIER_POINTS))
                             if any(fmt != DENSE for fmt in p.assignment.values())])
        uniform = _uniform_points(sizes, scaled)
        record = GateSearch({"gate_windows": len(gate_docs), "choice": len(choice), "held_out": len(held_out)},
                            points, uniform)
        search_settings = replace(s, use_cache=True, thresholds=tightened(s.thresholds or {}))

        def judge(index: int) -> Evaluation:
            point = points[index]
            out = scratch / f"build{index}"
            console.print(escape(f"variant {name}: trying {point.label} ({point.bytes / 2**20:.2f} MiB of Linears, "
                                 f"predicted KL {point.predicted_kl:.4f})"), highlight=False)
            built = run_quantize(str(base), out, base_settings, layer_assignment=point.assignment,
                                 threads=threads, device=device)
            result = run_compare_settings(str(base), str(out), held_dir, search_settings, runtime)
            verdict = PASS if result.passed else "inconclusive" if result.inconclusive else "fail"
            evaluation = Evaluation(index, verdict, built.size_bytes, result.rules, _overall_kl(result.data))
            shutil.rmtree(out, ignore_errors=True)
            console.print(escape(f"variant {name}: {point.label}: {evaluation.result} on the held-out documents"),
                          highlight=False)
            return evaluation

        chosen, record.evaluations = bisect_smallest_passing(points, judge, first_guess(points, tightest_max_kl(
            search_settings.thresholds)))
        if chosen is None:
            # none passed within the build budget: the widest point judged is built, and the gate will say FAIL
            chosen = max(e.index for e in record.evaluations)
            record.note = "no build judged passed on the held-out documents; the widest one judged was built"
        record.chosen = chosen
        record_json = {**record.to_json(), "calibration": calibration, "sensitivity_seconds": sensitivity.seconds,
                       "sensitivity_notes": sensitivity.notes,
                       "margin": MARGIN, "search_rules": {rule: {str(b or "overall"): t for b, t in by.items()}
                                                          for rule, by in search_settings.thresholds.items()}}
        run_quantize(str(base), target, base_settings, layer_assignment=points[chosen].assignment, force=force,
                     recipe_sha256=recipe_sha256, threads=threads, device=device,
                     extra_provenance={"gate_search": record_json})
        return record_json
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(base: Path, choice, mix: str, settings, folder: Path, runtime, choice_dir: Path):
    """(SensitivityResult, costs, sizes, all-quantized KL) of the mix's formats on windows of the choice documents:
    what `tokq quantize --mix` measures (api.quantize_mix), on the fp32 base; GPTQ's own Linears for GPTQ,
    calibrated on the choice documents as its builds are."""
    from tokq.api.quantize import method_options
    from tokq.api.quantize_mix import (
        MIX_WINDOW,
        SENSITIVITY_WINDOWS,
        method_cost_weights,
        mix_costs,
        mix_sizes,
        mix_windows,
        sensitivity_progress,
        written_itemsize,
    )
    from tokq.dtypes import parse_dtype
    from tokq.engine.checkpoint import load_model
    from tokq.engine.config import read_config
    from tokq.engine.tokenizer import load_tokenizer, model_adds_bos
    from tokq.mixed.method_weights import measured_with_own_rounding
    from tokq.quantization.calibration import calibration_samples
    from tokq.quantization.layer_schemes import parse_mix
    from tokq.quantization.pipeline import NEEDS_CALIBRATION

    config = read_config(base)
    formats = parse_mix(mix, settings.method, config)
    tokenizer = load_tokenizer(base)
    window = min(settings.seq_len, MIX_WINDOW, config.max_position_embeddings)
    windows = mix_windows(choice, tokenizer, model_adds_bos(tokenizer), window, SENSITIVITY_WINDOWS, "choice", folder)
    lm = load_model(base, dtype="fp32", device=runtime.device)
    calibration = None
    if measured_with_own_rounding(settings.method) and settings.method in NEEDS_CALIBRATION:  # only its builds use it
        calibration = calibration_samples(choice_dir, tokenizer, model_adds_bos(tokenizer), settings.num_samples,
                                          settings.seq_len, settings.seed)
    weights = method_cost_weights(lm, settings.method, {k: v for k, v in formats.items() if v is not None},
                                  calibration, method_options(settings))
    sens, costs, all_quantized = mix_costs(lm, windows, formats, settings.seed, sensitivity_progress(),
                                           weights=weights)
    del weights
    dtype = None if settings.save_dtype == "auto" else parse_dtype(settings.save_dtype)
    sizes = mix_sizes(lm, formats, written_itemsize(config, dtype))
    return sens, costs, sizes, all_quantized


def _uniform_points(sizes, costs):
    """format -> the all-that-format point (bytes, predicted KL) for the report, formats every Linear has."""
    from tokq.mixed.gate_search import FrontierPoint

    formats = set.intersection(*(set(per) for per in sizes.values()))
    out = {}
    for fmt in sorted(formats):
        assignment = dict.fromkeys(sizes, fmt)
        out[fmt] = FrontierPoint(sum(int(sizes[u][fmt]) for u in sizes), sum(float(costs[u][fmt]) for u in sizes),
                                 assignment, f"uniform {fmt}")
    return out


def _overall_kl(data: dict) -> dict | None:
    kl = (data.get("prefill") or {}).get("overall", {}).get("kl")
    return None if kl is None else {k: kl.get(k) for k in ("value", "low", "high")}
